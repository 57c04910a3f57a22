"""JAX primitives of the MoE layer: abstract evaluation, lowering, batching.

Two primitives, both lowered to XLA FFI custom calls (targets in `_ext`):

* ``moe_fwd_p``: ``(x, expert_ids, expert_weights, w_gate_up, w_down) ->
  (y, gate_up, tokens_per_expert, dropped, invalid)``. ``gate_up`` is the
  gate/up projection of every kept pair by routing-plan row (expert, then
  token, then k), ``[T*K, 2F]`` in x.dtype, saved for the backward (``[0, 2F]`` when ``save_gate_up=False``).
* ``moe_bwd_p``: ``(x, expert_ids, expert_weights, w_gate_up, w_down, gate_up,
  dy) -> (dx, d_expert_weights, d_w_gate_up, d_w_down)``.

Parameters of both: ``capacity`` (rows kept per expert, ``NO_CAPACITY`` for
all); the forward also takes ``save_gate_up``. Shapes and dtypes are checked
by `mok_jax.moe`; the handlers check them again and never run on a mismatch.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from mok_jax import _ext

NO_CAPACITY = -1


def _jit_impl(prim: Primitive):
    """Eager evaluation: compile the primitive alone, cached per parameters."""

    @functools.cache
    def compiled(**params):
        return jax.jit(lambda *args: prim.bind(*args, **params))

    def impl(*args, **params):
        return compiled(**params)(*args)

    return impl


def _lower_on(platform: str, target: str, attrs_of):
    """Lowering rule for `platform`, or a clear error if no handler exists there."""
    ffi_rule = jax.ffi.ffi_lowering(target)

    def rule(ctx, *operands, **params):
        _ext.require_target(platform, target)
        return ffi_rule(ctx, *operands, **attrs_of(params))

    return rule


def _map_batching(prim: Primitive):
    """Batching by a sequential map over the batch: each element is its own MoE
    call, with its own capacity and statistics, exactly as without vmap."""

    def rule(args, dims, **params):
        # An unbatched operand has dim None.
        batched = [i for i, d in enumerate(dims) if d is not None]
        moved = tuple(jax.numpy.moveaxis(args[i], dims[i], 0) for i in batched)

        def one(slices):
            full = list(args)
            for i, s in zip(batched, slices):
                full[i] = s
            return tuple(prim.bind(*full, **params))

        outs = jax.lax.map(one, moved)
        return list(outs), [0] * len(outs)

    return rule


def _varying_axes(aval) -> frozenset:
    """The shard_map axes a value varies over (empty outside shard_map)."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(aval, "vma", ()))


def _with_varying_axes(abstract_eval):
    """Results vary over every shard_map axis an operand varies over, as
    shard_map's type check (check_vma) expects of an elementwise-like op."""

    def rule(*avals, **params):
        outs = abstract_eval(*avals, **params)
        union = frozenset().union(*(_varying_axes(a) for a in avals))
        if not union:
            return outs
        like = max(avals, key=lambda a: len(_varying_axes(a)))
        if _varying_axes(like) != union:
            like = like.update(manual_axis_type=like.manual_axis_type.update(varying=union))
        replicated = lambda rank: like.sharding.update(spec=jax.sharding.PartitionSpec(  # noqa: E731
            *([None] * rank)))
        return tuple(like.update(shape=o.shape, dtype=o.dtype, weak_type=False,
                                 sharding=replicated(len(o.shape))) for o in outs)

    return rule


def _register(prim: Primitive, target: str, abstract_eval, attrs_of) -> None:
    prim.multiple_results = True
    prim.def_impl(_jit_impl(prim))
    prim.def_abstract_eval(_with_varying_axes(abstract_eval))
    for platform in ("cpu", "cuda"):
        mlir.register_lowering(prim, _lower_on(platform, target, attrs_of), platform=platform)
    batching.primitive_batchers[prim] = _map_batching(prim)


# --- forward -----------------------------------------------------------------

moe_fwd_p = Primitive("mok_moe_fwd")


def _fwd_abstract_eval(x, expert_ids, expert_weights, w_gate_up, w_down, *, capacity,
                       save_gate_up):
    del expert_weights, w_down, capacity
    tokens, hidden = x.shape
    top_k = expert_ids.shape[1]
    experts, _, two_f = w_gate_up.shape
    i32 = np.dtype(np.int32)
    return (
        jax.core.ShapedArray((tokens, hidden), x.dtype),
        jax.core.ShapedArray((tokens * top_k if save_gate_up else 0, two_f), x.dtype),
        jax.core.ShapedArray((experts,), i32),
        jax.core.ShapedArray((), i32),
        jax.core.ShapedArray((), i32),
    )


def _fwd_attrs(params):
    return {"capacity": np.int64(params["capacity"]),
            "save_gate_up": bool(params["save_gate_up"])}


_register(moe_fwd_p, _ext.MOE_FORWARD, _fwd_abstract_eval, _fwd_attrs)


# --- backward ----------------------------------------------------------------

moe_bwd_p = Primitive("mok_moe_bwd")


def _bwd_abstract_eval(x, expert_ids, expert_weights, w_gate_up, w_down, gate_up, dy, *,
                       capacity):
    del expert_ids, gate_up, dy, capacity
    return (
        jax.core.ShapedArray(x.shape, x.dtype),
        jax.core.ShapedArray(expert_weights.shape, expert_weights.dtype),
        jax.core.ShapedArray(w_gate_up.shape, w_gate_up.dtype),
        jax.core.ShapedArray(w_down.shape, w_down.dtype),
    )


def _bwd_attrs(params):
    return {"capacity": np.int64(params["capacity"])}


_register(moe_bwd_p, _ext.MOE_BACKWARD, _bwd_abstract_eval, _bwd_attrs)


# --- pieces for expert parallelism (mok_jax/ep.py) -----------------------------
#
# expert_ffn_fwd_p: (x_rows [R, H], group_sizes [E_local] s32, w_gate_up, w_down)
#   -> (out_rows [R, H], gate_up [R or 0, 2F]); param save_gate_up.
# expert_ffn_bwd_p: (x_rows, dy_rows [R, H], w_rows [R], group_sizes, w_gate_up,
#   w_down, gate_up) -> (dx_rows, dw_rows, d_w_gate_up, d_w_down).
# combine_p: (rows [T*K, H], weights [T, K], kept [T, K] s32) -> out [T, H];
#   param weighted (False: every weight is 1 and `weights` is not read).

expert_ffn_fwd_p = Primitive("mok_expert_ffn_fwd")


def _expert_fwd_abstract_eval(x_rows, group_sizes, w_gate_up, w_down, *, save_gate_up):
    del group_sizes, w_down
    rows = x_rows.shape[0]
    two_f = w_gate_up.shape[2]
    return (
        jax.core.ShapedArray(x_rows.shape, x_rows.dtype),
        jax.core.ShapedArray((rows if save_gate_up else 0, two_f), x_rows.dtype),
    )


_register(expert_ffn_fwd_p, _ext.EXPERT_FFN_FORWARD, _expert_fwd_abstract_eval,
          lambda params: {"save_gate_up": bool(params["save_gate_up"])})


expert_ffn_bwd_p = Primitive("mok_expert_ffn_bwd")


def _expert_bwd_abstract_eval(x_rows, dy_rows, w_rows, group_sizes, w_gate_up, w_down,
                              gate_up):
    del dy_rows, group_sizes, gate_up
    return (
        jax.core.ShapedArray(x_rows.shape, x_rows.dtype),
        jax.core.ShapedArray(w_rows.shape, w_rows.dtype),
        jax.core.ShapedArray(w_gate_up.shape, w_gate_up.dtype),
        jax.core.ShapedArray(w_down.shape, w_down.dtype),
    )


_register(expert_ffn_bwd_p, _ext.EXPERT_FFN_BACKWARD, _expert_bwd_abstract_eval,
          lambda params: {})


combine_p = Primitive("mok_combine")


def _combine_abstract_eval(rows, weights, kept, *, weighted):
    del weights, weighted
    return (jax.core.ShapedArray((kept.shape[0], rows.shape[1]), rows.dtype),)


_register(combine_p, _ext.COMBINE, _combine_abstract_eval,
          lambda params: {"weighted": bool(params["weighted"])})
