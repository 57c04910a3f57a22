"""Argument checks of mok_jax._src.ep.moe_on_virtual_ranks (its results are checked
on a GPU in tests/test_persistent_gpu.py)."""

import jax
import jax.numpy as jnp
import pytest

from mok_jax._src import ep


def _args(T=16, K=2, E=8, H=8, F=8, dtype=jnp.bfloat16):
    return (jnp.zeros((T, H), dtype), jnp.zeros((T, K), jnp.int32), jnp.ones((T, K)),
            jnp.zeros((E, H, 2 * F), dtype), jnp.zeros((E, F, H), dtype))


@pytest.mark.parametrize("ranks", [0, 3, 9, 16])
def test_ranks_must_be_1_to_8_and_divide_tokens_and_experts(ranks):
    with pytest.raises(ValueError, match="ranks must be in"):
        ep.moe_on_virtual_ranks(*_args(), ranks=ranks)


@pytest.mark.parametrize("ranks", [2.0, True, "2"])
def test_ranks_must_be_an_int(ranks):
    with pytest.raises(TypeError, match="ranks must be an int"):
        ep.moe_on_virtual_ranks(*_args(), ranks=ranks)


def test_takes_bfloat16_only_and_a_non_negative_capacity():
    with pytest.raises(TypeError, match="bfloat16 x"):
        ep.moe_on_virtual_ranks(*_args(dtype=jnp.float32), ranks=2)
    with pytest.raises(ValueError, match="capacity"):
        ep.moe_on_virtual_ranks(*_args(), ranks=2, capacity=-1)


def test_without_a_gpu_it_says_so():
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present: tests/test_persistent_gpu.py runs the op")
    with pytest.raises(RuntimeError, match="CUDA"):
        ep.moe_on_virtual_ranks(*_args(), ranks=2)
