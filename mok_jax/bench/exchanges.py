"""`--exchange`: the EP dispatch exchange alone (XLA's all_to_all variants and the
fused transport's NVLink pull), with the bytes it moves per device."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mok_jax.bench import expert_parallel
from mok_jax.bench.expert_parallel import ep_mesh
from mok_jax.bench.measure import error_string, time_step
from mok_jax.bench.pipelines import platform_skip
from mok_jax.bench.shapes import Shape, make_routing, make_tokens
from mok_jax.recipe import Recipe


XLA_EXCHANGES = ("all_to_all_slots", "all_to_all_exact", "ragged_all_to_all")
NVLINK_EXCHANGES = ("nvlink_pull", "nvlink_pull_prerouted")
EXCHANGES = XLA_EXCHANGES + NVLINK_EXCHANGES
EXCHANGE_ABOUT = {
    "all_to_all_slots": "all_to_all with ep.py's layout: a fixed slot of T*K rows per "
                        "peer (any routing fits; P times the rows travel: P x T*K "
                        "rows x H x itemsize per device in slots, (P-1)/P of them leave "
                        "it)",
    "all_to_all_exact": "all_to_all with slots of exactly T*K/P rows (what a balanced "
                        "routing needs)",
    "ragged_all_to_all": "the T*K/P rows per peer named by offsets and sizes (only the "
                         "real rows travel); needs a GPU",
    "nvlink_pull": "the fused transport's dispatch on the bench inputs' routing: plan, "
                   "NvlinkTransport.route and dispatch_tokens (ep_dispatch_p), all timed; "
                   "one row per (token, other destination rank) travels; needs a GPU",
    "nvlink_pull_prerouted": "nvlink_pull with the plan and route made before, outside "
                             "the timed function: the ep_dispatch_p primitive alone; "
                             "needs a GPU",
}


def exchange_fn(kind: str, ep_size: int, rows: int, hidden: int) -> Callable:
    """One EP dispatch exchange over axis "ep", as the local function of a shard_map.

    Each device holds the rows it sends, `rows` = T*K of them, split evenly over
    the peers (rows // ep_size each, the balanced case):
    - all_to_all_slots: ep.py's layout, a fixed slot of `rows` rows per peer
      ([P * rows, H] in and out: any routing fits, P times the rows travel);
    - all_to_all_exact: slots of exactly rows // P (what a balanced routing needs);
    - ragged_all_to_all: the rows // P rows per peer named by offsets and sizes
      (any routing fits, only the real rows travel).
    (The nvlink exchanges are nvlink_fns'.)
    """
    per_peer = rows // ep_size

    if kind == "all_to_all_slots" or kind == "all_to_all_exact":
        slots = rows if kind == "all_to_all_slots" else per_peer

        def a2a(buf):
            blocks = buf.reshape(ep_size, slots, hidden)
            return jax.lax.all_to_all(blocks, "ep", 0, 0).reshape(ep_size * slots, hidden)
        return a2a
    if kind == "ragged_all_to_all":
        def ragged(buf, out):
            me = jax.lax.axis_index("ep").astype(jnp.int32)
            peers = jnp.arange(ep_size, dtype=jnp.int32)
            sizes = jnp.full((ep_size,), per_peer, jnp.int32)
            return jax.lax.ragged_all_to_all(
                buf, out, peers * per_peer, sizes,
                jnp.full((ep_size,), me * per_peer, jnp.int32), sizes, axis_name="ep")
        return ragged
    raise ValueError(f"unknown exchange {kind!r}; choose from {XLA_EXCHANGES}")


def nvlink_fns(ep_size: int, experts: int) -> dict[str, Callable]:
    """The fused transport's dispatch over axis "ep", as local functions of a
    shard_map (each rank: x [T, H], expert_ids [T, K] global ids, no capacity):

    - "route": expert_ids -> NvlinkRoute (ep.plan, then NvlinkTransport.route);
    - "nvlink_pull": (x, expert_ids) -> expert-grouped rows [P*T*K, H]: route and
      dispatch_tokens (ep_dispatch_p), what moe's EP forward does before its experts;
    - "nvlink_pull_prerouted": (x, entries, pull_dest, push_dest) -> the same rows
      from a route made before: the ep_dispatch_p primitive alone.
    """
    from mok_jax._src import ep, primitives, transport  # pylint: disable=import-outside-toplevel
    e_local = experts // ep_size
    cfg = ep.Config("ep", ep_size, primitives.NO_CAPACITY, ("ep",), Recipe.NATIVE)
    tr = transport.NvlinkTransport()

    def route(expert_ids):
        tokens, top_k = expert_ids.shape
        return tr.route(ep.plan(expert_ids, cfg, e_local), cfg, top_k, e_local,
                        ep_size * tokens * top_k)

    def pull(x, expert_ids):
        return tr.dispatch_tokens(x, route(expert_ids), cfg)[0]

    def pull_prerouted(x, entries, pull_dest, push_dest):
        return tr.dispatch_tokens(x, transport.NvlinkRoute(entries, pull_dest, push_dest),
                                  cfg)[0]

    return {"route": route, "nvlink_pull": pull, "nvlink_pull_prerouted": pull_prerouted}


def nvlink_pull_rows(expert_ids, ep_size: int, experts: int) -> np.ndarray:
    """Token rows each rank pulls from other ranks in one fused dispatch, [P] by
    receiving rank: the distinct (token, destination rank) pairs of the global
    routing `expert_ids` [P*T, K] (rank r holds tokens [r*T, (r+1)*T), expert e is
    on rank e // (E/P)) whose destination is not the token's own rank (that copy
    stays on the device). Ids outside [0, E) move nothing. numpy, no devices."""
    ids = np.asarray(expert_ids)
    n_tokens = ids.shape[0]
    if n_tokens % ep_size or experts % ep_size:
        raise ValueError(f"{n_tokens} tokens / {experts} experts do not split over "
                         f"{ep_size} ranks")
    e_local = experts // ep_size
    valid = (ids >= 0) & (ids < experts)
    token = np.broadcast_to(np.arange(n_tokens)[:, None], ids.shape)[valid]
    need = np.zeros((n_tokens, ep_size), bool)
    need[token, ids[valid] // e_local] = True           # one row per (token, rank)
    need[np.arange(n_tokens), np.arange(n_tokens) // (n_tokens // ep_size)] = False
    return need.sum(axis=0)


def nvlink_pull_bytes(expert_ids, ep_size: int, experts: int, hidden: int,
                      itemsize: int) -> np.ndarray:
    """Bytes each rank pulls from other ranks in one fused dispatch, [P] by
    receiving rank: nvlink_pull_rows x H x itemsize."""
    return nvlink_pull_rows(expert_ids, ep_size, experts) * hidden * itemsize


def exchange_bytes(kind: str, shape: Shape, ep_size: int, itemsize: int) -> dict:
    """The byte fields of an XLA exchange record (per device, T*K rows sent, balanced):
    `buffer_bytes_per_device` (the buffer exchanged), `bytes_moved_per_device` (what
    leaves the device), `bytes_per_device` (what GB/s counts: the rows that must leave,
    (P-1)/P of the T*K) and `bytes_basis`."""
    rows, row_bytes = shape.tokens * shape.top_k, shape.hidden * itemsize
    useful = rows * (ep_size - 1) // ep_size * row_bytes
    if kind == "all_to_all_slots":
        return {"buffer_bytes_per_device": ep_size * rows * row_bytes,
                "bytes_moved_per_device": (ep_size - 1) * rows * row_bytes,
                "bytes_per_device": useful,
                "bytes_basis": "slots: P x T*K rows x H x itemsize per device, of which "
                               "(P-1)/P leave it (bytes_moved_per_device); GB/s counts "
                               "only the rows that must leave, (P-1)/P of the T*K "
                               "(bytes_per_device)"}
    return {"buffer_bytes_per_device": rows // ep_size * ep_size * row_bytes,
            "bytes_moved_per_device": rows // ep_size * (ep_size - 1) * row_bytes,
            "bytes_per_device": useful,
            "bytes_basis": "T*K/P rows to each peer; GB/s counts the (P-1)/P of the "
                           "T*K rows x H x itemsize that leave the device"}


def bench_exchange(shape: Shape, ep_size: int, kind: str, *, dtype, warmup: int,
                   repeats: int, seed: int = 0) -> dict:
    """Time of one dispatch exchange of `shape` (T tokens, T*K rows per device) over
    `ep_size` devices. Every record has `bytes_per_device` and `gb_per_s` =
    bytes_per_device / median: for the XLA kinds the rows that must leave each device
    under balanced routing ((P-1)/P of T*K, exchange_bytes); for the nvlink kinds the
    mean over devices of the token rows pulled from other ranks on the bench inputs'
    real routing (seed `seed`, as bench_ep's; nvlink_pull_bytes; the max is
    `bytes_per_device_max`)."""
    from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel
    rows, hidden = shape.tokens * shape.top_k, shape.hidden
    itemsize = jnp.dtype(dtype).itemsize
    record = {"shape": shape.name, "exchange": kind, "ep_size": ep_size, "rows": rows,
              "hidden": hidden, "dtype": jnp.dtype(dtype).name, "status": "ok",
              "error": None, "median_ms": None, "min_ms": None, "gb_per_s": None}
    nvlink = kind in NVLINK_EXCHANGES
    global_shape = dataclasses.replace(shape, tokens=shape.tokens * ep_size)
    if nvlink:
        try:
            ids_global = make_routing(global_shape, seed)[0]
            ids_np = np.asarray(jax.device_get(ids_global))
            pulled = nvlink_pull_rows(ids_np, ep_size, shape.experts)
            per_device = [int(b) for b in nvlink_pull_bytes(ids_np, ep_size, shape.experts,
                                                            hidden, itemsize)]
        except Exception as err:  # pylint: disable=broad-except
            record.update(status="error", error=error_string(err))
            return record
        record.update(
            pulled_rows_per_device=[int(n) for n in pulled],
            bytes_per_device=sum(per_device) / ep_size,
            bytes_per_device_max=max(per_device),
            bytes_moved_per_device=sum(per_device) / ep_size,
            bytes_basis="token rows pulled from other ranks: distinct (token, "
                        "destination rank) pairs of the bench routing whose "
                        "destination is not the token's rank, x H x itemsize; "
                        "bytes_per_device (and gb_per_s) is the mean over receiving "
                        "devices, bytes_per_device_max (gb_per_s_max) the largest")
    else:
        record.update(exchange_bytes(kind, shape, ep_size, itemsize))
    why = platform_skip(kind, jax.default_backend())
    if why:
        record.update(status="skipped", error=why)
        return record
    why = expert_parallel.fused_unavailable() if nvlink else None
    if why:
        record.update(status="unavailable", error=why)
        return record
    mesh, why = ep_mesh(ep_size)
    if mesh is None:
        record.update(status="unavailable", error=why)
        return record
    if kind == "all_to_all_exact" and rows % ep_size:
        record.update(status="unavailable",
                      error=f"its slots hold exactly T*K / P rows, and T*K = {rows} rows do "
                            f"not split evenly over P = {ep_size} devices")
        return record
    try:
        spec = PartitionSpec("ep")
        sharded = NamedSharding(mesh, spec)
        if nvlink:
            fns = nvlink_fns(ep_size, shape.experts)
            x = jax.jit(lambda: make_tokens(global_shape, dtype, seed),
                        out_shardings=sharded)()
            ids = jax.device_put(ids_global, sharded)
            if kind == "nvlink_pull":
                args, specs = [x, ids], (spec, spec)
            else:  # the route made here, outside the timed function
                route = jax.jit(jax.shard_map(fns["route"], mesh=mesh, in_specs=(spec,),
                                              out_specs=spec))(ids)
                args, specs = [x, *jax.block_until_ready(route)], (spec,) * 4
            local_fn = fns[kind]
        else:
            local_rows = rows * ep_size if kind == "all_to_all_slots" else rows

            def filled(n_rows, value):  # made in place, shard by shard (not on one device)
                return jax.jit(lambda: jnp.full((ep_size * n_rows, hidden), value, dtype),
                               out_shardings=sharded)()
            args = [filled(local_rows, 1)]
            specs = (spec,)
            if kind == "ragged_all_to_all":
                args.append(filled(rows, 0))
                specs += (spec,)
            local_fn = exchange_fn(kind, ep_size, rows, hidden)
        step = jax.jit(jax.shard_map(local_fn, mesh=mesh, in_specs=specs, out_specs=spec))
        compile_s, times_ms, _ = time_step(step, args, warmup=warmup, repeats=repeats)
    except Exception as err:  # pylint: disable=broad-except
        record.update(status="error", error=error_string(err))
        return record
    median = statistics.median(times_ms)
    record.update(median_ms=median, min_ms=min(times_ms), compile_s=compile_s,
                  times_ms=times_ms,
                  gb_per_s=record["bytes_per_device"] / (median * 1e-3) / 1e9)
    if nvlink:
        record["gb_per_s_max"] = record["bytes_per_device_max"] / (median * 1e-3) / 1e9
    return record
