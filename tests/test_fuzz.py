"""Property test: over random shapes, dtypes and routings, moe matches the reference
within the contract's tolerance and its statistics match a NumPy count exactly."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mok_jax
from mok_jax.reference import moe_reference

from conftest import assert_close, make_problem, np_stats

ROUTINGS = ("topk", "one", "invalid", "capacity")


@st.composite
def problems(draw):
    # Routing and capacity first: hypothesis varies early draws the most.
    routing = draw(st.sampled_from(ROUTINGS))
    capacity_factor = draw(st.sampled_from([None, 0.5, 1.0, 2.0]))
    if routing == "capacity" and capacity_factor is None:
        capacity_factor = 0.5
    dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16]))
    E = draw(st.integers(1, 9))
    K = draw(st.integers(1, min(E, 4)))
    T = draw(st.integers(1, 40))
    H = draw(st.integers(1, 40))
    F = draw(st.integers(1, 24))
    seed = draw(st.integers(0, 2**31 - 1))
    return T, K, E, H, F, dtype, routing, capacity_factor, seed


@pytest.mark.slow
@settings(max_examples=25, deadline=None, derandomize=True, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_moe_matches_reference(problem):
    T, K, E, H, F, dtype, routing, capacity_factor, seed = problem
    x, ids, w, wgu, wd = make_problem(seed, T, K, E, H, F, dtype,
                                      routing="one" if routing == "one" else "topk",
                                      expert=seed % E)
    if routing == "invalid":
        rng = np.random.default_rng(seed)
        bad = rng.random((T, K)) < 0.3
        values = rng.choice(np.array([-1, E, E + 1, 10**6, np.iinfo(np.int32).min]), (T, K))
        ids = jnp.asarray(np.where(bad, values, np.asarray(ids)).astype(np.int32))
    if routing == "capacity":
        ids = ids.at[::2, 0].set(0)  # skew towards expert 0 so that something drops
    args = (x, ids, w, wgu, wd)

    y, stats = mok_jax.moe(*args, capacity_factor=capacity_factor, return_stats=True)
    y_ref, stats_ref = moe_reference(*args, capacity_factor=capacity_factor, return_stats=True)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, y_ref, dtype, what=f"{problem}")

    cap = mok_jax.capacity(capacity_factor, T, K, E)
    tpe, dropped, invalid, keep = np_stats(ids, E, cap)
    np.testing.assert_array_equal(np.asarray(stats.tokens_per_expert), tpe)
    assert int(stats.dropped) == dropped
    assert int(stats.invalid) == invalid
    for a, b in zip(stats, stats_ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Tokens with no kept pair get exactly 0.
    np.testing.assert_array_equal(np.asarray(y, np.float32)[~keep.any(axis=1)], 0.0)
