"""`backend` really chooses the path (mok_jax.moe._choose_path), and every path gives
the same bits."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import mok_jax
from conftest import assert_bitwise, make_problem

T, K, E, H, F = 48, 3, 6, 16, 8


def _loss(backend, cf=None):
    def loss(x, w, wgu, wd, ids):
        y = mok_jax.moe(x, ids, w, wgu, wd, backend=backend, capacity_factor=cf)
        return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(H, dtype=jnp.float32))), y
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("cf", [None, 0.5])
def test_xla_and_auto_backends_give_the_same_bits_on_one_device(dtype, cf):
    x, ids, w, wgu, wd = make_problem(3, T, K, E, H, F, dtype)
    ids = ids.at[2, 1].set(-1)
    (_, y_auto), g_auto = _loss("auto", cf)(x, w, wgu, wd, ids)
    (_, y_xla), g_xla = _loss("xla", cf)(x, w, wgu, wd, ids)
    assert_bitwise(y_xla, y_auto, "y")
    for name, a, b in zip(("dx", "d_expert_weights", "d_w_gate_up", "d_w_down"), g_xla, g_auto):
        assert_bitwise(a, b, name)


def test_backend_selects_the_path():
    x, ids, w, wgu, wd = make_problem(4, T, K, E, H, F)
    text = {b: str(jax.make_jaxpr(lambda *a, b=b: mok_jax.moe(*a, backend=b))(x, ids, w, wgu, wd))
            for b in ("auto", "xla")}
    assert "mok_moe_fwd" in text["auto"] and "mok_expert_ffn_fwd" not in text["auto"]
    assert "mok_expert_ffn_fwd" in text["xla"] and "mok_combine" in text["xla"]
    assert "mok_moe_fwd" not in text["xla"]


def test_fused_backend_on_cpu_says_use_xla():
    with pytest.raises(ValueError, match="backend='fused' needs a CUDA GPU.*'xla'"):
        mok_jax.moe(*make_problem(5, T, K, E, H, F), backend="fused")


def test_partitioned_and_shard_map_paths_under_backend_xla_match_auto():
    x, ids, w, wgu, wd = make_problem(6, T, K, E, H, F)
    mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices("cpu")[:2])
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))  # noqa: E731
    args = [put(a) for a in (x, w, wgu, wd, ids)]
    with jax.set_mesh(mesh):
        (_, y_auto), g_auto = _loss("auto")(*args)
        (_, y_xla), g_xla = _loss("xla")(*args)
    assert_bitwise(y_xla, y_auto, "y")
    for a, b in zip(g_xla, g_auto):
        assert_bitwise(a, b)
