"""Partitioning of `mok_jax.moe` under plain ``jax.jit`` on sharded arrays.

`moe` on global arrays is wrapped in ``custom_partitioning`` (forward and
backward separately) with a Shardy sharding rule. The partitioner gives us
the operands' shardings; we read the layout from them:

* the mesh axes sharding the tokens (dim 0 of x, expert_ids,
  expert_weights) — any axes, in mesh-spec order;
* the EP axis: the (single) mesh axis sharding the experts (dim 0 of
  w_gate_up and w_down). Tokens are also split along it if they were not.

Each device then runs the expert-parallel layer of `mok_jax._src.ep` on its shard:
the routing plan is global over all token axes (capacity and statistics are
those of the single-device call on the global arrays), rows move only along
the EP axis, and replicated experts (data-parallel axes) sum their weight
gradients with ``psum``. Neither tokens nor weights are ever gathered; y, dx
and d expert_weights are bitwise equal to the single-device result, and so
are the weight gradients when no data-parallel axis exists.

When the experts are not split (EP size 1, a data-parallel mesh) and no
capacity drops pairs, each device runs the single-device layer (`moe_fwd_p`,
`moe_bwd_p`: one FFI call per pass) on its tokens instead: the plan needs no
other device's ids, so nothing is gathered, and the results are the same bits
(each token's rows do not depend on the other tokens; the weight gradients are
summed over the data axes as above). With a capacity the plan is global (the
lowest token indices over all devices are kept first), so the EP layer runs.

A token count that does not split evenly over the token axes is padded by XLA
at the end of the last shard; the padding rows get invalid ids (`_without_padding`)
and are taken back out of the statistics, so nothing about them is visible.

Under differentiation the forward also returns each device's expert-grouped
inputs and saved projections (the EP layer's residuals), so the backward does
not run the forward again; it recomputes only the routing plan (the ids'
all-gather and sorts). Their global shape must be fixed before the partitioner
places the experts, so each device's buffers hold ``T_local * A * K`` rows, A
an upper bound on the EP axis size (the size of the axis splitting the experts
when the types say it, else the largest mesh axis): exact for EP over one axis,
A / P times the rows otherwise (rows past the kept ones are never touched).
The residuals are typed as split like the tokens, but each device's block holds
the rows of its experts (EP) or its own tokens' rows in expert order (the
single-device layer): blocks of the forward's split, meaningful under no other.
Where XLA pads an uneven token split it cuts the padded part of the last block,
and a jit that returns the residuals (`jax.vjp` across two jits) gathers them,
JAX arrays having no uneven shardings; the backward, in another jit, then sees
replicated tokens and cannot tell. So wherever some split of the tokens over the
mesh could be uneven (T not a multiple of the mesh's device count), the forward
saves nothing and the backward runs the forward again, in any jit
(`_saves_residuals`). Otherwise every split is even, the residuals keep their
sharding in a jit and across jits, and the backward splits its tokens as they
are split (`_backward_placement`). Saved rows that reach the backward replicated
(a jit made to return them so) or split otherwise than the tokens are not read:
the backward runs the forward again. Nothing is saved when the tokens are not
split at all (every device would hold the same rows, which the backward could not
tell from gathered blocks). Saved rows moved between the two jits from one even
split to another (``jax.device_put`` to a split over fewer devices) come split
like the tokens, and nothing static tells the backward; so each token also
carries a mark of what its block holds (`_split_tag`: the layout, not the axes'
names, and the block's index), and a device whose tokens' marks are not its own
split's makes its dy NaN, so the gradients are NaN, not wrong: with EP on every
device (a device's rows come from every device, so the mismatch is summed over
the mesh first); for the single-device layer on the devices with foreign rows,
whose NaN reaches the weight gradients through their sum (the others' dx are
right). Running the forward again there instead would cost every backward a
branch on a device value (a host synchronisation on GPUs).
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding

from mok_jax._src import ep, paths, primitives
from mok_jax._src.primitives import MOE_GRADIENTS, MOE_OPERANDS, Array, Signature, mesh_axes
from mok_jax.recipe import Recipe

# The partitioned functions, on the op's operand table (factors as in
# `mok_jax._src.primitives`; s: the statistics packed into one [E + 2] array; r: A*K
# residual rows per token, each device's [T_local * A * K] rows).
_Y = Array("y", "t h", "x")
_PACKED_STATS = Array("stats", "s", "int32")
_RESIDUALS = (Array("x_rows", "t r h", "x"), Array("gate_up", "t r g", "x"),
              Array("split_tag", "t m", "int32"))
FORWARD = Signature(MOE_OPERANDS, (_Y, _PACKED_STATS))
FORWARD_SAVING = Signature(MOE_OPERANDS, (_Y, _PACKED_STATS) + _RESIDUALS)
BACKWARD = Signature(MOE_OPERANDS + (Array("dy", "t h", "x"),) + _RESIDUALS, MOE_GRADIENTS)
_SPLIT_FACTORS = ("t", "e")  # the factors `_placement` may split: tokens and experts


def _dim0_axes(sharding) -> tuple[str, ...]:
    """The mesh axes splitting dim 0 of an operand with this sharding (a
    partitioner's operand: a NamedSharding, or none of the axes)."""
    return mesh_axes(sharding.spec, 0) if isinstance(sharding, NamedSharding) else ()


def _split_axes(mesh, axes) -> tuple[str, ...]:
    """The axes among `axes` that split a dimension: those of size above 1 (a size-1
    axis leaves every device the whole dimension)."""
    return tuple(a for a in axes if mesh.shape[a] > 1)


def _check_one_expert_axis(expert_axes) -> None:
    """The experts dim may be split over one mesh axis (the EP axis) at most, axes
    of size 1 not counted: checked at trace time for Explicit axes
    (`check_layout`), at partition time for Auto."""
    if len(expert_axes) > 1:
        raise ValueError(
            f"mok_jax.moe: the experts dim of w_gate_up is split over {expert_axes}; split it "
            "over one mesh axis, the EP axis")


def _layout(mesh, x_sharding, w_sharding, num_experts):
    """(token_axes, ep_axis) from the shardings of x and w_gate_up."""
    token_axes = _dim0_axes(x_sharding)
    expert_axes = _split_axes(mesh, _dim0_axes(w_sharding))
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


def per_device(fn):
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


def without_one_device_mesh(operands):
    """``(operands, sharding)``: operands whose types shard them over Explicit axes
    of a one-device mesh (``jax.make_mesh((1,), ...)``, which `on_a_mesh` leaves to
    the one-device paths) resharded to replicated on that mesh, which moves
    nothing, and ``x``'s sharding to reshard ``y`` back to; ``(operands, None)``
    where none is, or where an operand's mesh has several devices. The "xla"
    backend's one-device path plans in XLA with reshapes that Explicit types
    refuse (a tokens dimension split over an axis, even of size 1)."""
    typed = [jax.typeof(a).sharding for a in operands if any(explicit_spec(a))]
    if not typed or any(s.mesh.size != 1 for s in typed):
        return operands, None
    replicated = NamedSharding(typed[0].mesh, jax.sharding.PartitionSpec())
    x = operands[0]
    return (tuple(jax.sharding.reshard(a, replicated) if any(explicit_spec(a)) else a
                  for a in operands),
            jax.typeof(x).sharding if any(explicit_spec(x)) else replicated)


def explicit_spec(a) -> tuple:
    """The mesh axes of each dim that `a`'s type states (Explicit axes only; JAX
    leaves Auto axes out of types), as tuples."""
    sharding = getattr(jax.typeof(a), "sharding", None)
    spec = tuple(getattr(sharding, "spec", ()) or ())
    spec += (None,) * (np.ndim(a) - len(spec))
    return tuple(mesh_axes(spec, d) for d in range(np.ndim(a)))


def check_layout(x, expert_ids, expert_weights, w_gate_up, w_down):
    """Trace-time errors for layouts the partitioner cannot run as asked, where the
    operands' types show them (Explicit mesh axes). Auto axes are decided later by
    XLA's propagation; the partitioner then refuses experts over two axes and
    E % P != 0 and reshards (gathers) what it does not split."""
    del expert_ids, expert_weights  # token-major: any split is fine

    def split_spec(a):  # explicit_spec less the axes of size 1
        spec = explicit_spec(a)
        if not any(spec):
            return spec
        mesh = jax.typeof(a).sharding.mesh
        return tuple(_split_axes(mesh, d) for d in spec)

    wgu, wd, xs = split_spec(w_gate_up), split_spec(w_down), split_spec(x)
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


def _pack_stats(stats, padding_pairs=0):
    """The statistics as one ``[E + 2]`` array, less the padding's pairs (which
    `_without_padding` made invalid ids) in the invalid count."""
    routed, dropped, invalid = stats
    return jnp.concatenate([routed, dropped[None], invalid[None] - padding_pairs])


def _padding_pairs(mesh, cfg, num_tokens, local_tokens, top_k) -> int:
    """Pairs of the rows XLA adds when ``num_tokens`` do not split evenly over the
    token axes (it pads the token dim at its end to ``shards * local_tokens``)."""
    shards = int(np.prod([mesh.shape[a] for a in cfg.token_axes], dtype=np.int64))
    return (shards * local_tokens - num_tokens) * top_k


def _saves_residuals(mesh, cfg, num_tokens) -> bool:
    """Whether the forward saves its rows for the backward: when the tokens are split
    and every split of them over the mesh's axes is even (see top). Decided alike
    by the forward and the backward partitions, in one jit or in two."""
    return bool(cfg.token_axes) and num_tokens % _unmanaged_size(mesh) == 0


def _split_tag(mesh, cfg, local_tokens):
    """``[local_tokens, 2]`` int32: this device's mark on its tokens' saved rows, a
    number of what their blocks hold and the block's index. The single-device
    layer's block i holds the rows of the i-th of n token blocks, whatever the axes
    (n alone); an EP block also depends on the token axes' sizes in order and on
    where the EP axis is among them (its exchange group and its experts), not on
    the axes' names. Equal marks: blocks that hold the same rows (up to a 2**-31
    chance that two numbers collide)."""
    sizes = tuple(int(mesh.shape[a]) for a in cfg.token_axes)
    if cfg.axis_name is None:
        what = ("one device", int(np.prod(sizes, dtype=np.int64)))
    else:
        place = cfg.token_axes.index(cfg.axis_name) if cfg.axis_name in cfg.token_axes else -1
        what = ("ep", sizes, place, int(cfg.ep_size))
    number = jnp.int32(zlib.crc32(repr(what).encode()) & 0x7FFFFFFF)
    block = jax.lax.axis_index(cfg.token_axes).astype(jnp.int32)
    return jnp.broadcast_to(jnp.stack([number, block]), (local_tokens, 2))


def _nan_unless_own(mesh, cfg, tag, dy, *, anywhere):
    """dy, or NaN if this device's tokens carry another split's marks (`_split_tag`;
    see top), or, `anywhere`, if some device's do."""
    foreign = jnp.sum(tag != _split_tag(mesh, cfg, tag.shape[0]), dtype=jnp.int32)
    if anywhere:
        foreign = jax.lax.psum(foreign, _unmanaged_axes(mesh))
    return jnp.where(foreign == 0, dy, jnp.asarray(jnp.nan, dy.dtype))


def _without_padding(mesh, cfg, num_tokens, expert_ids):
    """``(expert_ids with the padding rows' ids -1, the padding's pairs)``: an uneven
    split of the tokens (30 over 4 devices, or 30 tokens left replicated while the
    experts split over 4) leaves rows past ``num_tokens`` in the last shard, which
    must be neither routed nor counted. Invalid ids take no capacity and contribute
    nothing; the statistics take their pairs back out (`_pack_stats`). Nothing
    changes when the split is even."""
    local = expert_ids.shape[0]
    pad = _padding_pairs(mesh, cfg, num_tokens, *expert_ids.shape)
    if pad == 0:
        return expert_ids, 0
    shard = jax.lax.axis_index(cfg.token_axes)  # linear, major to minor, as ep.plan's
    row = shard * local + jnp.arange(local, dtype=jnp.int32)
    return jnp.where((row < num_tokens)[:, None], expert_ids, jnp.int32(-1)), pad


def _placement(cap, recipe, mesh, arg_shapes):
    """From the operands' shardings (x is operand 0, w_gate_up operand 3): the EP
    config and how each factor is split (tokens over the token axes, experts over
    the EP axis, nothing else), for `Signature.shardings`."""
    token_axes, ep_axis = _layout(mesh, arg_shapes[0].sharding, arg_shapes[3].sharding,
                                  arg_shapes[3].shape[0])
    cfg = ep.Config(axis_name=ep_axis, ep_size=mesh.shape[ep_axis] if ep_axis else 1,
                     capacity=cap, token_axes=token_axes, recipe=recipe)
    return cfg, dict(zip(_SPLIT_FACTORS, (token_axes or None, ep_axis)))


def _unmanaged_axes(mesh) -> tuple[str, ...]:
    """The mesh axes that are not manual (shard_map) axes."""
    manual = set(getattr(mesh, "manual_axes", ()))
    return tuple(a for a in mesh.axis_names if a not in manual)


def _unmanaged_size(mesh) -> int:
    """Devices along the mesh axes that are not manual (shard_map) axes."""
    return int(np.prod([mesh.shape[a] for a in _unmanaged_axes(mesh)], dtype=np.int64))


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


def _transport(backend, cfg, mesh, x_shape) -> str:
    """The transport each device's EP layer uses (`ep.transport_for`'s rule, now that
    the partitioner has placed the experts)."""
    if cfg.axis_name is None or cfg.ep_size == 1:
        return "xla"  # no exchange
    row_bytes = x_shape.shape[1] * np.dtype(x_shape.dtype).itemsize
    platform = np.asarray(mesh.devices).flat[0].platform
    return ep.transport_for(backend, "gpu" if platform in ("cuda", "gpu") else platform,
                            row_bytes)


def _runs_local(cfg, cap, backend) -> bool:
    """Whether each device runs the single-device layer on its shard (see top)."""
    return cfg.ep_size == 1 and cap == primitives.NO_CAPACITY and backend != "xla"


def _local_forward(cfg, operands, *, save):
    """The single-device forward on this device's tokens; global statistics. The
    residuals (``[T_local*K or 0, C]`` each): gate_up and x_rows."""
    y, gate_up, x_rows, stats = paths.forward_one_call(operands, capacity=cfg.capacity,
                                                       recipe=cfg.recipe, save=save)
    if cfg.token_axes:
        stats = [jax.lax.psum(v, cfg.token_axes) for v in stats]
    return y, tuple(stats), (gate_up, x_rows)


def _local_backward(cfg, operands, gate_up, x_rows, dy):
    dx, d_weights, d_w_gate_up, d_w_down = paths.backward_one_call(
        operands, gate_up, x_rows, dy, capacity=cfg.capacity, recipe=cfg.recipe)
    data_axes = tuple(a for a in cfg.token_axes if a != cfg.axis_name)
    if data_axes:
        d_w_gate_up = jax.lax.psum(d_w_gate_up, data_axes)
        d_w_down = jax.lax.psum(d_w_down, data_axes)
    return dx, d_weights, d_w_gate_up, d_w_down


def _to_residual(rows, T, r):
    """``[n, C]`` rows (n <= T * r) as a ``[T, r, C]`` residual; rows past n are
    never read (uninitialised on GPUs: `jax.lax.empty`)."""
    n, cols = rows.shape
    if n < T * r:
        rows = jax.lax.dynamic_update_slice(jax.lax.empty((T * r, cols), rows.dtype), rows,
                                            (0, 0))
    return rows.reshape(T, r, cols)


def _from_residual(residual):
    """A ``[T, r, C]`` residual as its ``[T * r, C]`` rows (explicit sizes: T may be 0)."""
    T, r, cols = residual.shape
    return residual.reshape(T * r, cols)


# --- forward -------------------------------------------------------------------

def _stats_only(recipe, cap, operands):
    """What the partitioned forward computes on one device (the shapes that matter to
    the partitioner: y and the packed statistics)."""
    y, _, _, stats = paths.forward_one_call(operands, capacity=cap, recipe=recipe, save=False)
    return y, _pack_stats(stats)


def _forward_whole(x, expert_ids, expert_weights, w_gate_up, w_down, cap, backend, recipe):
    del backend
    return _stats_only(recipe, cap, (x, expert_ids, expert_weights, w_gate_up, w_down))


_forward = custom_partitioning(_forward_whole, static_argnums=(5, 6, 7))


def _forward_infer(cap, backend, recipe, mesh, arg_shapes, result_shape):
    del backend, result_shape
    _, split = _placement(cap, recipe, mesh, arg_shapes)
    return FORWARD.shardings(mesh, split)[1]


def _forward_partition(cap, backend, recipe, mesh, arg_shapes, result_shape):
    del result_shape
    cfg, split = _placement(cap, recipe, mesh, arg_shapes)
    path = ep.ExchangePath(cfg, _transport(backend, cfg, mesh, arg_shapes[0]))
    local = _runs_local(cfg, cap, backend)
    num_tokens = arg_shapes[0].shape[0]

    def lower_fn(x, expert_ids, expert_weights, w_gate_up, w_down):
        expert_ids, pad = _without_padding(mesh, cfg, num_tokens, expert_ids)
        operands = (x, expert_ids, expert_weights, w_gate_up, w_down)
        if local:
            y, stats, _ = _local_forward(cfg, operands, save=False)
        else:
            y, stats, _ = path.forward(*operands, save=False)
        return y, _pack_stats(stats, pad)

    operand_shardings, result_shardings = FORWARD.shardings(mesh, split)
    return mesh, per_device(lower_fn), result_shardings, operand_shardings


_forward.def_partition(
    partition=_forward_partition,
    infer_sharding_from_operands=_forward_infer,
    sharding_rule=FORWARD.rule(),
    need_replication_factors=FORWARD.replicated_factors(_SPLIT_FACTORS))


# --- forward saving residuals, backward using them ----------------------------

def _rows_per_token(cfg, bound, top_k):
    """A*K: A is the trace-time bound on the EP size, which must not exceed it."""
    if cfg.ep_size > bound:
        raise ValueError(f"mok_jax.moe: the experts are split over {cfg.ep_size} devices "
                         f"but the trace assumed at most {bound} (internal error)")
    return bound * top_k


def _forward_saving_whole(x, expert_ids, expert_weights, w_gate_up, w_down, cap, backend,
                          recipe, bound):
    """The forward on one device; the residuals it returns are zeros, which
    `_backward_whole` does not read."""
    del backend
    y, stats = _stats_only(recipe, cap, (x, expert_ids, expert_weights, w_gate_up, w_down))
    T, K = expert_ids.shape
    r = bound * K
    return (y, stats, jnp.zeros((T, r, x.shape[1]), x.dtype),
            jnp.zeros((T, r, w_gate_up.shape[2]), x.dtype), jnp.zeros((T, 2), jnp.int32))


_forward_saving = custom_partitioning(_forward_saving_whole, static_argnums=(5, 6, 7, 8))


def _forward_saving_infer(cap, backend, recipe, bound, mesh, arg_shapes, result_shape):
    del backend, bound, result_shape
    _, split = _placement(cap, recipe, mesh, arg_shapes)
    return FORWARD_SAVING.shardings(mesh, split)[1]


def _forward_saving_partition(cap, backend, recipe, bound, mesh, arg_shapes, result_shape):
    del result_shape
    cfg, split = _placement(cap, recipe, mesh, arg_shapes)
    r = _rows_per_token(cfg, bound, arg_shapes[1].shape[1])
    transport = _transport(backend, cfg, mesh, arg_shapes[0])
    local = _runs_local(cfg, cap, backend)
    num_tokens = arg_shapes[0].shape[0]

    def lower_fn(x, expert_ids, expert_weights, w_gate_up, w_down):
        T = x.shape[0]
        expert_ids, pad = _without_padding(mesh, cfg, num_tokens, expert_ids)
        operands = (x, expert_ids, expert_weights, w_gate_up, w_down)
        path = ep.ExchangePath(cfg, transport, rows=T * r)
        if not _saves_residuals(mesh, cfg, num_tokens):  # see top
            if local:
                y, stats, _ = _local_forward(cfg, operands, save=False)
            else:
                y, stats, _ = path.forward(*operands, save=False)
            return (y, _pack_stats(stats, pad), jax.lax.empty((T, r, x.shape[1]), x.dtype),
                    jax.lax.empty((T, r, w_gate_up.shape[2]), x.dtype),
                    jnp.zeros((T, 2), jnp.int32))
        tag = _split_tag(mesh, cfg, T)
        if local:  # the single-device layer's residuals, T*K rows of T*r
            y, stats, (gate_up, x_rows) = _local_forward(cfg, operands, save=True)
            return (y, _pack_stats(stats, pad), _to_residual(x_rows, T, r),
                    _to_residual(gate_up, T, r), tag)
        y, stats, res = path.forward(*operands, save=True)
        return (y, _pack_stats(stats, pad), _to_residual(res.x_rows, T, r),
                _to_residual(res.gate_up, T, r), tag)

    operand_shardings, result_shardings = FORWARD_SAVING.shardings(mesh, split)
    return mesh, per_device(lower_fn), result_shardings, operand_shardings


_forward_saving.def_partition(
    partition=_forward_saving_partition,
    infer_sharding_from_operands=_forward_saving_infer,
    sharding_rule=FORWARD_SAVING.rule(),
    need_replication_factors=FORWARD_SAVING.replicated_factors(_SPLIT_FACTORS))


def _backward_whole(x, expert_ids, expert_weights, w_gate_up, w_down, dy, x_rows, gate_up,
                    split_tag, cap, backend, recipe, bound):
    """The backward on one device: runs the forward again (reads no residual)."""
    del backend, bound, x_rows, gate_up, split_tag
    operands = (x, expert_ids, expert_weights, w_gate_up, w_down)
    _, gate_up, x_rows, _ = paths.forward_one_call(operands, capacity=cap, recipe=recipe,
                                                   save=True)
    return paths.backward_one_call(operands, gate_up, x_rows, dy, capacity=cap, recipe=recipe)


_backward = custom_partitioning(_backward_whole, static_argnums=(9, 10, 11, 12))


def _backward_placement(cap, recipe, mesh, arg_shapes):
    """`_placement` with the tokens split as the forward split them, which the saved
    rows' sharding records (operand 6, x_rows). Those rows are per-device blocks of
    the forward's split, meaningless under another: the backward asks for them as
    they come and for x, dy, ids and weights (token-major, any split is fine) split
    the same way, whatever split XLA proposes for the backward's own operands."""
    residual = arg_shapes[6]
    if isinstance(residual.sharding, NamedSharding):
        arg_shapes = (residual,) + tuple(arg_shapes[1:])  # only x's dim 0 is read
    return _placement(cap, recipe, mesh, arg_shapes)


def _backward_infer(cap, backend, recipe, bound, mesh, arg_shapes, result_shape):
    del backend, bound, result_shape
    _, split = _backward_placement(cap, recipe, mesh, arg_shapes)
    return BACKWARD.shardings(mesh, split)[1]


def _backward_partition(cap, backend, recipe, bound, mesh, arg_shapes, result_shape):
    del result_shape
    cfg, split = _backward_placement(cap, recipe, mesh, arg_shapes)
    r = _rows_per_token(cfg, bound, arg_shapes[1].shape[1])
    transport = _transport(backend, cfg, mesh, arg_shapes[0])
    local = _runs_local(cfg, cap, backend)
    num_tokens = arg_shapes[0].shape[0]
    # The saved rows are read where the forward saved them and they come split as
    # the tokens are (not gathered or split otherwise in between; see top).
    saved = (_saves_residuals(mesh, cfg, num_tokens)
             and _dim0_axes(arg_shapes[6].sharding) == tuple(cfg.token_axes))

    def lower_fn(x, expert_ids, expert_weights, w_gate_up, w_down, dy, x_rows, gate_up,
                 split_tag):
        T = x.shape[0]
        expert_ids, _ = _without_padding(mesh, cfg, num_tokens, expert_ids)  # as the forward's
        operands = (x, expert_ids, expert_weights, w_gate_up, w_down)
        if saved:
            dy = _nan_unless_own(mesh, cfg, split_tag, dy, anywhere=not local)
        if local:
            K = expert_ids.shape[1]
            if not saved:  # run the forward again
                _, _, (gate_up_rows, x_rows_rows) = _local_forward(cfg, operands, save=True)
            else:
                gate_up_rows = _from_residual(gate_up)[:T * K]
                x_rows_rows = _from_residual(x_rows)[:T * K]
            return _local_backward(cfg, operands, gate_up_rows, x_rows_rows, dy)
        path = ep.ExchangePath(cfg, transport, rows=T * r)
        if not saved:  # run the forward again
            _, _, res = path.forward(*operands, save=True)
            return path.backward(res, dy)
        p, route = path.routing(expert_ids, w_gate_up.shape[0])  # the plan, again (cheap)
        res = ep.Residuals(p, route, _from_residual(x_rows), _from_residual(gate_up),
                           expert_weights, w_gate_up, w_down)
        return path.backward(res, dy)

    operand_shardings, result_shardings = BACKWARD.shardings(mesh, split)
    return mesh, per_device(lower_fn), result_shardings, operand_shardings


_backward.def_partition(
    partition=_backward_partition,
    infer_sharding_from_operands=_backward_infer,
    sharding_rule=BACKWARD.rule(),
    need_replication_factors=BACKWARD.replicated_factors(_SPLIT_FACTORS))


# --- the path -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PartitionedPath:
    """`moe` on global (possibly sharded) arrays, for `mok_jax._src.paths.run`."""

    capacity: int
    recipe: Recipe
    backend: str = "auto"  # picks each device's EP transport once the experts are placed
    ep_bound: int = 1      # the most devices the experts can be split over (see top)

    def forward(self, x, expert_ids, expert_weights, w_gate_up, w_down, *, save):
        operands = (x, expert_ids, expert_weights, w_gate_up, w_down)
        if not save:
            y, packed = unless_vmapped(_forward, _forward_whole, operands,
                                       (self.capacity, self.backend, self.recipe))
            return y, (packed[:-2], packed[-2], packed[-1]), operands
        y, packed, *saved = unless_vmapped(
            _forward_saving, _forward_saving_whole, operands,
            (self.capacity, self.backend, self.recipe, self.ep_bound))
        return y, (packed[:-2], packed[-2], packed[-1]), (operands, *saved)

    def backward(self, residuals, dy):
        operands, x_rows, gate_up, split_tag = residuals
        return tuple(unless_vmapped(
            _backward, _backward_whole,
            (*operands, dy.astype(operands[0].dtype), x_rows, gate_up, split_tag),
            (self.capacity, self.backend, self.recipe, self.ep_bound)))


def unless_vmapped(partitioned, whole, args, static=()):
    """``partitioned(*args, *static)``, a custom_partitioning function, which has no
    batching rule. `moe` and `add_rms_norm` take their partitioned functions when no
    operand is being vmapped, but a call traced before vmap reaches it (vmap of
    jax.jit or of jax.checkpoint) still gets here: under vmap every example runs
    `whole` (the same function on one device) as its own call, through the
    primitives' batching. (`moe`'s `whole` backward reads no residual of the
    partitioned forward, so a vmapped backward may follow an unbatched forward.)"""

    @jax.custom_batching.custom_vmap
    def call(*args):
        return partitioned(*args, *static)

    @call.def_vmap
    def _(axis_size, in_batched, *args):
        del axis_size
        outs = jax.vmap(lambda *a: whole(*a, *static),
                        in_axes=tuple(0 if b else None for b in in_batched))(*args)
        return outs, jax.tree.map(lambda _: True, outs)

    return call(*args)


def ep_bound(operands) -> int:
    """A trace-time upper bound on the EP size: the size of the mesh axis the experts
    are split over when w_gate_up's type says it (Explicit axes; 1 if unsplit), else
    the largest axis of the operands' or the context's mesh."""
    meshes = [getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
              for a in operands] + [jax.sharding.get_abstract_mesh()]
    mesh = next((m for m in meshes if m is not None and not m.empty
                 and _unmanaged_size(m) > 1), None)
    if mesh is None:
        return 1
    expert_axes = explicit_spec(operands[3])[0]
    if expert_axes:
        return int(np.prod([mesh.shape[a] for a in expert_axes]))
    explicit = all(str(t).endswith("Explicit") for t in getattr(mesh, "axis_types", ()))
    if explicit:
        return 1  # the types say the experts are not split
    return max(mesh.shape[a] for a in _unmanaged_axes(mesh))
