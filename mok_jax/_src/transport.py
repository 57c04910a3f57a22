"""How expert parallelism moves rows between ranks: the exchange behind one interface.

The EP layer (`mok_jax._src.ep`) plans globally (every rank knows every rank's kept
pairs per expert) and then asks a transport for two moves, forward and backward:

* ``dispatch_tokens``: each kept pair's token row (of x, or dy) goes to the rank
  that owns the pair's expert, landing at its row of that rank's expert-grouped
  input (each local expert's rows in global token order, then k); optionally a
  per-pair value (the expert weight) travels with it;
* ``combine``: each expert-grouped row returns to the rank that owns its token,
  which sums its k rows in ascending k in f32 and rounds once (the ``mok_combine``
  kernel's arithmetic); optionally a per-row value comes back by pair.

A transport adds the routing state it needs (`route`) to the plan once per call.
Rows are whole rows and the sum is the one combine kernel: a transport never
changes the arithmetic, so every transport gives the same bits.

* `XlaTransport` (``backend="xla"``): XLA's all_to_all with fixed slots.
* `NvlinkTransport` (``backend="fused"``): mok_jax's own kernels over NCCL
  symmetric memory (`mok_jax.comm`): the receiving rank pulls each token row it
  needs once per (token, destination rank) straight into the grouped input; the
  expert rows are pushed to per-(token, k) slots on the owner, which combines
  them from its window.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp

from mok_jax._src import primitives

_I32 = jnp.int32
# The EP plan and the XLA transport's maps number pairs and rows in int32 and keep
# one number past the last for "none" (and JAX's gathers and scatters take an
# array's length as an int32): every count of pairs or rows they number stays at
# most this.
MAX_INDEXED_ROWS = 2**31 - 2


def check_indexed_rows(what: str, count: int) -> None:
    """ValueError unless `count` (pairs or rows of `what`) fits the int32 index maps."""
    if count > MAX_INDEXED_ROWS:
        raise ValueError(
            f"mok_jax.moe: {what} = {count} exceeds {MAX_INDEXED_ROWS} (2^31 - 2): the "
            "expert-parallel plan numbers pairs and rows in int32. Use fewer tokens per "
            "call or fewer token shards.")


class Transport(Protocol):
    """The two row moves of an EP layer (see the module docstring)."""

    name: str

    def route(self, plan, cfg, top_k: int, experts_local: int, rows: int):
        """Per-call routing state (a pytree of arrays) from the global plan, for
        expert-grouped buffers of `rows` rows (>= P*T*K)."""

    def dispatch_tokens(self, tokens: jax.Array, route, cfg, pair_values=None):
        """Token rows ``[T, H]`` -> expert-grouped rows ``[R, H]`` on the experts'
        ranks (rows past the kept ones are unspecified: the expert kernels never
        read them), and, if ``pair_values [T, K]`` is given, its value of each
        row's pair ``[R]`` (else None)."""

    def combine(self, rows: jax.Array, route, cfg, weights, kept, *, weighted: bool,
                row_values=None):
        """Expert-grouped rows ``[R, H]`` -> ``[T, H]`` on the tokens' ranks:
        ``sum over kept k ascending of w[t, k] * row`` (w = 1 unless `weighted`),
        f32 sum rounded once; and, if ``row_values [R]`` is given, each pair's
        value ``[T*K]`` (unspecified for pairs without a row; else None)."""


class XlaRoute(NamedTuple):
    """Fixed-slot all_to_all routing: C = T*K slots per peer, P*C in all."""

    pair_slot: jax.Array   # [T*K] outgoing slot (dest * C + slot) of each pair (P*C: none)
    slot_pair: jax.Array   # [P*C] local pair sent in each outgoing slot (C: none)
    row_slot: jax.Array    # [R] received slot each expert row comes from (P*C: none)
    recv_row: jax.Array    # [P*C] expert row of each received slot (R: none)


def exclusive_cumsum(a, axis=-1):
    """Prefix sums of `a` along `axis`, each without its own element."""
    return jnp.cumsum(a, axis=axis) - a


def _take(values, index):
    """values[index] along axis 0; out-of-range indices give zero rows."""
    return jnp.take(values, index, axis=0, mode="fill", fill_value=0)


class XlaTransport:
    """XLA's ``all_to_all`` with a fixed slot of ``T*K`` rows per peer.

    Simple and fixed-shape, but it moves P times the rows that must move (measured on
    two H200s, docs/performance.md: 109 GB/s of useful rows against 166 for an exact-size
    all_to_all). Every move is a gather through index maps computed once per call.
    """

    name = "xla"

    def route(self, plan, cfg, top_k: int, experts_local: int, rows: int) -> XlaRoute:
        check_indexed_rows("the expert-grouped rows (at least P * T * K)", rows)
        P = cfg.ep_size
        C = plan.my_ids.shape[0]                                 # T*K slots per peer
        my_kept = plan.kept.reshape(-1) != 0
        # Sending side: my kept pairs sorted by (expert id, t, k); the message to rank
        # d holds my pairs of d's experts in that order.
        my_key = jnp.where(my_kept, plan.my_ids, P * experts_local)
        my_order = jnp.argsort(my_key, stable=True)
        my_rank = jnp.zeros(C, _I32).at[my_order].set(jnp.arange(C, dtype=_I32))
        first_of_expert = exclusive_cumsum(plan.counts[plan.me])   # [E] in my order
        dest = jnp.where(my_kept, plan.my_ids // experts_local, P)
        first_of_dest = first_of_expert[jnp.clip(dest, 0, P - 1) * experts_local]
        slot = jnp.where(my_kept, my_rank - first_of_dest, 0)
        pair_slot = jnp.where(dest < P, dest * C + slot, P * C)

        # Receiving side: slot j of the message from s holds my local expert l where
        # cum[s, l] <= j < cum[s, l + 1]; rows of l are ordered by source rank.
        mine = jax.lax.dynamic_slice_in_dim(plan.counts, plan.me * experts_local,
                                            experts_local, axis=1)  # [P, E_local]
        group_begin = exclusive_cumsum(plan.group_sizes)           # = mine.sum(axis=0)
        before = exclusive_cumsum(mine, axis=0)
        cum = exclusive_cumsum(mine, axis=1)
        total = mine.sum(axis=1)
        j = jnp.arange(C, dtype=_I32)
        # local[s, j] = #{l >= 1: cum[s, l] <= j} (cum[s, 0] = 0): a prefix sum of marks
        # at each cum[s, l] (not jnp.searchsorted, which fails to trace inside a
        # shard_map manual over some mesh axes only).
        starts = jnp.zeros((P, C + 1), _I32).at[
            jnp.arange(P)[:, None], cum[:, 1:]].add(1)
        local = jnp.clip(jnp.cumsum(starts, axis=1)[:, :C], 0, experts_local - 1)
        s = jnp.arange(P)[:, None]
        row = group_begin[local] + before[s, local] + j[None, :] - cum[s, local]
        recv_row = jnp.where(j[None, :] < total[:, None], row, rows).reshape(-1)

        # The inverse maps, so that every move is a gather (no zero fill + scatter
        # of [rows, H] blocks).
        slot_pair = jnp.full(P * C + 1, C, _I32).at[pair_slot].set(
            jnp.arange(C, dtype=_I32))[:-1]
        row_slot = jnp.full(rows + 1, P * C, _I32).at[recv_row].set(
            jnp.arange(P * C, dtype=_I32))[:-1]
        return XlaRoute(pair_slot, slot_pair, row_slot, recv_row)

    @staticmethod
    def _exchange(buf, cfg):
        return buf if cfg.axis_name is None else jax.lax.all_to_all(buf, cfg.axis_name, 0, 0)

    def dispatch(self, values, route: XlaRoute, cfg, *, repeat: int = 1):
        P = cfg.ep_size
        C = route.pair_slot.shape[0]
        if values.shape[0] * repeat != C:
            raise ValueError(f"dispatch: {values.shape[0]} rows x repeat {repeat} != {C} pairs")
        pair = route.slot_pair // repeat
        buf = _take(values, pair).reshape((P, C) + values.shape[1:])
        received = self._exchange(buf, cfg).reshape((P * C,) + values.shape[1:])
        return _take(received, route.row_slot)

    def gather_back(self, rows, route: XlaRoute, cfg):
        P = cfg.ep_size
        C = route.pair_slot.shape[0]
        out = _take(rows, route.recv_row).reshape((P, C) + rows.shape[1:])
        back = self._exchange(out, cfg).reshape((P * C,) + rows.shape[1:])
        return _take(back, route.pair_slot)

    def dispatch_tokens(self, tokens, route: XlaRoute, cfg, pair_values=None):
        top_k = route.pair_slot.shape[0] // tokens.shape[0] if tokens.shape[0] else 1
        rows = self.dispatch(tokens, route, cfg, repeat=top_k)
        if pair_values is None:
            return rows, None
        return rows, self.dispatch(pair_values.reshape(-1), route, cfg)

    def combine(self, rows, route: XlaRoute, cfg, weights, kept, *, weighted, row_values=None):
        (out,) = primitives.combine_p.bind(self.gather_back(rows, route, cfg), weights, kept,
                                           weighted=weighted)
        if row_values is None:
            return out, None
        return out, self.gather_back(row_values, route, cfg)


class NvlinkRoute(NamedTuple):
    """Pull and push lists of the NVLink transport on one rank (P ranks, T tokens,
    K picks, R = P*T*K grouped rows)."""

    entries: jax.Array    # [P*T] token rows to pull, src_rank * T + t (-1: none, at the end)
    pull_dest: jax.Array  # [P*T, K] grouped row of each entry's pair k (-1: not here)
    push_dest: jax.Array  # [R >= P*T*K] owner_rank * T*K + pair of each grouped row (-1: none)


class NvlinkTransport:
    """Rows moved by mok_jax's kernels through NCCL symmetric memory over NVLink.

    From the global plan every rank knows every kept pair of its exchange group,
    so it lists, in canonical order (local expert, then source rank, token, k),
    the rows it must receive. Dispatch: each rank copies its token rows into its
    window; a warp per needed (source rank, token) reads that row once from the
    peer's window and writes it to every grouped row that needs it. Combine: a
    warp per grouped row writes it to the owner's window at the pair's slot; the
    owner then runs the combine kernel over its slots. Bytes over NVLink: one
    token row per (token, destination rank) forward, one row per kept pair back.
    """

    name = "nvlink"

    def route(self, plan, cfg, top_k: int, experts_local: int, rows: int) -> NvlinkRoute:
        ids = plan.group_ids                                     # [P, C], -1: not kept
        P, C = ids.shape
        T = C // top_k
        mine = (ids >= 0) & (ids // experts_local == plan.me)
        key = jnp.where(mine, ids % experts_local, experts_local).reshape(-1)
        order = jnp.argsort(key, stable=True).astype(_I32)       # mine first, canonical
        j = jnp.arange(P * C, dtype=_I32)
        is_row = j < jnp.sum(mine, dtype=_I32)
        # order[j] = s * C + c: the owner's rank and its local pair, as the push wants.
        push_dest = jnp.pad(jnp.where(is_row, order, -1), (0, rows - P * C),
                            constant_values=-1)
        row_of_pair = jnp.full(P * C, -1, _I32).at[order].set(jnp.where(is_row, j, -1))
        row_of_pair = row_of_pair.reshape(P * T, top_k)
        need = jnp.any(row_of_pair >= 0, axis=1)                 # [P*T] by (s, t)
        (entries,) = jnp.nonzero(need, size=P * T, fill_value=-1)
        entries = entries.astype(_I32)
        pull_dest = jnp.where(entries[:, None] >= 0,
                              row_of_pair[jnp.clip(entries, 0, P * T - 1)], -1)
        return NvlinkRoute(entries, pull_dest, push_dest)

    def dispatch_tokens(self, tokens, route: NvlinkRoute, cfg, pair_values=None):
        R = route.push_dest.shape[0]
        T, K = tokens.shape[0], route.pull_dest.shape[1]
        pv = (jnp.zeros((0,), jnp.float32) if pair_values is None
              else pair_values.reshape(T, K))
        rows, row_values = primitives.ep_dispatch_p.bind(
            tokens, pv, route.entries, route.pull_dest, axis_name=cfg.axis_name, rows=R)
        return rows, (None if pair_values is None else row_values)

    def combine(self, rows, route: NvlinkRoute, cfg, weights, kept, *, weighted,
                row_values=None):
        rv = jnp.zeros((0,), weights.dtype) if row_values is None else row_values
        out, pair_values = primitives.ep_combine_p.bind(
            rows, rv, weights, kept, route.push_dest, axis_name=cfg.axis_name,
            weighted=weighted)
        return out, (None if row_values is None else pair_values)


TRANSPORTS = {"xla": XlaTransport(), "nvlink": NvlinkTransport()}
