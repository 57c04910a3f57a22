"""Static bad input raises ValueError at trace time, naming the offending argument."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax
from mok_jax.reference import moe_reference

T, K, E, H, F = 6, 2, 4, 8, 3


def _args(**over):
    """A valid f32 call's arguments as ShapeDtypeStructs, with some replaced."""
    spec = dict(
        x=((T, H), jnp.float32),
        expert_ids=((T, K), jnp.int32),
        expert_weights=((T, K), jnp.float32),
        w_gate_up=((E, H, 2 * F), jnp.float32),
        w_down=((E, F, H), jnp.float32),
    )
    spec.update(over)
    return [jax.ShapeDtypeStruct(*spec[n]) for n in
            ("x", "expert_ids", "expert_weights", "w_gate_up", "w_down")]


def _concrete(structs):
    return [jnp.zeros(s.shape, s.dtype) for s in structs]


BAD_ARRAYS = [  # (overrides, regex the message must match)
    # rank
    (dict(x=((T * H,), jnp.float32)), r"\bx\b"),
    (dict(x=((1, T, H), jnp.float32)), r"\bx\b"),
    (dict(expert_ids=((T * K,), jnp.int32)), "expert_ids"),
    (dict(expert_weights=((T * K,), jnp.float32)), "expert_weights"),
    (dict(w_gate_up=((H, 2 * F), jnp.float32)), "w_gate_up"),
    (dict(w_down=((F, H), jnp.float32)), "w_down"),
    # shape mismatches
    (dict(expert_ids=((T + 1, K), jnp.int32), expert_weights=((T + 1, K), jnp.float32)),
     "expert_ids"),
    (dict(expert_weights=((T + 1, K), jnp.float32)), "expert_weights"),
    (dict(expert_weights=((T, K + 1), jnp.float32)), "expert_weights"),
    (dict(w_gate_up=((E, H + 1, 2 * F), jnp.float32)), "w_gate_up"),
    (dict(w_gate_up=((E, H, 2 * F + 1), jnp.float32)), "w_gate_up"),
    (dict(w_down=((E, F + 1, H), jnp.float32)), "w_down"),
    (dict(w_down=((E, F, H + 1), jnp.float32)), "w_down"),
    (dict(w_down=((E - 1, F, H), jnp.float32)), "w_down"),
    # dtypes
    (dict(x=((T, H), jnp.float16), w_gate_up=((E, H, 2 * F), jnp.float16),
          w_down=((E, F, H), jnp.float16)), r"\bx\b"),
    (dict(x=((T, H), jnp.int32), w_gate_up=((E, H, 2 * F), jnp.int32),
          w_down=((E, F, H), jnp.int32)), r"\bx\b"),
    (dict(expert_ids=((T, K), jnp.int16)), "expert_ids"),
    (dict(expert_ids=((T, K), jnp.uint32)), "expert_ids"),
    (dict(expert_ids=((T, K), jnp.float32)), "expert_ids"),
    (dict(w_gate_up=((E, H, 2 * F), jnp.bfloat16)), "w_gate_up"),
    (dict(w_down=((E, F, H), jnp.bfloat16)), "w_down"),
    (dict(expert_weights=((T, K), jnp.float16)), "expert_weights"),
    (dict(expert_weights=((T, K), jnp.bfloat16)), "expert_weights"),  # neither f32 nor x's
    (dict(expert_weights=((T, K), jnp.int32)), "expert_weights"),
    # K > E
    (dict(expert_ids=((T, E + 1), jnp.int32), expert_weights=((T, E + 1), jnp.float32)),
     r"expert_ids|top_k|\bK\b"),
]


@pytest.mark.parametrize("over,match", BAD_ARRAYS)
def test_bad_arrays_raise_at_trace_time(over, match):
    structs = _args(**over)
    # Abstract evaluation is enough: the error comes from tracing, not from running.
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(mok_jax.moe, *structs)
    with pytest.raises(ValueError, match=match):
        jax.jit(mok_jax.moe).trace(*structs)
    with pytest.raises(ValueError, match=match):
        mok_jax.moe(*_concrete(structs))


@pytest.mark.parametrize("over,match", BAD_ARRAYS)
def test_the_reference_refuses_what_moe_refuses(over, match):
    """moe_reference takes the contract's arrays only: a call mok_jax.moe refuses is
    a ValueError naming the argument, not a result (weights [T, K + 1] would
    combine the first K columns) nor an error from inside JAX."""
    args = _concrete(_args(**over))
    with pytest.raises(ValueError, match=rf"^moe_reference: (.*\b)?({match})"):
        moe_reference(*args)


@pytest.mark.parametrize("which", [0, 2, 4])
def test_the_reference_refuses_a_python_list_by_name(which):
    args = _concrete(_args())
    name = ("x", "expert_ids", "expert_weights", "w_gate_up", "w_down")[which]
    args[which] = np.asarray(args[which]).tolist()
    with pytest.raises(ValueError, match=rf"moe_reference: {name} must be an array"):
        moe_reference(*args)


def test_bf16_x_with_bf16_weights_is_accepted():
    structs = _args(x=((T, H), jnp.bfloat16), expert_weights=((T, K), jnp.bfloat16),
                    w_gate_up=((E, H, 2 * F), jnp.bfloat16), w_down=((E, F, H), jnp.bfloat16))
    out = jax.eval_shape(mok_jax.moe, *structs)
    assert out.shape == (T, H) and out.dtype == jnp.bfloat16


def test_valid_call_is_accepted():
    out = jax.eval_shape(lambda *a: mok_jax.moe(*a, return_stats=True), *_args())
    y, stats = out
    assert y.shape == (T, H) and y.dtype == jnp.float32
    assert stats.tokens_per_expert.shape == (E,) and stats.tokens_per_expert.dtype == jnp.int32
    assert stats.dropped.shape == () and stats.invalid.shape == ()


@pytest.mark.parametrize("c", [0.0, -1.0, -1e-9, 0])
def test_nonpositive_capacity_factor(c):
    with pytest.raises(ValueError, match="capacity_factor"):
        jax.eval_shape(lambda *a: mok_jax.moe(*a, capacity_factor=c), *_args())
    with pytest.raises(ValueError, match="capacity_factor"):
        mok_jax.moe(*_concrete(_args()), capacity_factor=c)


@pytest.mark.parametrize("backend", ["cuda", "XLA", "", "triton", None])
def test_unknown_backend(backend):
    with pytest.raises(ValueError, match="backend"):
        jax.eval_shape(lambda *a: mok_jax.moe(*a, backend=backend), *_args())


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU backend's message")
def test_fused_backend_on_cpu_says_use_xla():
    with pytest.raises(ValueError, match="backend='fused' needs a CUDA GPU.*'xla'"):
        jax.eval_shape(lambda *a: mok_jax.moe(*a, backend="fused"), *_args())
    with pytest.raises(ValueError, match="backend='fused' needs a CUDA GPU.*'xla'"):
        mok_jax.moe(*_concrete(_args()), backend="fused")


def test_unbound_axis_name():
    with pytest.raises(ValueError, match="axis_name"):
        jax.eval_shape(lambda *a: mok_jax.moe(*a, axis_name="ep"), *_args())
    with pytest.raises(ValueError, match="axis_name"):
        jax.jit(lambda *a: mok_jax.moe(*a, axis_name="ep")).trace(*_args())
    with pytest.raises(ValueError, match="axis_name"):
        mok_jax.moe(*_concrete(_args()), axis_name="ep")


def test_axis_name_of_another_axis_is_unbound():
    # Inside shard_map over axis "data", asking for "ep" is still unbound.
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    P = jax.sharding.PartitionSpec

    def body(*a):
        return mok_jax.moe(*a, axis_name="ep")

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(),) * 5, out_specs=P())
    with pytest.raises(ValueError, match="axis_name='ep' is not a bound mesh axis"):
        jax.eval_shape(f, *_args())


def test_axis_name_of_a_vmap_axis_is_refused():
    # A vmap axis is bound (jax.lax.axis_size knows it) but is no mesh axis: moe must
    # not take the batch elements for EP ranks (each element would treat its experts as
    # a slice of a larger model and see the other elements' tokens).
    def body(*a):
        return mok_jax.moe(*a, axis_name="batch")

    structs = [jax.ShapeDtypeStruct((2,) + s.shape, s.dtype) for s in _args()]
    with pytest.raises(ValueError, match="axis_name='batch' is not a bound mesh axis"):
        jax.eval_shape(jax.vmap(body, axis_name="batch"), *structs)


def test_error_names_shapes():
    # The contract asks the message to carry the shapes, so the user sees what was passed.
    with pytest.raises(ValueError) as info:
        jax.eval_shape(mok_jax.moe, *_args(w_down=((E, F + 1, H), jnp.float32)))
    msg = str(info.value)
    assert str(F + 1) in msg and "w_down" in msg, msg
    np.testing.assert_(str((E, F + 1, H)) in msg or f"{E}, {F + 1}, {H}" in msg, msg)


def test_zero_hidden_size_is_rejected():
    x = jnp.ones((4, 0), jnp.float32)
    ids = jnp.zeros((4, 1), jnp.int32)
    w = jnp.ones((4, 1), jnp.float32)
    with pytest.raises(ValueError, match="hidden dimension H >= 1"):
        mok_jax.moe(x, ids, w, jnp.ones((2, 0, 6)), jnp.ones((2, 3, 0)))


@pytest.mark.parametrize("which", [0, 1, 3])
def test_a_python_list_is_refused_by_name(which):
    """Arrays only (jax or numpy): a nested list gets mok_jax's ValueError naming the
    argument, not an AttributeError from inside."""
    args = _concrete(_args())
    name = ("x", "expert_ids", "expert_weights", "w_gate_up", "w_down")[which]
    args[which] = np.asarray(args[which]).tolist()
    with pytest.raises(ValueError, match=rf"mok_jax.moe: {name} must be an array"):
        mok_jax.moe(*args)
    args[which] = np.asarray(args[which], np.float32 if which != 1 else np.int32)
    assert mok_jax.moe(*args).shape == (T, H)  # numpy arrays are fine


@pytest.mark.parametrize("backend", ["auto", "xla"])
def test_pairs_past_int32_raise_at_trace_time(backend):
    """T * K >= 2^31 pairs: the plan, the statistics and the kernels' row maps are
    int32, so the call is a ValueError naming the limit when it is traced, on every
    backend (abstract arrays: nothing of that size is allocated)."""
    structs = _args(x=((2**28, H), jnp.bfloat16), expert_ids=((2**28, 8), jnp.int32),
                    expert_weights=((2**28, 8), jnp.float32),
                    w_gate_up=((E + 4, H, 2 * F), jnp.bfloat16),
                    w_down=((E + 4, F, H), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"mok_jax.moe: T \* K = 2147483648 .*2\^31 - 1"):
        jax.eval_shape(lambda *a: mok_jax.moe(*a, backend=backend), *structs)
    # Below the limit (2^31 - 8 pairs), tracing goes through.
    ok = _args(x=((2**28 - 1, H), jnp.bfloat16), expert_ids=((2**28 - 1, 8), jnp.int32),
               expert_weights=((2**28 - 1, 8), jnp.float32),
               w_gate_up=((E + 4, H, 2 * F), jnp.bfloat16), w_down=((E + 4, F, H), jnp.bfloat16))
    assert jax.eval_shape(lambda *a: mok_jax.moe(*a, backend="auto"), *ok).shape == (2**28 - 1, H)
