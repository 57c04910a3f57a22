"""The FFI handlers check the result buffers XLA hands them, not only the
operands: a call made straight through jax.ffi.ffi_call with results of the wrong
shape or dtype is an error naming the buffer, never a write past its end."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mok_jax._src import ext

T, K, E, H, F = 4, 2, 3, 8, 6


def _moe_operands(dtype=jnp.float32):
    x = jnp.ones((T, H), dtype)
    ids = jnp.asarray(np.arange(T * K).reshape(T, K) % E, jnp.int32)
    w = jnp.full((T, K), 0.5, jnp.float32)
    wgu = jnp.full((E, H, 2 * F), 0.01, dtype)
    wd = jnp.full((E, F, H), 0.01, dtype)
    return x, ids, w, wgu, wd


def _moe_forward(dropped_shape, invalid_shape):
    outs = (jax.ShapeDtypeStruct((T, H), jnp.float32),
            jax.ShapeDtypeStruct((0, 2 * F), jnp.float32),
            jax.ShapeDtypeStruct((0, H), jnp.float32),
            jax.ShapeDtypeStruct((E,), jnp.int32),
            jax.ShapeDtypeStruct(dropped_shape, jnp.int32),
            jax.ShapeDtypeStruct(invalid_shape, jnp.int32))
    call = jax.ffi.ffi_call(ext.MOE_FORWARD, outs)
    return jax.jit(lambda *a: call(*a, recipe=np.int32(ext.recipes()["native"]),
                                capacity=np.int64(-1), save_gate_up=False))


def test_forward_with_scalar_stats_runs():
    y, *_, tpe, dropped, invalid = _moe_forward((), ())(*_moe_operands())
    assert y.shape == (T, H)
    assert int(np.sum(tpe)) == T * K and int(dropped) == 0 and int(invalid) == 0


@pytest.mark.parametrize("name,dropped,invalid", [
    ("dropped", (0,), ()),
    ("invalid", (), (0,)),
    ("dropped", (2,), ()),
])
def test_forward_refuses_stats_that_are_not_scalars(name, dropped, invalid):
    with pytest.raises(Exception, match=rf"mok_moe_fwd( \(CUDA\))?: {name} has shape"):
        jax.block_until_ready(_moe_forward(dropped, invalid)(*_moe_operands()))


def _expert_ffn_forward(gate_up_dtype, rows_dtype=jnp.float32):
    R = T * K
    outs = (jax.ShapeDtypeStruct((R, H), rows_dtype),
            jax.ShapeDtypeStruct((R, 2 * F), gate_up_dtype))
    call = jax.ffi.ffi_call(ext.EXPERT_FFN_FORWARD, outs)
    x_rows = jnp.ones((R, H), rows_dtype)
    sizes = jnp.asarray([3, 3, 2], jnp.int32)
    wgu = jnp.full((E, H, 2 * F), 0.01, rows_dtype)
    wd = jnp.full((E, F, H), 0.01, rows_dtype)
    fn = jax.jit(lambda *a: call(*a, recipe=np.int32(ext.recipes()["native"]), save_gate_up=True))
    return fn(x_rows, sizes, wgu, wd)


def test_expert_ffn_forward_saves_gate_up_in_the_rows_dtype():
    out_rows, gate_up = _expert_ffn_forward(jnp.float32)
    assert out_rows.shape == (T * K, H) and gate_up.shape == (T * K, 2 * F)


@pytest.mark.parametrize("rows_dtype,gate_up_dtype", [
    (jnp.float32, jnp.bfloat16),  # f32 stores into a buffer half their size
    (jnp.bfloat16, jnp.float32),
])
def test_expert_ffn_forward_refuses_gate_up_of_another_dtype(rows_dtype, gate_up_dtype):
    with pytest.raises(Exception, match=r"mok_expert_ffn_fwd( \(CUDA\))?: gate_up must be"):
        jax.block_until_ready(_expert_ffn_forward(gate_up_dtype, rows_dtype))
