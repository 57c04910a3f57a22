"""The NVLink transport's routing lists, checked on host devices (CPU).

`NvlinkTransport`'s kernels run on GPUs only, but its lists (`NvlinkTransport.route`)
are computed in XLA. Here every rank's lists come out of a shard_map over the EP
axis and two NumPy emulations of the kernels run them:

* dispatch (pull) on rank d: for each entry u >= 0, (s, t) = divmod(entries[u], T),
  and for each k with pull_dest[u, k] >= 0, row pull_dest[u, k] of d's grouped
  input gets token row t of rank s (and its pair value of (t, k));
* combine (push) on rank d: each grouped row j with push_dest[j] >= 0 goes to
  slot push_dest[j] % (T*K) of rank push_dest[j] // (T*K).

Both must give exactly what `XlaTransport` (the reference transport) gives in the
same shard_map: the same kept rows of the grouped input, and the same row back at
every kept pair. The lists' own invariants are checked against a NumPy plan made
from the global ids: one pull per (source rank, token) a rank needs, valid entries
first.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from mok_jax._src import ep
from mok_jax._src.primitives import NO_CAPACITY
from mok_jax.recipe import Recipe
from mok_jax._src.transport import NvlinkTransport, XlaTransport

from conftest import np_stats

CPUS = jax.devices("cpu")
E, H = 8, 16


# --- the global expert ids of each case: rng, (G shards, T, K) -> [G*T, K] ----------

def _random(rng, G, T, K, P):
    return rng.integers(0, E, (G * T, K))


def _with_invalid(rng, G, T, K, P):
    ids = rng.integers(0, E, (G * T, K))
    bad = rng.random((G * T, K)) < 0.3
    return np.where(bad, rng.choice([-1, -7, E, E + 5], (G * T, K)), ids)


def _all_to_rank0(rng, G, T, K, P):
    return rng.integers(0, E // P, (G * T, K))        # rank 0's experts only


def _rank1_keeps_to_itself(rng, G, T, K, P):
    """Rank 1's tokens go to rank 1's experts only; the others' anywhere (so rank 0
    receives nothing from rank 1, and rank 1 receives from everyone)."""
    el = E // P
    ids = rng.integers(0, E, (G, T, K))
    ids[1::P] = rng.integers(el, 2 * el, ids[1::P].shape)
    return ids.reshape(G * T, K)


def _all_invalid(rng, G, T, K, P):
    return rng.choice([-1, E, E + 3], (G * T, K))


# name: (mesh shape {"data": n, "ep": P}, T, K, capacity, ids maker, seed)
CASES = {
    "random_ep2_k2": ({"ep": 2}, 8, 2, None, _random, 0),
    "random_ep4_k2": ({"ep": 4}, 12, 2, None, _random, 1),
    "capacity_ep2": ({"ep": 2}, 16, 2, 3, _random, 2),
    "capacity_ep4": ({"ep": 4}, 8, 3, 2, _random, 3),
    "invalid_ep2": ({"ep": 2}, 12, 3, None, _with_invalid, 4),
    "invalid_capacity_ep4": ({"ep": 4}, 8, 2, 3, _with_invalid, 5),
    "all_to_rank0_ep2": ({"ep": 2}, 8, 2, None, _all_to_rank0, 6),
    "all_to_rank0_capacity_ep4": ({"ep": 4}, 8, 3, 4, _all_to_rank0, 7),
    "rank1_to_itself_ep2": ({"ep": 2}, 10, 2, None, _rank1_keeps_to_itself, 8),
    "rank1_to_itself_ep4": ({"ep": 4}, 8, 2, None, _rank1_keeps_to_itself, 9),
    "all_invalid_ep2": ({"ep": 2}, 8, 2, None, _all_invalid, 10),
    "top1_ep2": ({"ep": 2}, 16, 1, None, _random, 11),
    "top1_capacity_ep4": ({"ep": 4}, 16, 1, 2, _with_invalid, 12),
    "top4_ep2": ({"ep": 2}, 8, 4, None, _random, 13),
    "top4_capacity_ep4": ({"ep": 4}, 8, 4, 5, _with_invalid, 14),
    "dp2_ep2": ({"data": 2, "ep": 2}, 8, 2, None, _with_invalid, 15),
    "dp2_ep2_capacity": ({"data": 2, "ep": 2}, 8, 3, 3, _random, 16),
    "dp2_ep2_rank1_to_itself": ({"data": 2, "ep": 2}, 8, 2, None, _rank1_keeps_to_itself, 17),
    # EP the major axis: an exchange group's shards are D apart in the linear order.
    "ep2_dp2_ep_major": ({"ep": 2, "data": 2}, 8, 2, None, _with_invalid, 18),
    "ep2_dp2_ep_major_capacity": ({"ep": 2, "data": 2}, 8, 3, 3, _random, 19),
}


@functools.lru_cache(maxsize=None)
def _routes_fn(axes_items, K, capacity):
    """The jitted shard_map of `_routes` for one mesh, K and capacity, and its mesh
    (built once per setting, so cases that share one share its compile)."""
    axes = dict(axes_items)
    mesh = jax.make_mesh(tuple(axes.values()), tuple(axes), devices=CPUS[:int(np.prod(
        list(axes.values())))])
    token_axes = tuple(axes)
    Pep = axes["ep"]
    el = E // Pep
    cfg = ep.Config(axis_name="ep", ep_size=Pep,
                    capacity=NO_CAPACITY if capacity is None else capacity,
                    token_axes=token_axes, recipe=Recipe.NATIVE)
    spec = P(token_axes)

    def local(ids, x, pv, rows):
        p = ep.plan(ids, cfg, el)
        nv = NvlinkTransport().route(p, cfg, K, el, Pep * ids.shape[0] * K)
        xla = XlaTransport()
        xr = xla.route(p, cfg, K, el, Pep * ids.shape[0] * K)
        x_rows, pv_rows = xla.dispatch_tokens(x, xr, cfg, pair_values=pv)
        back = xla.gather_back(rows, xr, cfg)                  # [T*K, H] by pair
        outs = (nv.entries, nv.pull_dest, nv.push_dest, p.group_sizes, p.kept,
                x_rows, pv_rows, back)
        return tuple(o[None] for o in outs)

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4,
                              out_specs=(spec,) * 8, check_vma=True))
    return f, NamedSharding(mesh, spec)


def _routes(axes, K, capacity, ids_global, x, pair_values, rows_in):
    """Every token shard's (NVLink route, plan sizes, XLA transport results), stacked
    along a leading shard axis in the mesh's linear order of `axes`."""
    f, sh = _routes_fn(tuple(axes.items()), K, capacity)
    args = [jax.device_put(jnp.asarray(a), sh) for a in (ids_global, x, pair_values, rows_in)]
    return [np.asarray(o) for o in f(*args)]


@pytest.mark.parametrize("case", list(CASES))
def test_nvlink_route_moves_what_xla_moves(case):
    axes, T, K, capacity, make_ids, seed = CASES[case]
    Pep, D = axes["ep"], axes.get("data", 1)
    G, el, C = D * Pep, E // Pep, T * K
    R = Pep * C
    rng = np.random.default_rng(seed)
    ids_global = make_ids(rng, G, T, K, Pep).astype(np.int32)        # [G*T, K]
    # Distinct, exactly representable values everywhere, so any misplaced row shows.
    x = np.arange(G * T * H, dtype=np.float32).reshape(G * T, H)
    pair_values = (100_000 + np.arange(G * T * K, dtype=np.float32)).reshape(G * T, K)
    rows_in = -1.0 - np.arange(G * R * H, dtype=np.float32).reshape(G * R, H)

    (entries, pull_dest, push_dest, group_sizes, kept, x_rows, pv_rows,
     back) = _routes(axes, K, capacity, ids_global, x, pair_values, rows_in)
    assert entries.shape == (G, Pep * T) and pull_dest.shape == (G, Pep * T, K)
    assert push_dest.shape == (G, R)

    # The NumPy plan: global capacity over all token shards in (shard, t, k) order.
    _, _, _, keep = np_stats(ids_global, E, capacity)
    keep = keep.reshape(G, T, K)
    ids3 = ids_global.reshape(G, T, K)
    np.testing.assert_array_equal(kept != 0, keep, err_msg="plan.kept")
    x3 = x.reshape(G, T, H)
    pv3 = pair_values.reshape(G, T, K)
    rows3 = rows_in.reshape(G, R, H)

    ep_major = list(axes)[0] == "ep"
    for d0 in range(D):                           # one exchange group per data index
        # Its shards in the mesh's linear (token) order; member s is group[s].
        group = [s * D + d0 if ep_major else d0 * Pep + s for s in range(Pep)]
        slots = np.full((Pep, C, H), np.nan, np.float32)   # the owners' push windows
        writes = np.zeros((Pep, C), np.int64)
        for d in range(Pep):
            g = group[d]
            mine = keep[group] & (ids3[group] // el == d)   # [P, T, K]
            sizes = np.array([np.sum(mine & (ids3[group] == d * el + l))
                              for l in range(el)])
            np.testing.assert_array_equal(group_sizes[g], sizes, err_msg=f"sizes {g}")
            n = int(sizes.sum())

            # (c) valid entries first, then -1s; (a) each (s, t) at most once;
            # (b) exactly the (s, t) with a kept pair on my experts.
            ent = entries[g]
            nv = int(np.sum(ent >= 0))
            assert np.all(ent[:nv] >= 0) and np.all(ent[nv:] == -1), (g, ent)
            assert len(set(ent[:nv].tolist())) == nv, (g, ent)
            need = {s * T + t for s, t in zip(*np.nonzero(mine.any(axis=2)))}
            assert nv == len(need), (g, nv, len(need))
            assert set(ent[:nv].tolist()) == need, g
            assert np.all(pull_dest[g][nv:] == -1), g

            # Dispatch (pull) emulation.
            got = np.full((R, H), np.nan, np.float32)
            got_pv = np.full(R, np.nan, np.float32)
            hits = np.zeros(R, np.int64)
            for u in range(Pep * T):
                if ent[u] < 0:
                    continue
                s, t = divmod(int(ent[u]), T)
                assert 0 <= s < Pep, (g, ent[u])
                for k in range(K):
                    j = int(pull_dest[g, u, k])
                    assert -1 <= j < R, (g, u, k, j)
                    assert (j >= 0) == bool(mine[s, t, k]), (g, s, t, k, j)
                    if j >= 0:
                        got[j], got_pv[j] = x3[group[s], t], pv3[group[s], t, k]
                        hits[j] += 1
            np.testing.assert_array_equal(hits, np.arange(R) < n, err_msg=f"pulls {g}")
            np.testing.assert_array_equal(got[:n], x_rows[g][:n], err_msg=f"rows {g}")
            np.testing.assert_array_equal(got_pv[:n], pv_rows[g][:n], err_msg=f"pv {g}")

            # Combine (push) emulation: grouped rows j < n, and only they, go out.
            pd = push_dest[g]
            np.testing.assert_array_equal(pd >= 0, np.arange(R) < n, err_msg=f"push {g}")
            for j in range(R):
                if pd[j] < 0:
                    continue
                owner, pair = divmod(int(pd[j]), C)
                assert 0 <= owner < Pep, (g, j, pd[j])
                slots[owner, pair] = rows3[g, j]
                writes[owner, pair] += 1

        for s, o in enumerate(group):
            kp = keep[o].reshape(-1)
            np.testing.assert_array_equal(writes[s], kp, err_msg=f"slots of {o}")
            np.testing.assert_array_equal(slots[s][kp], back[o][kp], err_msg=f"back {o}")
