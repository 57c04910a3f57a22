"""JAX primitives of the MoE layer: abstract evaluation, lowering, batching.

Two primitives, both lowered to XLA FFI custom calls (targets in `_ext`):

* ``moe_fwd_p``: ``(x, expert_ids, expert_weights, w_gate_up, w_down) ->
  (y, gate_up, x_rows, tokens_per_expert, dropped, invalid)``. ``gate_up`` is the
  gate/up projection of every kept pair by routing-plan row (expert, then
  token, then k), ``[T*K, 2F]`` in x.dtype, and ``x_rows`` the x row of every
  kept pair in the same order, ``[T*K, H]``; both are saved for the backward
  (``[0, 2F]`` and ``[0, H]`` when ``save_gate_up=False``). Rows past the kept
  ones are undefined (zeros on CPU).
* ``moe_bwd_p``: ``(x, expert_ids, expert_weights, w_gate_up, w_down, gate_up,
  x_rows, dy) -> (dx, d_expert_weights, d_w_gate_up, d_w_down)``; it reads the
  forward's x_rows instead of gathering x again (x still gives dx its shape).

Parameters of both: ``capacity`` (rows kept per expert, ``NO_CAPACITY`` for
all); the forward also takes ``save_gate_up``. Shapes and dtypes are checked
by `mok_jax.moe`; the handlers check them again and never run on a mismatch.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import PartitionSpec
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
        # Under jax.disable_jit the jitted function would run eagerly and bind the
        # primitive again, i.e. come back here: compile it regardless.
        with jax.disable_jit(False):
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


def varying_axes(aval) -> frozenset:
    """The shard_map axes a value varies over (empty outside shard_map)."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(aval, "vma", ()))


def vary_alike(operands):
    """Inside shard_map, makes every operand vary over the same axes (pcast), so
    that the custom VJP's cotangents have their primals' types under check_vma;
    the transpose of the cast sums the weight gradients over replicated axes."""
    varying = [varying_axes(jax.typeof(a)) for a in operands]
    union = frozenset().union(*varying)
    return tuple(a if v == union else jax.lax.pcast(a, tuple(sorted(union - v)), to="varying")
                 for a, v in zip(operands, varying))


class _Out(NamedTuple):
    """One result of an abstract evaluation: shape, dtype and its partition spec
    over the operands' mesh (entries as in `jax.sharding.PartitionSpec`)."""

    shape: tuple[int, ...]
    dtype: Any
    spec: tuple


def _spec(aval) -> tuple:
    sharding = getattr(aval, "sharding", None)
    spec = tuple(getattr(sharding, "spec", ()) or ())
    return spec + (None,) * (len(aval.shape) - len(spec))


def _rows_of(aval, shape, dtype) -> _Out:
    """A result whose dim 0 is split like `aval`'s dim 0 (tokens, pairs, rows)."""
    lead = _spec(aval)[0] if shape and shape[0] else None
    return _Out(tuple(shape), dtype, (lead,) + (None,) * (len(shape) - 1))


def _like(aval) -> _Out:
    """A result with `aval`'s shape, dtype and sharding (a gradient of it)."""
    return _Out(tuple(aval.shape), aval.dtype, _spec(aval))


def _replicated(shape, dtype) -> _Out:
    return _Out(tuple(shape), dtype, (None,) * len(shape))


def _on_a_mesh(aval) -> bool:
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    return mesh is not None and not mesh.empty


def _typed(abstract_eval):
    """Turns `_Out`s into avals that carry the shardings JAX's types track:

    * explicit mesh axes (``jax.make_mesh``'s default): each result states how it
      is split, as the partitioned computation really leaves it (tokens stay split
      like x, gradients like their primals, statistics replicated). A result typed
      replicated would make JAX reshard it: an all-gather of y after the partitioned
      call and a slice of dy in front of it.
    * shard_map's varying axes (check_vma): results vary over every axis an operand
      varies over, as for an elementwise op.
    """

    def rule(*avals, **params):
        outs = abstract_eval(*avals, **params)
        union = frozenset().union(*(varying_axes(a) for a in avals))
        like = max(avals, key=lambda a: (len(varying_axes(a)), _on_a_mesh(a)))
        if union and varying_axes(like) != union:
            like = like.update(manual_axis_type=like.manual_axis_type.update(varying=union))
        sharding = getattr(like, "sharding", None)
        if sharding is None:
            return tuple(jax.core.ShapedArray(o.shape, o.dtype) for o in outs)
        return tuple(like.update(shape=o.shape, dtype=o.dtype, weak_type=False,
                                 sharding=sharding.update(spec=PartitionSpec(*o.spec)))
                     for o in outs)

    return rule


def _register(prim: Primitive, target: str, abstract_eval, attrs_of) -> None:
    prim.multiple_results = True
    prim.def_impl(_jit_impl(prim))
    prim.def_abstract_eval(_typed(abstract_eval))
    for platform in ("cpu", "cuda"):
        mlir.register_lowering(prim, _lower_on(platform, target, attrs_of), platform=platform)
    batching.primitive_batchers[prim] = _map_batching(prim)


# --- forward -----------------------------------------------------------------

moe_fwd_p = Primitive("mok_moe_fwd")


def _fwd_abstract_eval(x, expert_ids, expert_weights, w_gate_up, w_down, *, capacity,
                       save_gate_up):
    del expert_weights, w_down, capacity
    tokens = x.shape[0]
    top_k = expert_ids.shape[1]
    experts, _, two_f = w_gate_up.shape
    i32 = np.dtype(np.int32)
    rows = tokens * top_k if save_gate_up else 0
    return (
        _rows_of(x, x.shape, x.dtype),
        _rows_of(x, (rows, two_f), x.dtype),
        _rows_of(x, (rows, x.shape[1]), x.dtype),
        _replicated((experts,), i32),
        _replicated((), i32),
        _replicated((), i32),
    )


def _fwd_attrs(params):
    return {"capacity": np.int64(params["capacity"]),
            "save_gate_up": bool(params["save_gate_up"])}


_register(moe_fwd_p, _ext.MOE_FORWARD, _fwd_abstract_eval, _fwd_attrs)


# --- backward ----------------------------------------------------------------

moe_bwd_p = Primitive("mok_moe_bwd")


def _bwd_abstract_eval(x, expert_ids, expert_weights, w_gate_up, w_down, gate_up, x_rows, dy,
                       *, capacity):
    del expert_ids, gate_up, x_rows, dy, capacity
    return _like(x), _like(expert_weights), _like(w_gate_up), _like(w_down)


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
        _like(x_rows),
        _rows_of(x_rows, (rows if save_gate_up else 0, two_f), x_rows.dtype),
    )


_register(expert_ffn_fwd_p, _ext.EXPERT_FFN_FORWARD, _expert_fwd_abstract_eval,
          lambda params: {"save_gate_up": bool(params["save_gate_up"])})


expert_ffn_bwd_p = Primitive("mok_expert_ffn_bwd")


def _expert_bwd_abstract_eval(x_rows, dy_rows, w_rows, group_sizes, w_gate_up, w_down,
                              gate_up):
    del dy_rows, group_sizes, gate_up
    return _like(x_rows), _like(w_rows), _like(w_gate_up), _like(w_down)


_register(expert_ffn_bwd_p, _ext.EXPERT_FFN_BACKWARD, _expert_bwd_abstract_eval,
          lambda params: {})


combine_p = Primitive("mok_combine")


def _combine_abstract_eval(rows, weights, kept, *, weighted):
    del weights, weighted
    return (_rows_of(kept, (kept.shape[0], rows.shape[1]), rows.dtype),)


_register(combine_p, _ext.COMBINE, _combine_abstract_eval,
          lambda params: {"weighted": bool(params["weighted"])})


# --- the fused EP transport (backend="fused" under EP; mok_jax/transport.py) ----
#
# ep_dispatch_p: (values [T, H], pair_values [T, K] or [0], entries [P*T] s32,
#   dest [P*T, K] s32) -> (rows [R, H], row_values [R] or [0]); params axis_name,
#   rows (R).
# ep_combine_p: (rows [R, H], row_values [R] or [0], weights [T, K], kept [T, K] s32,
#   dest [R] s32) -> (out [T, H], pair_values [T*K] or [0]); params axis_name,
#   weighted.
# Both run on CUDA only. Their lowering makes (or finds) the NVLink communicators
# of the mesh's EP groups (`mok_jax.comm.handle_for`) and passes the handle.

EP_DISPATCH = "mok_ep_dispatch"
EP_COMBINE = "mok_ep_combine"

FUSED_NEEDS_GPU = (
    "mok_jax.moe: backend='fused' with expert parallelism moves rows over NVLink "
    "between GPUs and cannot run on {platform}; use backend='xla' (or 'auto')")


def _lowering_mesh(ctx, axis_name):
    """The concrete mesh a lowering runs under (shard_map inside jit, or a
    custom_partitioning partition), with `axis_name` among its axes."""
    from jax._src import mesh as mesh_lib

    axis_context = ctx.module_context.axis_context
    mesh = getattr(axis_context, "mesh", None)
    if isinstance(mesh, jax.sharding.Mesh) and axis_name in mesh.axis_names:
        return mesh  # shard_map's concrete mesh, or the partitioner's
    abstract = mesh if mesh is not None else getattr(axis_context, "abstract_mesh", None)
    concrete = mesh_lib.get_concrete_mesh()  # jax.set_mesh's
    if (abstract is not None and not concrete.empty and axis_name in concrete.axis_names
            and tuple(concrete.axis_names) == tuple(abstract.axis_names)
            and tuple(concrete.axis_sizes) == tuple(abstract.axis_sizes)):
        return concrete
    assignment = getattr(axis_context, "device_assignment", None)
    if abstract is not None and assignment is not None and axis_name in abstract.axis_names:
        devices = np.asarray(assignment, dtype=object).reshape(abstract.axis_sizes)
        return jax.sharding.Mesh(devices, abstract.axis_names)
    raise ValueError(
        f"mok_jax.moe: backend='fused' could not find the devices of mesh axis "
        f"{axis_name!r} while lowering; call it inside jax.shard_map with a concrete "
        "jax.sharding.Mesh (or under jax.set_mesh)")


_sites = iter(range(1, 2**62))  # EP calls lowered in this process, in order


def _fused_lowering(target, window_of, attrs_of):
    ffi_rule = jax.ffi.ffi_lowering(target)

    def rule(ctx, *operands, **params):
        from mok_jax import comm

        mesh = _lowering_mesh(ctx, params["axis_name"])
        handle, fingerprint = comm.handle_for(mesh, params["axis_name"],
                                              window_of(comm, ctx.avals_in))
        # site: which EP call this is (every process lowers the same calls in the same
        # order); the barriers compare it, so ranks never pair two different calls.
        return ffi_rule(ctx, *operands, handle=np.int64(handle),
                        fingerprint=np.int64(fingerprint), site=np.int64(next(_sites)),
                        **attrs_of(params))

    return rule


def _cpu_refusal(ctx, *operands, **params):
    raise ValueError(FUSED_NEEDS_GPU.format(platform="CPU"))


def _window_of_tokens(comm, avals):
    values, _, _, dest = avals[:4]
    return comm.window_bytes(values.shape[0], dest.shape[1], values.shape[1],
                             np.dtype(values.dtype).itemsize)


def _window_of_rows(comm, avals):
    rows, _, _, kept, _ = avals[:5]
    return comm.window_bytes(kept.shape[0], kept.shape[1], rows.shape[1],
                             np.dtype(rows.dtype).itemsize)


def _register_fused(prim, target, abstract_eval, window_of, attrs_of):
    prim.multiple_results = True
    prim.def_impl(_jit_impl(prim))
    prim.def_abstract_eval(_typed(abstract_eval))
    mlir.register_lowering(prim, _fused_lowering(target, window_of, attrs_of),
                           platform="cuda")
    mlir.register_lowering(prim, _cpu_refusal, platform="cpu")


ep_dispatch_p = Primitive("mok_ep_dispatch")


def _ep_dispatch_abstract_eval(values, pair_values, entries, dest, *, axis_name, rows):
    del entries, dest, axis_name
    n = rows if pair_values.shape[0] else 0
    return (_rows_of(values, (rows, values.shape[1]), values.dtype),
            _rows_of(values, (n,), pair_values.dtype))


_register_fused(ep_dispatch_p, EP_DISPATCH, _ep_dispatch_abstract_eval, _window_of_tokens,
                lambda params: {})


ep_combine_p = Primitive("mok_ep_combine")


def _ep_combine_abstract_eval(rows, row_values, weights, kept, dest, *, axis_name, weighted):
    del weights, dest, axis_name, weighted
    tokens, top_k = kept.shape
    n = tokens * top_k if row_values.shape[0] else 0
    return (_rows_of(kept, (tokens, rows.shape[1]), rows.dtype),
            _rows_of(kept, (n,), row_values.dtype))


_register_fused(ep_combine_p, EP_COMBINE, _ep_combine_abstract_eval, _window_of_rows,
                lambda params: {"weighted": bool(params["weighted"])})
