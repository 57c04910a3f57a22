"""mok_jax.Recipe: the values, what `moe` accepts, and the attribute the handlers get."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax
from mok_jax._src import ext, primitives
from mok_jax.recipe import resolve
from mok_jax.reference import moe_reference

from flax import nnx

from conftest import assert_bitwise, make_problem


def test_recipes_are_the_extensions_values():
    assert {r.name.lower(): int(r) for r in mok_jax.Recipe} == ext.recipes()
    assert resolve(None) is mok_jax.Recipe.NATIVE
    assert resolve("native") is resolve(mok_jax.Recipe.NATIVE) is mok_jax.Recipe.NATIVE


@pytest.mark.parametrize("recipe", ["fp4", 7, "NATIVE2", 0.5, "FP8", "Native"])
def test_a_recipe_this_version_lacks_is_a_value_error(recipe):
    x, ids, w, wgu, wd = make_problem(0, 8, 2, 4, 16, 8, jnp.float32)
    with pytest.raises(ValueError, match=r"mok_jax.moe: recipe must be one of None, 'native', 'fp8'"):
        mok_jax.moe(x, ids, w, wgu, wd, recipe=recipe)
    with pytest.raises(ValueError, match=r"MoE: recipe must be one of"):
        mok_jax.nn.MoE(hidden_size=16, ffn_size=8, num_experts=4, top_k=2, recipe=recipe,
                       rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"moe_reference: recipe must be one of"):
        moe_reference(x, ids, w, wgu, wd, recipe=recipe)


def test_the_native_recipe_is_the_default():
    x, ids, w, wgu, wd = make_problem(1, 16, 2, 4, 16, 8, jnp.bfloat16)
    assert_bitwise(mok_jax.moe(x, ids, w, wgu, wd, recipe="native"),
                   mok_jax.moe(x, ids, w, wgu, wd), "y")


@pytest.mark.parametrize("recipe, dtype, value", [(None, jnp.float32, "0"),
                                                  ("fp8", jnp.bfloat16, "1")])
@pytest.mark.parametrize("backend, targets", [("auto", "mok_moe"), ("xla", "mok_expert_ffn")])
def test_the_recipe_reaches_the_handlers_as_an_attribute(recipe, dtype, value, backend,
                                                         targets):
    x, ids, w, wgu, wd = make_problem(2, 16, 2, 4, 16, 8, dtype)
    loss = lambda *a: mok_jax.moe(*a, recipe=recipe, backend=backend).astype(jnp.float32).sum()
    text = jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4))).lower(x, ids, w, wgu, wd).as_text()
    calls = re.findall(rf"custom_call @({targets}_\w+).*?recipe = (\d+) : i32", text)
    assert sorted(calls) == [(f"{targets}_bwd", value), (f"{targets}_fwd", value)]


def test_a_handler_refuses_a_recipe_value_it_does_not_know():
    x, ids, w, wgu, wd = make_problem(3, 8, 2, 4, 16, 8, jnp.float32)
    with pytest.raises(Exception, match=r"unknown recipe 7"):
        jax.block_until_ready(primitives.moe_fwd_p.bind(
            x, ids, w, wgu, wd, recipe=7, capacity=-1, save_gate_up=False))
    sizes = jnp.asarray(np.array([4, 4, 4, 4], np.int32))
    with pytest.raises(Exception, match=r"unknown recipe 7"):
        jax.block_until_ready(primitives.expert_ffn_fwd_p.bind(
            jnp.zeros((16, 16), jnp.float32), sizes, wgu, wd, recipe=7, save_gate_up=False))
