"""JAX primitives of mok_jax, defined one way from tables of their arrays.

Every primitive is `define`d from a `Signature`: its operands and results, each a
name, one factor letter per dim and a dtype rule. From that one table come

* the abstract evaluation (result shapes from the factors' sizes, dtypes, and the
  shardings JAX's types track),
* the FFI call's operand and result order (the table's order is the handler's,
  ``ffi/handlers/signatures.h``),
* the Shardy sharding rule and the shardings of the ``custom_partitioning``
  functions built on the primitive (`Signature.rule`, `Signature.shardings`).

Factor letters of the MoE op: t tokens, k top-k, h hidden, e local experts, f the
expert FFN width F, g 2F, p pairs (T*K rows by pair), r and q expert-grouped rows
(q: r or 0 when nothing is saved), n experts (a replicated count), s packed
statistics. A new operand is one line of a table; a new numeric variant is a
`mok_jax.Recipe` value, carried by the ``recipe`` parameter of the expert-FFN
primitives to their handlers' ``recipe`` attribute.

The primitives (all lowered to XLA FFI custom calls; targets in `_ext`):

* ``moe_fwd_p`` / ``moe_bwd_p``: the whole layer on one device, one call per pass.
  The forward's ``gate_up`` ``[T*K, 2F]`` and ``x_rows`` ``[T*K, H]`` are the
  gate/up projection and the x row of every kept pair by routing-plan row (expert,
  then token, then k), saved for the backward (zero rows when ``save_gate_up`` is
  False; rows past the kept ones are undefined).
* ``expert_ffn_fwd_p`` / ``expert_ffn_bwd_p`` / ``combine_p``: the pieces expert
  parallelism composes with a transport (`mok_jax._src.ep`).
* ``ep_dispatch_p`` / ``ep_combine_p``: the NVLink transport (CUDA only).

Shapes and dtypes are checked by `mok_jax.moe`; the handlers check them again and
never run on a mismatch.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
from typing import Any, Callable, Collection, NamedTuple

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from mok_jax._src import ext

NO_CAPACITY = -1


# --- tables ----------------------------------------------------------------------

class Array(NamedTuple):
    """One operand or result of a primitive.

    factors: one letter per dim, space separated ("t h"); "" for a scalar.
    dtype: results: the name of the operand whose dtype it has, or a dtype name
      ("int32"); operands: what the caller's validation requires (documentation).
    like: results only: the operand whose sharding the result has, dim by factor (a
      gradient, or a result of the operand's own shape); None: only the row factors
      (`ROW_FACTORS`) are split, like the first operand that has them, and only when
      the dim is not empty.
    """

    name: str
    factors: str
    dtype: str
    like: str | None = None

    @property
    def dims(self) -> tuple[str, ...]:
        return tuple(self.factors.split())


# Factors whose dims are split like the tokens: a result of these keeps its rows
# where its operands' rows are; every other factor of a result without `like` is
# typed unsplit (the kernels write whole rows).
ROW_FACTORS = frozenset("tpqr")


@dataclasses.dataclass(frozen=True)
class Signature:
    """The operands and results of a primitive (or of a partitioned function).

    follows: factors that are split like another (expert-grouped rows follow the
    tokens: ``{"r": "t"}``).
    """

    operands: tuple[Array, ...]
    results: tuple[Array, ...]
    follows: tuple[tuple[str, str], ...] = ()

    @property
    def operand_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.operands)

    def rule(self) -> str:
        """The Shardy sharding rule, e.g. ``"t h, t k -> t h"``."""
        def side(arrays):
            return ", ".join(a.factors for a in arrays)
        return f"{side(self.operands)} -> {side(self.results)}"

    def replicated_factors(self, split: Collection[str]) -> tuple[str, ...]:
        """The rule's factors other than the `split` ones (``need_replication_factors``),
        in order of first use."""
        seen = []
        for a in self.operands + self.results:
            for f in a.dims:
                if f not in split and f not in seen:
                    seen.append(f)
        return tuple(seen)

    def shardings(self, mesh, split: dict[str, Any]):
        """``(operand shardings, result shardings)`` on `mesh`, each dim split over
        ``split[factor]`` (mesh axes, or None) or not at all."""
        def spec(a):
            return NamedSharding(mesh, PartitionSpec(*(split.get(f) for f in a.dims)))
        return tuple(spec(a) for a in self.operands), tuple(spec(a) for a in self.results)

    def sizes(self, avals) -> dict[str, Any]:
        """Each factor's size, read off the operands (which must agree on it)."""
        sizes, seen_in = {}, {}
        for array, aval in zip(self.operands, avals):
            if len(array.dims) != len(aval.shape):
                raise ValueError(f"{array.name}: expected rank {len(array.dims)} "
                                 f"({array.factors!r}), got shape {tuple(aval.shape)}")
            for f, n in zip(array.dims, aval.shape):
                if f in sizes and sizes[f] != n:
                    raise ValueError(
                        f"{array.name} has {n} along {f!r} but {seen_in[f]} has {sizes[f]} "
                        f"({self.rule()})")
                sizes.setdefault(f, n)
                seen_in.setdefault(f, array.name)
        return sizes

    def abstract_eval(self, avals, sizes: dict[str, int]) -> tuple["Result", ...]:
        """The results' shapes, dtypes and partition specs."""
        by_name = dict(zip(self.operand_names, avals))
        follows = dict(self.follows)
        outs = []
        for r in self.results:
            shape = tuple(sizes[f] for f in r.dims)
            dtype = (by_name[r.dtype].dtype if r.dtype in by_name else np.dtype(r.dtype))
            if r.like is not None:
                spec = tuple(self._split_of(follows.get(f, f), r.like, by_name) for f in r.dims)
            else:
                spec = tuple(self._split_of(follows.get(f, f), None, by_name)
                             if f in ROW_FACTORS and n != 0 else None
                             for f, n in zip(r.dims, shape))
            outs.append(Result(shape, dtype, spec))
        return tuple(outs)

    def _split_of(self, factor, like, by_name):
        """The partition-spec entry of `factor` in the `like` operand (or the first
        operand that has it); None when no operand has it."""
        candidates = ([a for a in self.operands if a.name == like] if like
                      else list(self.operands))
        for a in candidates:
            if factor in a.dims:
                return _spec(by_name[a.name])[a.dims.index(factor)]
        return None


class Result(NamedTuple):
    """One result of an abstract evaluation: shape, dtype and its partition spec
    over the operands' mesh (entries as in `jax.sharding.PartitionSpec`)."""

    shape: tuple[int, ...]
    dtype: Any
    spec: tuple


def _spec(aval) -> tuple:
    sharding = getattr(aval, "sharding", None)
    spec = tuple(getattr(sharding, "spec", ()) or ())
    return spec + (None,) * (len(aval.shape) - len(spec))


# --- shard_map axes ------------------------------------------------------------------

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


def first_order_only(fn, message: str, nondiff_argnums=()):
    """`fn` (a custom VJP's forward or backward) as a custom JVP that raises
    NotImplementedError(message) when differentiated: a second derivative of the
    op then names the op, on every path, instead of whichever primitive JAX meets
    first (an FFI call's, ``custom_partitioning``)."""
    wrapped = jax.custom_jvp(fn, nondiff_argnums=nondiff_argnums)

    def refuse(*args):
        raise NotImplementedError(message)

    wrapped.defjvp(refuse)
    return wrapped


def _on_a_mesh(aval) -> bool:
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    return mesh is not None and not mesh.empty


def _typed(outs, avals):
    """Turns `Result`s into avals that carry the shardings JAX's types track:

    * explicit mesh axes (``jax.make_mesh``'s default): each result states how it
      is split, as the partitioned computation really leaves it (tokens stay split
      like x, gradients like their primals, statistics replicated). A result typed
      replicated would make JAX reshard it: an all-gather of y after the partitioned
      call and a slice of dy in front of it.
    * shard_map's varying axes (check_vma): results vary over every axis an operand
      varies over, as for an elementwise op.
    """
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


# --- one way to define a primitive ----------------------------------------------------

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


def mesh_axes(spec, dim) -> tuple[str, ...]:
    """The mesh axes of dim `dim` in a partition spec, as a tuple."""
    entry = spec[dim] if len(spec) > dim else None
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _leading_mesh_axes(arrays) -> tuple[tuple[str, ...], Any]:
    """The mesh axes that shard the leading dim of the first of `arrays` whose type
    says so (explicit-axis sharding), and that mesh; ((), None) if none does."""
    for a in arrays:
        sharding = getattr(jax.typeof(a), "sharding", None)
        axes = mesh_axes(getattr(sharding, "spec", None) or (), 0)
        if axes:
            return axes, sharding.mesh
    return (), None


def _map_batching(prim: Primitive):
    """Batching by a sequential map over the batch: each element is its own call
    (for the MoE ops: with its own capacity and statistics, exactly as without vmap).
    A batch sharded over mesh axes is mapped on each device over its own elements
    (`lax.map` scans, and a scan cannot run over a sharded axis)."""

    def rule(args, dims, **params):
        # An unbatched operand has dim None.
        batched = [i for i, d in enumerate(dims) if d is not None]
        moved = tuple(jax.numpy.moveaxis(args[i], dims[i], 0) for i in batched)

        def mapped(moved, args):
            def one(slices):
                full = list(args)
                for i, s in zip(batched, slices):
                    full[i] = s
                return tuple(prim.bind(*full, **params))

            return jax.lax.map(one, moved)

        axes, mesh = _leading_mesh_axes(moved)
        if not axes:
            outs = mapped(moved, args)
        else:
            entry = axes[0] if len(axes) == 1 else axes
            unbatched = [a if d is None else None for a, d in zip(args, dims)]
            outs = jax.shard_map(
                mapped, mesh=mesh, axis_names=set(axes),
                in_specs=(tuple(PartitionSpec(entry) for _ in moved),
                          [None if a is None else PartitionSpec() for a in unbatched]),
                out_specs=PartitionSpec(entry))(moved, unbatched)
        return list(outs), [0] * len(outs)

    return rule


def ffi_lowering(platform: str, target: str, attrs: Callable[[dict], dict]):
    """The lowering to FFI target `target` on `platform`, with the handler's
    attributes ``attrs(params)``, or a clear error where the build has no handler."""
    rule = jax.ffi.ffi_lowering(target)

    def lower(ctx, *operands, **params):
        ext.require_target(platform, target)
        return rule(ctx, *operands, **attrs(params))

    return lower


def define(name: str, signature: Signature | None, *, lowerings: dict[str, Callable],
           sizes: Callable[[dict, dict], dict] | None = None,
           abstract_eval: Callable | None = None, per_call: bool = False) -> Primitive:
    """A primitive with multiple results: eager evaluation by jit, the abstract
    evaluation of `signature` (``sizes(factor_sizes, params)`` adds the results'
    own factors; `abstract_eval`, with no signature, where operand ranks vary),
    one lowering per platform, and batching by a sequential map. `per_call`: every
    call is lowered on its own (JAX otherwise lowers equal calls of a module once
    and copies the result), for lowerings that tell calls apart (`call_site`)."""
    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_impl(_jit_impl(prim))

    def evaluate(*avals, **params):
        if abstract_eval is not None:
            outs = abstract_eval(*avals, **params)
        else:
            factor_sizes = signature.sizes(avals)
            if sizes is not None:
                factor_sizes.update(sizes(factor_sizes, params))
            outs = signature.abstract_eval(avals, factor_sizes)
        return _typed(outs, avals)

    prim.def_abstract_eval(evaluate)
    for platform, rule in lowerings.items():
        mlir.register_lowering(prim, rule, platform=platform, cacheable=not per_call)
    batching.primitive_batchers[prim] = _map_batching(prim)
    return prim


def _on_both(target: str, attrs) -> dict[str, Callable]:
    return {p: ffi_lowering(p, target, attrs) for p in ("cpu", "cuda")}


# --- the MoE op ------------------------------------------------------------------------

# The layer's operands, in the order of `mok_jax.moe`'s arguments and the handlers'.
MOE_OPERANDS = (
    Array("x", "t h", "x"),
    Array("expert_ids", "t k", "int32"),
    Array("expert_weights", "t k", "expert_weights"),
    Array("w_gate_up", "e h g", "x"),
    Array("w_down", "e f h", "x"),
)
# The gradients of the differentiable operands, in the order of `layer.run`'s backward.
MOE_GRADIENTS = (
    Array("dx", "t h", "x", like="x"),
    Array("d_expert_weights", "t k", "expert_weights", like="expert_weights"),
    Array("d_w_gate_up", "e h g", "w_gate_up", like="w_gate_up"),
    Array("d_w_down", "e f h", "w_down", like="w_down"),
)
_STATS = (
    Array("tokens_per_expert", "n", "int32"),
    Array("dropped", "", "int32"),
    Array("invalid", "", "int32"),
)

MOE_FORWARD = Signature(
    MOE_OPERANDS,
    (Array("y", "t h", "x"),
     Array("gate_up", "r g", "x"),
     Array("x_rows", "r h", "x")) + _STATS,
    follows=(("r", "t"),))
MOE_BACKWARD = Signature(
    MOE_OPERANDS + (Array("gate_up", "p g", "x"), Array("x_rows", "p h", "x"),
                    Array("dy", "t h", "x")),
    MOE_GRADIENTS)


def _recipe_attrs(params) -> dict:
    return {"recipe": np.int32(params["recipe"])}


def _forward_sizes(sizes, params):
    return {"r": sizes["t"] * sizes["k"] if params["save_gate_up"] else 0, "n": sizes["e"]}


moe_fwd_p = define(
    ext.MOE_FORWARD, MOE_FORWARD, sizes=_forward_sizes,
    lowerings=_on_both(ext.MOE_FORWARD, lambda params: {
        **_recipe_attrs(params), "capacity": np.int64(params["capacity"]),
        "save_gate_up": bool(params["save_gate_up"])}))

moe_bwd_p = define(
    ext.MOE_BACKWARD, MOE_BACKWARD,
    lowerings=_on_both(ext.MOE_BACKWARD, lambda params: {
        **_recipe_attrs(params), "capacity": np.int64(params["capacity"])}))


# --- pieces for expert parallelism (mok_jax/_src/ep.py) --------------------------------

EXPERT_WEIGHTS = MOE_OPERANDS[3:]

EXPERT_FFN_FORWARD = Signature(
    (Array("x_rows", "r h", "x_rows"), Array("group_sizes", "e", "int32")) + EXPERT_WEIGHTS,
    (Array("out_rows", "r h", "x_rows", like="x_rows"),
     Array("gate_up", "q g", "x_rows")),
    follows=(("q", "r"),))
EXPERT_FFN_BACKWARD = Signature(
    (Array("x_rows", "r h", "x_rows"), Array("dy_rows", "r h", "x_rows"),
     Array("w_rows", "r", "w_rows"), Array("group_sizes", "e", "int32")) + EXPERT_WEIGHTS
    + (Array("gate_up", "r g", "x_rows"),),
    (Array("dx_rows", "r h", "x_rows", like="x_rows"),
     Array("dw_rows", "r", "w_rows", like="w_rows")) + MOE_GRADIENTS[2:])
COMBINE = Signature(
    (Array("rows", "p h", "rows"), Array("weights", "t k", "weights"),
     Array("kept", "t k", "int32")),
    (Array("out", "t h", "rows"),))

expert_ffn_fwd_p = define(
    ext.EXPERT_FFN_FORWARD, EXPERT_FFN_FORWARD,
    sizes=lambda sizes, params: {"q": sizes["r"] if params["save_gate_up"] else 0},
    lowerings=_on_both(ext.EXPERT_FFN_FORWARD, lambda params: {
        **_recipe_attrs(params), "save_gate_up": bool(params["save_gate_up"])}))

expert_ffn_bwd_p = define(
    ext.EXPERT_FFN_BACKWARD, EXPERT_FFN_BACKWARD,
    lowerings=_on_both(ext.EXPERT_FFN_BACKWARD, _recipe_attrs))

combine_p = define(
    ext.COMBINE, COMBINE,
    lowerings=_on_both(ext.COMBINE, lambda params: {"weighted": bool(params["weighted"])}))


# --- the fused EP transport (backend="fused" under EP; mok_jax/_src/transport.py) -------
#
# ep_dispatch_p: (values [T, H], pair_values [T, K] or [0], entries [P*T] s32,
#   dest [P*T, K] s32) -> (rows [R, H], row_values [R] or [0]); params axis_name,
#   rows (R).
# ep_combine_p: (rows [R, H], row_values [R] or [0], weights [T, K], kept [T, K] s32,
#   dest [R] s32) -> (out [T, H], pair_values [T*K] or [0]); params axis_name,
#   weighted.
# Both run on CUDA only (the pair values' rank varies, so their abstract
# evaluations are written out). Their lowering makes (or finds) the NVLink
# communicators of the mesh's EP groups (`mok_jax.comm.handle_for`) and passes the
# handle and the call's site.

EP_DISPATCH = "mok_ep_dispatch"
EP_COMBINE = "mok_ep_combine"

FUSED_NEEDS_GPU = (
    "mok_jax.moe: backend='fused' with expert parallelism moves rows over NVLink "
    "between GPUs and cannot run on {platform}; use backend='xla' (or 'auto')")


def lowering_mesh(ctx, axis_name):
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


def call_site(ctx, target: str) -> int:
    """A 63-bit id of this EP call, which every process derives the same way
    however often and in whatever order it compiles: the module being lowered, the
    call's name stack, and its place among the EP calls of that module (a module is
    lowered in program order). The transport's barriers compare it, so ranks never
    pair two different calls."""
    module = ctx.module_context
    # Per-module state: the module context's own cache dict (a slotted class) holds
    # the counters, so they start at 0 for every module, whatever was lowered before.
    counters = module.cached_primitive_lowerings.setdefault(("mok_jax", "call_sites"), {})
    index = next(counters.setdefault(target, itertools.count()))
    name = module.module.operation.attributes["sym_name"] if (
        "sym_name" in module.module.operation.attributes) else ""
    text = "\n".join((str(name), str(ctx.name_stack), target, str(index)))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & (2**63 - 1)


def _fused_lowering(target, window_of, attrs):
    ffi_rule = jax.ffi.ffi_lowering(target)

    def rule(ctx, *operands, **params):
        from mok_jax import comm

        site = call_site(ctx, target)
        mesh = lowering_mesh(ctx, params["axis_name"])
        handle, fingerprint = comm.handle_for(mesh, params["axis_name"],
                                              window_of(comm, ctx.avals_in))
        return ffi_rule(ctx, *operands, handle=np.int64(handle),
                        fingerprint=np.int64(fingerprint), site=np.int64(site),
                        **attrs(params))

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


def _ep_dispatch_abstract_eval(values, pair_values, entries, dest, *, axis_name, rows):
    del entries, dest, axis_name
    n = rows if pair_values.shape[0] else 0
    lead = _spec(values)[0]
    return (Result((rows, values.shape[1]), values.dtype, (lead, None)),
            Result((n,), pair_values.dtype, (lead if n else None,)))


def _ep_combine_abstract_eval(rows, row_values, weights, kept, dest, *, axis_name, weighted):
    del weights, dest, axis_name, weighted
    tokens, top_k = kept.shape
    n = tokens * top_k if row_values.shape[0] else 0
    lead = _spec(kept)[0]
    return (Result((tokens, rows.shape[1]), rows.dtype, (lead, None)),
            Result((n,), row_values.dtype, (lead if n else None,)))


ep_dispatch_p = define(
    EP_DISPATCH, None, abstract_eval=_ep_dispatch_abstract_eval, per_call=True,
    lowerings={"cuda": _fused_lowering(EP_DISPATCH, _window_of_tokens, lambda params: {}),
               "cpu": _cpu_refusal})

ep_combine_p = define(
    EP_COMBINE, None, abstract_eval=_ep_combine_abstract_eval, per_call=True,
    lowerings={"cuda": _fused_lowering(EP_COMBINE, _window_of_rows,
                                       lambda params: {"weighted": bool(params["weighted"])}),
               "cpu": _cpu_refusal})
