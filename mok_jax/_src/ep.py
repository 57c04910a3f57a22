"""Expert parallelism: the single-device layer cut at its seams.

Inside ``jax.shard_map`` over an EP axis of size P, rank r holds tokens
``[r*T, (r+1)*T)`` of the global batch and experts ``[r*E_local,
(r+1)*E_local)``. Per call:

1. every rank all-gathers the expert ids and computes the same global plan
   (each expert's rows in global token order, capacity applied globally);
2. a transport (`mok_jax._src.transport`) dispatches the x rows of the kept pairs to
   the experts' ranks, straight into each rank's expert-grouped order;
3. the receiving rank runs the expert FFN (the ``mok_expert_ffn_fwd`` FFI kernel);
4. the transport brings the output rows back and the source rank combines over k
   in ascending order (the ``mok_combine`` FFI kernel).

Steps 3 and 4 are the very code the single-device kernel runs, each row's
arithmetic does not depend on its neighbours, and each expert's rows arrive in
the global order, so results and gradients are bitwise equal to EP=1, whatever
the transport.

`moe_on_virtual_ranks` runs the EP role of the persistent kernels: P ranks served
by one launch per pass on one GPU, each with its own token, output and receive
windows reached through pointer tables, as peers' windows would be.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mok_jax import comm
from mok_jax._src import ext, paths, primitives
from mok_jax.recipe import Recipe
from mok_jax._src.transport import TRANSPORTS, Transport, check_indexed_rows, exclusive_cumsum

_I32 = jnp.int32

def transport_for(backend: str, platform: str, row_bytes: int) -> str:
    """The transport of an EP layer (experts split over a mesh axis of size > 1);
    `row_bytes`: one token row (H * x.dtype's size)."""
    if backend == "fused":
        if platform != "gpu":
            raise ValueError(primitives.FUSED_NEEDS_GPU.format(platform=platform.upper()))
        if row_bytes % comm.ROW_ALIGN:
            raise ValueError(
                f"mok_jax.moe: backend='fused' moves token rows as 16-byte vectors; a row "
                f"here is {row_bytes} bytes (H times x's item size). Use H a multiple of "
                f"{comm.ROW_ALIGN // 2} (bf16) or {comm.ROW_ALIGN // 4} (f32), or "
                "backend='xla'.")
        mismatch = comm.nccl_mismatch()  # comm.Missing when this build has no transport
        if mismatch:
            raise ValueError(f"mok_jax.moe: backend='fused': {mismatch}")
        return "nvlink"
    if backend == "auto" and comm.auto_selects_fused(platform, row_bytes):
        return "nvlink"
    return "xla"


class Config(NamedTuple):
    """Static description of one EP call.

    axis_name: the mesh axis the experts are split over (None: experts replicated,
      no exchange). ep_size: its size (1 when None). capacity: rows kept per expert
      (`primitives.NO_CAPACITY` for all). token_axes: every mesh axis the tokens are
      split over, major to minor; the plan (capacity, statistics) is global over all
      of them. Ranks that differ only in `axis_name` form one exchange group. Under
      shard_map this is (axis_name,).
    recipe: how the expert GEMMs compute.
    """

    axis_name: str | None
    ep_size: int
    capacity: int
    token_axes: tuple[str, ...]
    recipe: Recipe


class Plan(NamedTuple):
    """The global routing plan as one rank sees it (every rank computes the same)."""

    kept: jax.Array         # [T, K] int32, 1 where my pair (t, k) has a row
    my_ids: jax.Array       # [T*K] my pairs' expert ids
    counts: jax.Array       # [P, E] kept pairs per (rank of my exchange group, expert)
    me: jax.Array           # my index in the exchange group
    group_sizes: jax.Array  # [E_local] rows per local expert
    stats: tuple            # (tokens_per_expert [E], dropped, invalid), global
    group_ids: jax.Array    # [P, T*K] expert id of each kept pair of my exchange group's
                            # ranks (in group order), -1 where not kept


def plan(expert_ids, cfg: Config, experts_local: int) -> Plan:
    """The global routing plan: stable sort of all ranks' pairs by expert."""
    P = cfg.ep_size
    T, K = expert_ids.shape
    E = experts_local * P
    C = T * K

    if cfg.token_axes:
        ids_all = jax.lax.all_gather(expert_ids, cfg.token_axes)  # [G, T, K]
        g_me = jax.lax.axis_index(cfg.token_axes)               # my linear token shard
    else:
        ids_all, g_me = expert_ids[None], 0
    G = ids_all.shape[0]
    check_indexed_rows("G * T * K (pairs of all token shards)", G * C)
    flat = ids_all.reshape(-1)                                  # global (shard, t, k) order
    n = flat.shape[0]
    valid = (flat >= 0) & (flat < E)
    key = jnp.where(valid, flat, E)
    order = jnp.argsort(key, stable=True)                       # by expert, then global order
    # seg_start[e]: pairs of experts below e (invalid pairs count as expert E), as a
    # prefix sum of a histogram (jnp.searchsorted of the sorted keys gives the same,
    # but fails to trace inside a shard_map manual over some mesh axes only).
    hist = jnp.zeros(E + 1, _I32).at[key].add(1)
    seg_start = exclusive_cumsum(hist)
    pos_sorted = jnp.arange(n, dtype=_I32) - seg_start[key[order]]
    pos = jnp.zeros(n, _I32).at[order].set(pos_sorted)          # rank within its expert
    kept = valid if cfg.capacity < 0 else valid & (pos < cfg.capacity)
    routed = hist[:E]                                           # [E] valid pairs

    src = jnp.arange(n, dtype=_I32) // C
    cell = jnp.where(kept, src * E + flat, G * E)
    counts = jnp.zeros(G * E + 1, _I32).at[cell].add(1)[:-1].reshape(G, E)  # kept [shard, e]

    # My exchange group: the token shards that differ from mine in the EP axis only.
    kept_ids = jnp.where(kept, flat, -1).astype(_I32).reshape(G, C)
    if cfg.axis_name is None:
        me, counts = jnp.zeros((), _I32), counts[g_me][None]
        group_ids = kept_ids[g_me][None]
    else:
        sizes = [jax.lax.axis_size(a) for a in cfg.token_axes]
        i = cfg.token_axes.index(cfg.axis_name)
        stride = int(np.prod(sizes[i + 1:], dtype=np.int64))
        me = jax.lax.axis_index(cfg.axis_name)
        group = g_me + (jnp.arange(P) - me) * stride
        counts = counts[group]                                  # [P, E]
        group_ids = kept_ids[group]                             # [P, C]

    mine = jax.lax.dynamic_slice_in_dim(counts, me * experts_local, experts_local, axis=1)
    stats = (routed, jnp.sum(valid & ~kept).astype(_I32), jnp.sum(~valid).astype(_I32))
    if cfg.token_axes:
        # Every rank computed the same global numbers; pmax (tiny) says so in the
        # type, so that they can leave shard_map replicated under check_vma.
        stats = tuple(jax.lax.pmax(v, cfg.token_axes) for v in stats)
    my_kept = kept.reshape(G, C)[g_me]
    return Plan(my_kept.reshape(T, K).astype(_I32), expert_ids.reshape(-1), counts, me,
                mine.sum(axis=0, dtype=_I32), stats, group_ids)


class Residuals(NamedTuple):
    """What the backward needs from the forward."""

    plan: Plan
    route: object            # the transport's routing state
    x_rows: jax.Array        # [R, H] expert-grouped inputs
    gate_up: jax.Array       # [R, 2F] saved projections
    expert_weights: jax.Array
    w_gate_up: jax.Array
    w_down: jax.Array


@dataclasses.dataclass(frozen=True)
class ExchangePath:
    """The EP layer over one transport: `mok_jax._src.paths`'s path for shard_map EP
    (and, per device, for plain jit on a mesh).

    rows: the expert-grouped buffers' row count (None: ``P * T * K``, every pair of
    the exchange group). `mok_jax._src.sharding` asks for more when the buffers must have
    a shape fixed before the partitioner chose P; rows past the kept ones are never
    read.
    """

    cfg: Config
    transport_name: str = "xla"
    rows: int | None = None

    @property
    def transport(self) -> Transport:
        return TRANSPORTS[self.transport_name]

    def routing(self, expert_ids, experts_local):
        """The global plan and the transport's routing state for it."""
        p = plan(expert_ids, self.cfg, experts_local)
        T, K = expert_ids.shape
        rows = self.cfg.ep_size * T * K if self.rows is None else self.rows
        if rows < self.cfg.ep_size * T * K:
            raise ValueError(f"ExchangePath: {rows} rows cannot hold the "
                             f"{self.cfg.ep_size * T * K} pairs of the exchange group")
        return p, self.transport.route(p, self.cfg, K, experts_local, rows)

    def forward(self, x, expert_ids, expert_weights, w_gate_up, w_down, *, save):
        cfg, tr = self.cfg, self.transport
        p, route = self.routing(expert_ids, w_gate_up.shape[0])
        x_rows, _ = tr.dispatch_tokens(x, route, cfg)                      # [R, H]
        out_rows, gate_up = primitives.expert_ffn_fwd_p.bind(
            x_rows, p.group_sizes, w_gate_up, w_down, recipe=int(cfg.recipe),
            save_gate_up=save)
        y, _ = tr.combine(out_rows, route, cfg, expert_weights, p.kept, weighted=True)
        return y, p.stats, Residuals(p, route, x_rows, gate_up, expert_weights, w_gate_up,
                                     w_down)

    def backward(self, res: Residuals, dy):
        """Gradients w.r.t. (x, expert_weights, w_gate_up, w_down)."""
        cfg, tr = self.cfg, self.transport
        T, K = res.expert_weights.shape
        dy_rows, w_rows = tr.dispatch_tokens(dy.astype(res.x_rows.dtype), res.route, cfg,
                                             pair_values=res.expert_weights)
        dx_rows, dw_rows, d_w_gate_up, d_w_down = primitives.expert_ffn_bwd_p.bind(
            res.x_rows, dy_rows, w_rows, res.plan.group_sizes, res.w_gate_up, res.w_down,
            res.gate_up, recipe=int(cfg.recipe))
        # Replicas of an expert in other exchange groups saw other tokens: sum them.
        data_axes = tuple(a for a in cfg.token_axes if a != cfg.axis_name)
        if data_axes:
            d_w_gate_up = jax.lax.psum(d_w_gate_up, data_axes)
            d_w_down = jax.lax.psum(d_w_down, data_axes)
        dx, dw_pairs = tr.combine(dx_rows, res.route, cfg, res.expert_weights, res.plan.kept,
                                  weighted=False, row_values=dw_rows)
        dw_pairs = dw_pairs.reshape(T, K)
        d_weights = jnp.where(res.plan.kept != 0, dw_pairs, jnp.zeros_like(dw_pairs))
        return dx, d_weights, d_w_gate_up, d_w_down


MAX_VIRTUAL_RANKS = 8


@dataclasses.dataclass(frozen=True)
class VirtualRanksPath:
    """The layer as `ranks` EP ranks in one persistent launch per pass on one GPU
    (``mok_moe_fwd_ranks``, ``mok_moe_bwd_ranks``): a path of ``paths.run``."""

    ranks: int
    capacity: int

    def forward(self, x, expert_ids, expert_weights, w_gate_up, w_down, *, save):
        T, H = x.shape
        K = expert_ids.shape[1]
        E, _, F2 = w_gate_up.shape
        rows = T * K if save else 0
        outs = (jax.ShapeDtypeStruct((T, H), x.dtype),
                jax.ShapeDtypeStruct((rows, F2), x.dtype),
                jax.ShapeDtypeStruct((rows, H), x.dtype),
                jax.ShapeDtypeStruct((E,), _I32), jax.ShapeDtypeStruct((), _I32),
                jax.ShapeDtypeStruct((), _I32))
        operands = (x, expert_ids, expert_weights, w_gate_up, w_down)
        y, gate_up, x_rows, *stats = jax.ffi.ffi_call(ext.MOE_FORWARD_RANKS, outs)(
            *operands, ranks=np.int64(self.ranks), capacity=np.int64(self.capacity),
            save_gate_up=save)
        return y, tuple(stats), (operands, gate_up, x_rows)

    def backward(self, residuals, dy):
        operands, gate_up, x_rows = residuals
        x, _, expert_weights, w_gate_up, w_down = operands
        outs = (jax.ShapeDtypeStruct(x.shape, x.dtype),
                jax.ShapeDtypeStruct(expert_weights.shape, expert_weights.dtype),
                jax.ShapeDtypeStruct(w_gate_up.shape, w_gate_up.dtype),
                jax.ShapeDtypeStruct(w_down.shape, w_down.dtype))
        return tuple(jax.ffi.ffi_call(ext.MOE_BACKWARD_RANKS, outs)(
            *operands, gate_up, x_rows, dy.astype(x.dtype), ranks=np.int64(self.ranks),
            capacity=np.int64(self.capacity)))


def moe_on_virtual_ranks(x, expert_ids, expert_weights, w_gate_up, w_down, *,
                         ranks: int, capacity: int | None = None) -> jax.Array:
    """`mok_jax.moe`'s y, computed as `ranks` EP ranks in one persistent launch per
    pass on one GPU; differentiable (w.r.t. x, expert_weights, w_gate_up, w_down)
    like `mok_jax.moe`.

    Rank r holds tokens ``[r*T/P, (r+1)*T/P)`` (its slices of x, y, the weights,
    dy, dx and d expert_weights are its windows) and experts ``[r*E/P,
    (r+1)*E/P)``. Forward: its CTAs compute its experts' rows, reading each
    token's x row from the window of the token's rank and writing each output row
    into the receive window of the token's rank, and combine its own tokens.
    Backward: its CTAs read each dy row from the window of the token's rank, write
    each dx row into the receive window of the token's rank, compute its experts'
    weight gradients, and combine its own tokens' dx rows. Results and gradients
    are bit for bit ``mok_jax.moe``'s at EP=1, for every P. ``ranks=1`` is the
    one-device layer (each pass the persistent kernel where the mode picks it,
    else the kernel chain). Needs the CUDA build on a compute capability 9.0 GPU,
    bf16 x and weights, H and F multiples of 8. `capacity`: rows kept per expert
    (None: all).
    """
    if isinstance(ranks, bool) or not isinstance(ranks, (int, np.integer)):
        raise TypeError(f"ranks must be an int, got {ranks!r}")
    T, H = x.shape
    E = w_gate_up.shape[0]
    if not 1 <= ranks <= MAX_VIRTUAL_RANKS or T % ranks or E % ranks:
        raise ValueError(f"ranks must be in [1, {MAX_VIRTUAL_RANKS}] and divide T={T} and "
                         f"E={E}; got {ranks}")
    if capacity is not None and capacity < 0:
        raise ValueError(f"capacity must be >= 0 or None, got {capacity}")
    for name, a in (("x", x), ("w_gate_up", w_gate_up), ("w_down", w_down)):
        if a.dtype != jnp.bfloat16:
            raise TypeError(f"moe_on_virtual_ranks takes bfloat16 {name}, got {a.dtype}")
    ext.require_target("cuda", ext.MOE_FORWARD_RANKS)
    ext.require_target("cuda", ext.MOE_BACKWARD_RANKS)
    if jax.default_backend() != "gpu":
        raise RuntimeError("moe_on_virtual_ranks runs on a CUDA GPU only (JAX's default "
                           f"backend here: {jax.default_backend()})")
    path = VirtualRanksPath(
        ranks=int(ranks), capacity=primitives.NO_CAPACITY if capacity is None else int(capacity))
    y, _ = paths.run(path, x, expert_ids.astype(_I32), expert_weights, w_gate_up, w_down)
    return y
