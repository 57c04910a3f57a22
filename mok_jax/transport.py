"""How expert parallelism moves rows between ranks: the exchange behind one interface.

The EP layer (`mok_jax.ep`) plans globally (every rank knows every rank's kept
pairs per expert) and then asks a transport for two moves, forward and backward:

* ``dispatch``: each kept pair's row (of x, dy, or a per-pair value) goes to the
  rank that owns the pair's expert, landing at its row of that rank's
  expert-grouped input (each local expert's rows in global token order, then k);
* ``gather_back``: each expert-grouped row returns to the rank that owns its
  token, by local pair ``(t, k)`` (zeros for pairs without a row).

A transport adds the routing state it needs (`route`) to the plan once per call.
Rows are whole rows: a transport never reorders the arithmetic, so every transport
gives the same bits. `XlaTransport` is the exchange of ``backend="xla"``; the NVLink
transport of ``backend="fused"`` will implement the same two moves inside mok_jax's
kernels, pulling rows straight into the grouped GEMM's input tile by tile.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp

_I32 = jnp.int32


class Transport(Protocol):
    """The two row moves of an EP layer (see the module docstring)."""

    name: str

    def route(self, plan, cfg, top_k: int, experts_local: int):
        """Per-call routing state (a pytree of arrays) from the global plan."""

    def dispatch(self, values: jax.Array, route, cfg, *, repeat: int = 1) -> jax.Array:
        """``values`` by local pair ``[T*K, ...]`` (or by token ``[T, ...]`` with
        ``repeat=K``: every pair of token t sends row t) -> expert-grouped rows
        ``[R, ...]`` on the experts' ranks (zeros past the kept rows)."""

    def gather_back(self, rows: jax.Array, route, cfg) -> jax.Array:
        """Expert-grouped rows ``[R, ...]`` -> ``[T*K, ...]`` by local pair on the
        tokens' ranks."""


class XlaRoute(NamedTuple):
    """Fixed-slot all_to_all routing: C = T*K slots per peer, P*C in all."""

    pair_slot: jax.Array   # [T*K] outgoing slot (dest * C + slot) of each pair (P*C: none)
    slot_pair: jax.Array   # [P*C] local pair sent in each outgoing slot (C: none)
    row_slot: jax.Array    # [R] received slot each expert row comes from (P*C: none)
    recv_row: jax.Array    # [P*C] expert row of each received slot (R: none)


def _exclusive_cumsum(a, axis=-1):
    return jnp.cumsum(a, axis=axis) - a


def _take(values, index):
    """values[index] along axis 0; out-of-range indices give zero rows."""
    return jnp.take(values, index, axis=0, mode="fill", fill_value=0)


class XlaTransport:
    """XLA's ``all_to_all`` with a fixed slot of ``T*K`` rows per peer.

    Simple and fixed-shape, but it moves P times the rows that must move (measured on
    two H200s, docs/perf.md: 109 GB/s of useful rows against 166 for an exact-size
    all_to_all). Every move is a gather through index maps computed once per call.
    """

    name = "xla"

    def route(self, plan, cfg, top_k: int, experts_local: int) -> XlaRoute:
        P = cfg.ep_size
        C = plan.my_ids.shape[0]                                 # T*K slots per peer
        my_kept = plan.kept.reshape(-1) != 0
        # Sending side: my kept pairs sorted by (expert id, t, k); the message to rank
        # d holds my pairs of d's experts in that order.
        my_key = jnp.where(my_kept, plan.my_ids, P * experts_local)
        my_order = jnp.argsort(my_key, stable=True)
        my_rank = jnp.zeros(C, _I32).at[my_order].set(jnp.arange(C, dtype=_I32))
        first_of_expert = _exclusive_cumsum(plan.counts[plan.me])   # [E] in my order
        dest = jnp.where(my_kept, plan.my_ids // experts_local, P)
        first_of_dest = first_of_expert[jnp.clip(dest, 0, P - 1) * experts_local]
        slot = jnp.where(my_kept, my_rank - first_of_dest, 0)
        pair_slot = jnp.where(dest < P, dest * C + slot, P * C)

        # Receiving side: slot j of the message from s holds my local expert l where
        # cum[s, l] <= j < cum[s, l + 1]; rows of l are ordered by source rank.
        mine = jax.lax.dynamic_slice_in_dim(plan.counts, plan.me * experts_local,
                                            experts_local, axis=1)  # [P, E_local]
        group_begin = _exclusive_cumsum(plan.group_sizes)           # = mine.sum(axis=0)
        before = _exclusive_cumsum(mine, axis=0)
        cum = _exclusive_cumsum(mine, axis=1)
        total = mine.sum(axis=1)
        j = jnp.arange(C, dtype=_I32)
        local = jax.vmap(lambda c: jnp.searchsorted(c, j, side="right") - 1)(cum)
        local = jnp.clip(local, 0, experts_local - 1)
        s = jnp.arange(P)[:, None]
        row = group_begin[local] + before[s, local] + j[None, :] - cum[s, local]
        recv_row = jnp.where(j[None, :] < total[:, None], row, P * C).reshape(-1)

        # The inverse maps, so that every move is a gather (no zero fill + scatter
        # of [rows, H] blocks).
        slot_pair = jnp.full(P * C + 1, C, _I32).at[pair_slot].set(
            jnp.arange(C, dtype=_I32))[:-1]
        row_slot = jnp.full(P * C + 1, P * C, _I32).at[recv_row].set(
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


TRANSPORTS = {"xla": XlaTransport()}
