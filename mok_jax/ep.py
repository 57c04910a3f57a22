"""Expert parallelism with XLA collectives (``backend="xla"``).

Inside ``jax.shard_map`` over an EP axis of size P, rank r holds tokens
``[r*T, (r+1)*T)`` of the global batch and experts ``[r*E_local,
(r+1)*E_local)``. The layer is the single-device layer cut at its seams:

1. every rank all-gathers the expert ids and computes the same global plan
   (each expert's rows in global token order, capacity applied globally);
2. each rank sends the x rows of its kept pairs to the experts' ranks with
   one ``all_to_all`` (fixed-size slots: T*K rows per peer);
3. the receiving rank regroups them by local expert in global order and runs
   the expert FFN (the ``mok_expert_ffn_fwd`` FFI kernel);
4. the outputs go back with a second ``all_to_all`` and the source rank
   combines over k in ascending order (the ``mok_combine`` FFI kernel).

Steps 3 and 4 are the very C++ code the single-device kernel runs, each row's
arithmetic does not depend on its neighbours, and each expert's rows arrive
in the global order, so results and gradients are bitwise equal to EP=1.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mok_jax import primitives

_I32 = jnp.int32


class _Config(NamedTuple):
    """Static description of one EP call.

    axis_name: the mesh axis the experts are sharded over (None: experts
      replicated, no exchange). ep_size: its size (1 when None).
    token_axes: every mesh axis the tokens are sharded over, major to minor;
      the plan (capacity, statistics) is global over all of them. Ranks that
      differ only in `axis_name` form one exchange group. Under shard_map this
      is (axis_name,).
    """

    axis_name: str | None
    ep_size: int
    capacity: int  # primitives.NO_CAPACITY for none
    token_axes: tuple[str, ...]


class _Route(NamedTuple):
    """Where each local pair goes and where each received slot lands."""

    kept: jax.Array         # [T, K] int32, 1 where the pair has a row
    pair_slot: jax.Array    # [T*K] outgoing slot (dest * C + slot) of each pair (P*C: none)
    recv_row: jax.Array     # [P, C] row of x_rows for each received slot (R = P*C: none)
    group_sizes: jax.Array  # [E_local] rows per local expert
    slot_pair: jax.Array    # [P*C] local pair sent in each outgoing slot (C: none)
    row_slot: jax.Array     # [R] received slot each expert row comes from (P*C: none)


def _exclusive_cumsum(a, axis=-1):
    return jnp.cumsum(a, axis=axis) - a


def _axis_sizes(axes):
    return [jax.lax.axis_size(a) for a in axes]


def _plan(expert_ids, cfg: _Config, experts_local: int):
    """The global routing plan, computed identically on every rank."""
    P = cfg.ep_size
    T, K = expert_ids.shape
    E = experts_local * P
    C = T * K                                                   # slots per peer

    if cfg.token_axes:
        ids_all = jax.lax.all_gather(expert_ids, cfg.token_axes)  # [G, T, K]
        g_me = jax.lax.axis_index(cfg.token_axes)               # my linear token shard
    else:
        ids_all, g_me = expert_ids[None], 0
    G = ids_all.shape[0]
    flat = ids_all.reshape(-1)                                  # global (shard, t, k) order
    n = flat.shape[0]
    valid = (flat >= 0) & (flat < E)
    key = jnp.where(valid, flat, E)
    order = jnp.argsort(key, stable=True)                       # by expert, then global order
    seg_start = jnp.searchsorted(key[order], jnp.arange(E + 1, dtype=key.dtype), side="left")
    pos_sorted = jnp.arange(n, dtype=_I32) - seg_start[key[order]].astype(_I32)
    pos = jnp.zeros(n, _I32).at[order].set(pos_sorted)          # rank within its expert
    kept = valid if cfg.capacity < 0 else valid & (pos < cfg.capacity)
    routed = (seg_start[1:] - seg_start[:-1]).astype(_I32)      # [E] valid pairs

    src = jnp.arange(n, dtype=_I32) // C
    cell = jnp.where(kept, src * E + flat, G * E)
    counts = jnp.zeros(G * E + 1, _I32).at[cell].add(1)[:-1].reshape(G, E)  # kept [shard, e]

    # My exchange group: the token shards that differ from mine in the EP axis only.
    if cfg.axis_name is None:
        me, counts_group = 0, counts[g_me][None]
    else:
        sizes = _axis_sizes(cfg.token_axes)
        i = cfg.token_axes.index(cfg.axis_name)
        stride = int(np.prod(sizes[i + 1:], dtype=np.int64))
        me = jax.lax.axis_index(cfg.axis_name)
        members = g_me + (jnp.arange(P) - me) * stride
        counts_group = counts[members]                          # [P, E]
    counts = counts_group

    # Sending side: my kept pairs sorted by (expert id, t, k); the message to rank
    # d holds my pairs of d's experts in that order.
    my_kept = kept.reshape(G, C)[g_me]
    my_ids = expert_ids.reshape(-1)
    my_key = jnp.where(my_kept, my_ids, E)
    my_order = jnp.argsort(my_key, stable=True)
    my_rank = jnp.zeros(C, _I32).at[my_order].set(jnp.arange(C, dtype=_I32))
    my_counts = counts[me]                                      # [E]
    first_of_expert = _exclusive_cumsum(my_counts)              # [E] in my sorted order
    dest = jnp.where(my_kept, my_ids // experts_local, P)
    first_of_dest = first_of_expert[jnp.clip(dest, 0, P - 1) * experts_local]
    slot = jnp.where(my_kept, my_rank - first_of_dest, 0)

    # Receiving side: slot j of the message from s belongs to my local expert l
    # where cum[s, l] <= j < cum[s, l + 1]; rows of l are ordered by source rank.
    mine = jax.lax.dynamic_slice_in_dim(counts, me * experts_local, experts_local, axis=1)
    group_sizes = mine.sum(axis=0)                              # [E_local]
    group_begin = _exclusive_cumsum(group_sizes)
    before = _exclusive_cumsum(mine, axis=0)                    # [P, E_local]
    cum = _exclusive_cumsum(mine, axis=1)                       # [P, E_local]
    total = mine.sum(axis=1)                                    # [P]
    j = jnp.arange(C, dtype=_I32)
    local = jax.vmap(lambda c: jnp.searchsorted(c, j, side="right") - 1)(cum)  # [P, C]
    local = jnp.clip(local, 0, experts_local - 1)
    s = jnp.arange(P)[:, None]
    row = group_begin[local] + before[s, local] + j[None, :] - cum[s, local]
    recv_row = jnp.where(j[None, :] < total[:, None], row, P * C)

    stats = (routed, jnp.sum(valid & ~kept).astype(_I32), jnp.sum(~valid).astype(_I32))
    if cfg.token_axes:
        # Every rank computed the same global numbers; pmax (tiny) says so in the
        # type, so that they can leave shard_map replicated under check_vma.
        stats = tuple(jax.lax.pmax(v, cfg.token_axes) for v in stats)
    # The inverse maps, so that moving rows is a gather (no zero fill + scatter of
    # [rows, H] blocks): the outgoing slots' pairs and the expert rows' slots.
    pair_slot = jnp.where(dest < P, dest * C + slot, P * C)
    slot_pair = jnp.full(P * C + 1, C, _I32).at[pair_slot].set(jnp.arange(C, dtype=_I32))[:-1]
    row_slot = jnp.full(P * C + 1, P * C, _I32).at[recv_row.reshape(-1)].set(
        jnp.arange(P * C, dtype=_I32))[:-1]
    route = _Route(my_kept.reshape(T, K).astype(_I32), pair_slot, recv_row, group_sizes,
                   slot_pair, row_slot)
    return route, stats


def _exchange(buf, axis):
    """all_to_all over the EP axis ([P, C, ...] in, slot blocks by peer out)."""
    return buf if axis is None else jax.lax.all_to_all(buf, axis, 0, 0)


def _take(values, index):
    """values[index] along axis 0; out-of-range indices give zero rows."""
    return jnp.take(values, index, axis=0, mode="fill", fill_value=0)


def _send(values, route: _Route, P: int, C: int, axis: str | None, repeat: int = 1):
    """values by local pair [T*K, ...] (or by token [T, ...] with repeat=K: pair p
    sends row p // K) -> received [P*C, ...] slots (zeros where empty)."""
    buf = _take(values, route.slot_pair // repeat).reshape((P, C) + values.shape[1:])
    return _exchange(buf, axis).reshape((P * C,) + values.shape[1:])


def _to_rows(received, route: _Route):
    """Received slots [P*C, ...] -> expert-grouped rows [R, ...] (zeros past the end)."""
    return _take(received, route.row_slot)


def _from_rows(rows, route: _Route, P: int, C: int, axis: str | None):
    """Expert-grouped rows [R, ...] -> back to the senders, by their local pair."""
    out = _take(rows, route.recv_row.reshape(-1)).reshape((P, C) + rows.shape[1:])
    back = _exchange(out, axis).reshape((P * C,) + rows.shape[1:])
    return _take(back, route.pair_slot)          # [T*K, ...]; zeros for pairs without a row


def _forward(cfg, x, expert_ids, expert_weights, w_gate_up, w_down, save):
    P, axis = cfg.ep_size, cfg.axis_name
    T, K = expert_ids.shape
    C = T * K
    route, stats = _plan(expert_ids, cfg, w_gate_up.shape[0])
    x_rows = _to_rows(_send(x, route, P, C, axis, repeat=K), route)  # [R, H]
    out_rows, gate_up = primitives.expert_ffn_fwd_p.bind(
        x_rows, route.group_sizes, w_gate_up, w_down, save_gate_up=save)
    o_pairs = _from_rows(out_rows, route, P, C, axis)
    (y,) = primitives.combine_p.bind(o_pairs, expert_weights, route.kept, weighted=True)
    return y, stats, (route, x_rows, gate_up)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def moe_ep(cfg: _Config, x, expert_ids, expert_weights, w_gate_up, w_down):
    """The EP layer under shard_map: local shards in, ``(y, stats)`` out."""
    y, stats, _ = _forward(cfg, x, expert_ids, expert_weights, w_gate_up, w_down, False)
    return y, stats


def _moe_ep_fwd(cfg, x, expert_ids, expert_weights, w_gate_up, w_down):
    y, stats, residuals = forward_with_residuals(
        cfg, x, expert_ids, expert_weights, w_gate_up, w_down)
    return (y, stats), residuals


def backward(cfg, residuals, dy):
    """Gradients w.r.t. (x, expert_weights, w_gate_up, w_down) from the residuals."""
    route, x_rows, gate_up, expert_ids, expert_weights, w_gate_up, w_down = residuals
    P, axis = cfg.ep_size, cfg.axis_name
    T, K = expert_ids.shape
    C = T * K
    dy_rows = _to_rows(_send(dy.astype(x_rows.dtype), route, P, C, axis, repeat=K), route)
    w_rows = _to_rows(_send(expert_weights.reshape(-1), route, P, C, axis), route)
    dx_rows, dw_rows, d_w_gate_up, d_w_down = primitives.expert_ffn_bwd_p.bind(
        x_rows, dy_rows, w_rows, route.group_sizes, w_gate_up, w_down, gate_up)
    # Replicas of an expert in other exchange groups saw other tokens: sum them.
    data_axes = tuple(a for a in cfg.token_axes if a != axis)
    if data_axes:
        d_w_gate_up = jax.lax.psum(d_w_gate_up, data_axes)
        d_w_down = jax.lax.psum(d_w_down, data_axes)
    dx_pairs = _from_rows(dx_rows, route, P, C, axis)
    dw_pairs = _from_rows(dw_rows, route, P, C, axis).reshape(T, K)
    (dx,) = primitives.combine_p.bind(dx_pairs, expert_weights, route.kept, weighted=False)
    d_weights = jnp.where(route.kept != 0, dw_pairs, jnp.zeros_like(dw_pairs))
    return dx, d_weights, d_w_gate_up, d_w_down


def forward_with_residuals(cfg, x, expert_ids, expert_weights, w_gate_up, w_down):
    """``(y, stats, residuals)`` for `backward` (used by mok_jax.sharding)."""
    y, stats, (route, x_rows, gate_up) = _forward(
        cfg, x, expert_ids, expert_weights, w_gate_up, w_down, True)
    return y, stats, (route, x_rows, gate_up, expert_ids, expert_weights, w_gate_up, w_down)



def _moe_ep_bwd(cfg, residuals, cotangents):
    dy, _ = cotangents
    dx, d_weights, d_w_gate_up, d_w_down = backward(cfg, residuals, dy)
    d_ids = np.zeros(residuals[3].shape, dtype=jax.dtypes.float0)
    return dx, d_ids, d_weights, d_w_gate_up, d_w_down


moe_ep.defvjp(_moe_ep_fwd, _moe_ep_bwd)
