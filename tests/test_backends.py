"""`backend` really chooses the path (mok_jax.moe._choose_path), and every path gives
the same bits."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

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


@pytest.mark.parametrize("backend", ["auto", "xla"])
def test_shard_map_axis_of_size_one_matches_one_device(backend):
    """An EP axis of size 1: "auto" runs the one-call path, "xla" the EP pieces."""
    x, ids, w, wgu, wd = make_problem(6, T, K, E, H, F)
    # The default device, as for the one-device call it is compared with (CPU and GPU
    # results are not bitwise equal).
    mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,))

    def loss(x, w, wgu, wd, ids):
        y = jax.shard_map(lambda *a: mok_jax.moe(*a, axis_name="ep", backend=backend),
                          mesh=mesh, in_specs=(P("ep"),) * 5, out_specs=P("ep"))(
            x, ids, w, wgu, wd)
        return jnp.sum(y * jnp.cos(jnp.arange(H, dtype=jnp.float32))), y

    text = str(jax.make_jaxpr(loss)(x, w, wgu, wd, ids))
    assert ("mok_expert_ffn_fwd" in text) == (backend == "xla")
    (_, y), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        x, w, wgu, wd, ids)
    (_, y1), g1 = _loss("auto")(x, w, wgu, wd, ids)
    assert_bitwise(y, y1, "y")
    for a, b in zip(g, g1):
        assert_bitwise(a, b)


@pytest.mark.parametrize("set_mesh", [True, False])
@pytest.mark.parametrize("tokens", [T, 1])
@pytest.mark.parametrize("backend", ["auto", "xla"])
def test_plain_jit_on_a_one_device_explicit_mesh_matches_one_device(backend, tokens, set_mesh):
    """jax.make_mesh((1,), ...) has an Explicit axis: operands typed as split over it
    (under jax.set_mesh or not) take the one-device paths, and both backends give
    the one-device bits, y and every cotangent of its operand's type (the "xla"
    path's XLA planning reshapes a tokens dimension, which such types refuse)."""
    x, ids, w, wgu, wd = (a[:tokens] if i < 3 else a
                          for i, a in enumerate(make_problem(8, T, K, E, H, F)))
    mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Explicit,))
    placed = jax.device_put((x, w, wgu, wd, ids), jax.sharding.NamedSharding(mesh, P("ep")))
    with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
        (_, y), g = _loss(backend)(*placed)
    assert jax.typeof(y).sharding.spec == P("ep", None)
    for a, b in zip(g, placed):
        assert jax.typeof(a).sharding.spec == jax.typeof(b).sharding.spec
    (_, y1), g1 = _loss("auto")(x, w, wgu, wd, ids)
    assert_bitwise(y, y1, "y")
    for name, a, b in zip(("dx", "d_expert_weights", "d_w_gate_up", "d_w_down"), g, g1):
        assert_bitwise(a, b, name)


@pytest.mark.parametrize("backend", ["auto", "xla"])
def test_no_tokens(backend):
    x, ids, w, wgu, wd = make_problem(7, 0, K, E, H, F)
    (_, y), g = _loss(backend)(x, w, wgu, wd, ids)
    assert y.shape == (0, H) and g[0].shape == (0, H)
    assert not np.any(np.asarray(g[2])) and not np.any(np.asarray(g[3]))


def test_fused_ep_refuses_rows_that_are_not_16_byte_vectors_and_auto_stays_on_xla():
    """The NVLink transport moves rows as 16-byte vectors: backend="fused" says so for
    H * itemsize % 16 != 0, and "auto" keeps XLA's exchange there (it never fails
    where "xla" works)."""
    from mok_jax._src import ep
    with pytest.raises(ValueError, match="16-byte vectors; a row here is 20 bytes"):
        ep.transport_for("fused", "gpu", 20)
    assert ep.transport_for("auto", "gpu", 20) == "xla"
    assert ep.transport_for("auto", "cpu", 64) == "xla"
    assert ep.transport_for("xla", "gpu", 64) == "xla"
    with pytest.raises(ValueError, match="cannot run on CPU; use backend='xla'"):
        ep.transport_for("fused", "cpu", 64)


def test_swiglu_epilogue_shape_rule():
    """The documented rule for GEMM1 with SwiGLU in its epilogue (bf16, sm_90a)."""
    from mok_jax import _mok
    rule = _mok.swiglu_epilogue_shape
    assert rule(experts=32, hidden=1024, ffn=1024, rows=32768 * 4)       # the h200 preset
    assert not rule(experts=32, hidden=1024, ffn=1000, rows=32768 * 4)   # F % 128 != 0
    assert not rule(experts=32, hidden=1020, ffn=1024, rows=32768 * 4)   # rows not 16 bytes
    assert not rule(experts=8, hidden=4096, ffn=14336, rows=8 * 2)       # decoding: few rows
    assert not rule(experts=0, hidden=1024, ffn=1024, rows=1 << 20)
