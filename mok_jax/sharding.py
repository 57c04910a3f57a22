"""Partitioning of `mok_jax.moe` under plain ``jax.jit`` on sharded arrays.

`moe` on global arrays is wrapped in ``custom_partitioning`` (forward and
backward separately) with a Shardy sharding rule. The partitioner gives us
the operands' shardings; we read the layout from them:

* the mesh axes sharding the tokens (dim 0 of x, expert_ids,
  expert_weights) — any axes, in mesh-spec order;
* the EP axis: the (single) mesh axis sharding the experts (dim 0 of
  w_gate_up and w_down). Tokens are also split along it if they were not.

Each device then runs the expert-parallel layer of `mok_jax.ep` on its shard:
the routing plan is global over all token axes (capacity and statistics are
those of the single-device call on the global arrays), rows move only along
the EP axis, and replicated experts (data-parallel axes) sum their weight
gradients with ``psum``. Neither tokens nor weights are ever gathered; y, dx
and d expert_weights are bitwise equal to the single-device result, and so
are the weight gradients when no data-parallel axis exists.

The backward recomputes the expert forward (one grouped GEMM and the
exchange) instead of carrying per-device residuals across the partitioning
boundary.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from mok_jax import ep, primitives

# Factors: t tokens, k top-k, h hidden, e experts, g 2F, f F, s packed statistics.
_FWD_RULE = "t h, t k, t k, e h g, e f h -> t h, s"
_BWD_RULE = "t h, t k, t k, e h g, e f h, t h -> t h, t k, e h g, e f h"


def _axes(spec, dim) -> tuple[str, ...]:
    entry = spec[dim] if len(spec) > dim else None
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _check_one_expert_axis(expert_axes) -> None:
    """The experts dim may be split over one mesh axis (the EP axis) at most: checked
    at trace time for Explicit axes (`check_layout`), at partition time for Auto."""
    if len(expert_axes) > 1:
        raise ValueError(
            f"mok_jax.moe: the experts dim of w_gate_up is split over {expert_axes}; split it "
            "over one mesh axis, the EP axis")


def _layout(mesh, x_sharding, w_sharding, num_experts):
    """(token_axes, ep_axis) from the shardings of x and w_gate_up."""
    token_axes = _axes(x_sharding.spec, 0) if isinstance(x_sharding, NamedSharding) else ()
    expert_axes = _axes(w_sharding.spec, 0) if isinstance(w_sharding, NamedSharding) else ()
    _check_one_expert_axis(expert_axes)
    ep_axis = expert_axes[0] if expert_axes else None
    if ep_axis is not None and num_experts % mesh.shape[ep_axis]:
        # XLA would pad the experts dim; padded experts must never receive rows.
        raise ValueError(
            f"mok_jax.moe: E={num_experts} experts do not split evenly over mesh axis "
            f"{ep_axis!r} of size {mesh.shape[ep_axis]} (E % P != 0)")
    if ep_axis is not None and ep_axis not in token_axes:
        token_axes = token_axes + (ep_axis,)
    return token_axes, ep_axis


def _per_device(fn):
    """`fn`, traced as per-device code with no mesh in its types.

    custom_partitioning traces a partition's function at compile time, inside
    whatever mesh context the caller compiled in. Under ``jax.set_mesh`` with
    Explicit axes (``jax.make_mesh``'s default) every value that function makes
    would be typed as sharded over the global mesh, and JAX would lower those types
    to ``Sharding`` custom calls in the per-device module, down to the scalar
    ``add`` of a scatter's combiner. That module is spliced in after XLA's sharding
    passes, so nothing removes them; XLA's GPU scatter emitter then meets a custom
    call inside a fusion and aborts the process ("ComputeOutputToInputIndexing is
    not implemented for opcode custom-call"). An empty abstract mesh keeps the
    per-device code free of them; the collectives still bind the mesh axis names.
    """

    @functools.wraps(fn)
    def traced_without_mesh(*args):
        with jax.sharding.use_abstract_mesh(_NO_MESH):
            return fn(*args)

    return traced_without_mesh


_NO_MESH = jax.sharding.AbstractMesh((), ())


def _explicit_spec(a) -> tuple:
    """The mesh axes of each dim that `a`'s type states (Explicit axes only; JAX
    leaves Auto axes out of types), as tuples."""
    sharding = getattr(jax.typeof(a), "sharding", None)
    spec = tuple(getattr(sharding, "spec", ()) or ())
    spec += (None,) * (np.ndim(a) - len(spec))
    return tuple(_axes(spec, d) for d in range(np.ndim(a)))


def experts_split(w_gate_up) -> bool:
    """Whether the experts dim of `w_gate_up` is split over a mesh axis in its type."""
    return bool(_explicit_spec(w_gate_up)[0])


def check_layout(x, expert_ids, expert_weights, w_gate_up, w_down):
    """Trace-time errors for layouts the partitioner cannot run as asked, where the
    operands' types show them (Explicit mesh axes). Auto axes are decided later by
    XLA's propagation; the partitioner then refuses experts over two axes and
    E % P != 0 and reshards (gathers) what it does not split."""
    del expert_ids, expert_weights  # token-major: any split is fine
    wgu, wd, xs = _explicit_spec(w_gate_up), _explicit_spec(w_down), _explicit_spec(x)
    _check_one_expert_axis(wgu[0])
    if wgu[0] != wd[0]:
        raise ValueError(
            f"mok_jax.moe: w_gate_up's experts dim is split over {wgu[0] or 'no axis'} but "
            f"w_down's over {wd[0] or 'no axis'}; split both over the same EP axis")
    for name, dims in (("x's H dim", xs[1:]), ("w_gate_up's H or 2F dim", wgu[1:]),
                       ("w_down's F or H dim", wd[1:])):
        axes = tuple(a for d in dims for a in d)
        if axes:
            raise ValueError(
                f"mok_jax.moe: {name} is split over {axes}; mok_jax splits tokens and "
                "experts only (it would have to gather these). Replicate them over those "
                "axes, e.g. jax.sharding.reshard(a, P(<tokens or experts>, None, ...)).")


def _pack_stats(stats):
    routed, dropped, invalid = stats
    return jnp.concatenate([routed, dropped[None], invalid[None]])


def _placement(cap, mesh, arg_shapes):
    """From the operands' shardings (x is operand 0, w_gate_up operand 3): the EP
    config, and the shardings of token-major arrays, expert weights and replicated
    arrays."""
    token_axes, ep_axis = _layout(mesh, arg_shapes[0].sharding, arg_shapes[3].sharding,
                                  arg_shapes[3].shape[0])
    cfg = ep.Config(axis_name=ep_axis, ep_size=mesh.shape[ep_axis] if ep_axis else 1,
                     capacity=cap, token_axes=token_axes)
    tok = NamedSharding(mesh, P(token_axes or None, None))
    wts = NamedSharding(mesh, P(ep_axis, None, None))
    rep = NamedSharding(mesh, P(None))
    return cfg, tok, wts, rep


def _unmanaged_size(mesh) -> int:
    """Devices along the mesh axes that are not manual (shard_map) axes."""
    manual = set(getattr(mesh, "manual_axes", ()))
    return int(np.prod([size for name, size in zip(mesh.axis_names, mesh.axis_sizes)
                        if name not in manual], dtype=np.int64))


def on_a_mesh(operands) -> bool:
    """Whether `moe` should partition itself: some operand is sharded over a
    mesh of several devices (explicit-axis sharding in its type, or a mesh set
    with ``jax.set_mesh``), outside shard_map's manual axes, and none is being
    vmapped (custom_partitioning has no batching rule; vmap of an unsharded
    call takes the plain path)."""
    # jax exports no BatchTracer type; its name is stable and enough here.
    if any(type(a).__name__ == "BatchTracer" for a in operands):
        return False
    meshes = [jax.sharding.get_abstract_mesh()]
    for a in operands:
        meshes.append(getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None))
    return any(m is not None and not m.empty and _unmanaged_size(m) > 1 for m in meshes)


def _transport(backend, cfg, mesh) -> str:
    """The transport each device's EP layer uses (`ep.transport_for`'s rule, now that
    the partitioner has placed the experts)."""
    if cfg.axis_name is None or cfg.ep_size == 1:
        return "xla"  # no exchange
    platform = np.asarray(mesh.devices).flat[0].platform
    return ep.transport_for(backend, "gpu" if platform in ("cuda", "gpu") else platform)


# --- forward -------------------------------------------------------------------

@functools.partial(custom_partitioning, static_argnums=(5, 6))
def _forward(x, expert_ids, expert_weights, w_gate_up, w_down, cap, backend):
    del backend
    y, _, *stats = primitives.moe_fwd_p.bind(
        x, expert_ids, expert_weights, w_gate_up, w_down, capacity=cap, save_gate_up=False)
    return y, _pack_stats(stats)


def _forward_infer(cap, backend, mesh, arg_shapes, result_shape):
    del backend, result_shape
    _, tok, _, rep = _placement(cap, mesh, arg_shapes)
    return tok, rep


def _forward_partition(cap, backend, mesh, arg_shapes, result_shape):
    del result_shape
    cfg, tok, wts, rep = _placement(cap, mesh, arg_shapes)
    path = ep.ExchangePath(cfg, _transport(backend, cfg, mesh))

    def lower_fn(x, expert_ids, expert_weights, w_gate_up, w_down):
        y, stats, _ = path.forward(
            x, expert_ids, expert_weights, w_gate_up, w_down, save=False)
        return y, _pack_stats(stats)

    return mesh, _per_device(lower_fn), (tok, rep), (tok, tok, tok, wts, wts)


_forward.def_partition(
    partition=_forward_partition,
    infer_sharding_from_operands=_forward_infer,
    sharding_rule=_FWD_RULE,
    need_replication_factors=("h", "k", "g", "f", "s"))  # in order of first use


# --- backward ------------------------------------------------------------------

@functools.partial(custom_partitioning, static_argnums=(6, 7))
def _backward(x, expert_ids, expert_weights, w_gate_up, w_down, dy, cap, backend):
    del backend
    _, gate_up, *_ = primitives.moe_fwd_p.bind(
        x, expert_ids, expert_weights, w_gate_up, w_down, capacity=cap, save_gate_up=True)
    return tuple(primitives.moe_bwd_p.bind(
        x, expert_ids, expert_weights, w_gate_up, w_down, gate_up, dy, capacity=cap))


def _backward_infer(cap, backend, mesh, arg_shapes, result_shape):
    del backend, result_shape
    _, tok, wts, _ = _placement(cap, mesh, arg_shapes)
    return tok, tok, wts, wts


def _backward_partition(cap, backend, mesh, arg_shapes, result_shape):
    del result_shape
    cfg, tok, wts, _ = _placement(cap, mesh, arg_shapes)
    path = ep.ExchangePath(cfg, _transport(backend, cfg, mesh))

    def lower_fn(x, expert_ids, expert_weights, w_gate_up, w_down, dy):
        _, _, residuals = path.forward(x, expert_ids, expert_weights, w_gate_up, w_down,
                                       save=True)
        return path.backward(residuals, dy)

    return mesh, _per_device(lower_fn), (tok, tok, wts, wts), (tok, tok, tok, wts, wts, tok)


_backward.def_partition(
    partition=_backward_partition,
    infer_sharding_from_operands=_backward_infer,
    sharding_rule=_BWD_RULE,
    need_replication_factors=("h", "k", "g", "f"))  # in order of first use


# --- the path -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PartitionedPath:
    """`moe` on global (possibly sharded) arrays, for `mok_jax.layer.run`."""

    capacity: int
    backend: str = "auto"  # picks each device's EP transport once the experts are placed

    def forward(self, x, expert_ids, expert_weights, w_gate_up, w_down, *, save):
        del save  # the partitioned backward recomputes what it needs
        operands = (x, expert_ids, expert_weights, w_gate_up, w_down)
        y, packed = _forward(*operands, self.capacity, self.backend)
        return y, (packed[:-2], packed[-2], packed[-1]), operands

    def backward(self, residuals, dy):
        x = residuals[0]
        return tuple(_backward(*residuals, dy.astype(x.dtype), self.capacity, self.backend))
