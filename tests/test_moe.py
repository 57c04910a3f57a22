"""Forward pass of mok_jax.moe: values, routing edge cases, capacity, invalid ids,
NaN/Inf, determinism, transformations, and the fixed numerics of docs/contract.md."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax
from mok_jax.reference import moe_reference

from conftest import BF16, assert_bitwise, assert_close, make_problem, np_stats

F32 = np.dtype(np.float32)
I32_MIN = int(np.iinfo(np.int32).min)


# --------------------------------------------------------------------------------------
# Independent float64 oracle (deliberately not derived from mok_jax.reference)
# --------------------------------------------------------------------------------------


def numpy_moe(x, ids, weights, wgu, wd, keep=None):
    """y[t] = sum_k keep[t,k] * w[t,k] * FFN_{ids[t,k]}(x[t]) in float64, from the
    (already rounded) input values; invalid ids contribute 0."""
    x = np.asarray(x, np.float64)
    ids = np.asarray(ids)
    w = np.asarray(weights, np.float64)
    wgu = np.asarray(wgu, np.float64)
    wd = np.asarray(wd, np.float64)
    T, K = ids.shape
    E, _, F2 = wgu.shape
    F = F2 // 2
    valid = (ids >= 0) & (ids < E)
    if keep is None:
        keep = valid
    y = np.zeros_like(x)
    for k in range(K):
        e = np.where(valid[:, k], ids[:, k], 0)
        gu = np.einsum("th,thf->tf", x, wgu[e])
        g, u = gu[:, :F], gu[:, F:]
        h = g / (1.0 + np.exp(-g)) * u
        o = np.einsum("tf,tfh->th", h, wd[e])
        y += np.where(keep[:, k, None], w[:, k, None] * o, 0.0)
    return y


def check_forward(args, dtype, capacity_factor=None, what=""):
    """moe vs reference (contract tolerance), vs float64 NumPy, and stats vs NumPy."""
    x, ids, w, wgu, wd = args
    T, K = ids.shape
    E = wgu.shape[0]
    y, stats = mok_jax.moe(*args, capacity_factor=capacity_factor, return_stats=True)
    assert y.shape == x.shape and y.dtype == x.dtype, (y.shape, y.dtype)
    y_ref = moe_reference(*args, capacity_factor=capacity_factor)
    assert_close(y, y_ref, dtype, what=f"{what} moe vs reference")

    cap = mok_jax.capacity(capacity_factor, T, K, E)
    tpe, dropped, invalid, keep = np_stats(ids, E, cap)
    y64 = numpy_moe(x, ids, w, wgu, wd, keep)
    assert_close(y, y64, dtype, what=f"{what} moe vs float64 NumPy")

    assert stats.tokens_per_expert.shape == (E,)
    assert stats.tokens_per_expert.dtype == jnp.int32
    assert stats.dropped.shape == () and stats.dropped.dtype == jnp.int32
    assert stats.invalid.shape == () and stats.invalid.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(stats.tokens_per_expert), tpe)
    assert int(stats.dropped) == dropped
    assert int(stats.invalid) == invalid
    # Asking for stats does not change y.
    assert_bitwise(y, mok_jax.moe(*args, capacity_factor=capacity_factor), what)
    return y


DTYPES = [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16")]

SHAPES = [  # T, K, E, H, F
    pytest.param(16, 2, 4, 32, 16, id="basic"),
    pytest.param(7, 2, 3, 24, 5, id="odd"),
    pytest.param(1, 1, 1, 8, 4, id="T1-K1-E1"),
    pytest.param(1, 3, 8, 5, 3, id="T1"),
    pytest.param(13, 4, 4, 16, 8, id="K=E"),
    pytest.param(37, 1, 6, 40, 24, id="K1-T37"),
    pytest.param(29, 3, 5, 12, 7, id="T29"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K,E,H,F", SHAPES)
def test_forward(T, K, E, H, F, dtype):
    args = make_problem(T * 1000 + K * 100 + E, T, K, E, H, F, dtype)
    check_forward(args, dtype)


def test_forward_weights_in_x_dtype():
    args = make_problem(1, 11, 2, 4, 16, 8, jnp.bfloat16, weights_dtype=jnp.bfloat16)
    assert args[2].dtype == jnp.bfloat16
    check_forward(args, jnp.bfloat16)


# --------------------------------------------------------------------------------------
# Routing edge cases
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [1, 2])
def test_all_tokens_on_one_expert(K, dtype):
    T, E = 19, 4
    args = make_problem(3, T, K, E, 16, 8, dtype, routing="one", expert=2)
    check_forward(args, dtype)
    _, stats = mok_jax.moe(*args, return_stats=True)
    np.testing.assert_array_equal(np.asarray(stats.tokens_per_expert), [0, 0, T * K, 0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_experts(dtype):
    T, K, E = 12, 2, 8
    x, _, w, wgu, wd = make_problem(4, T, K, E, 16, 8, dtype)
    ids = np.where(np.arange(T * K).reshape(T, K) % 2 == 0, 1, 5).astype(np.int32)
    args = (x, jnp.asarray(ids), w, wgu, wd)
    check_forward(args, dtype)
    _, stats = mok_jax.moe(*args, return_stats=True)
    np.testing.assert_array_equal(np.asarray(stats.tokens_per_expert), [0, T, 0, 0, 0, T, 0, 0])


def test_empty_experts_ignore_their_weights():
    # Experts that receive no pair may hold anything (here NaN): y does not read them.
    x, ids, w, wgu, wd = make_problem(5, 6, 1, 3, 8, 4, jnp.float32)
    ids = jnp.zeros_like(ids)
    y = mok_jax.moe(x, ids, w, wgu, wd)
    y_nan = mok_jax.moe(x, ids, w, wgu.at[1:].set(jnp.nan), wd.at[1:].set(jnp.nan))
    assert_bitwise(y, y_nan, "NaN in unused experts")


def test_duplicate_expert_in_token_counts_twice():
    # 0.25*o + 0.5*o is exact up to one rounding, the same rounding as 0.75*o: bitwise.
    x, _, _, wgu, wd = make_problem(6, 5, 2, 3, 16, 8, jnp.float32)
    ids2 = jnp.full((5, 2), 1, jnp.int32)
    w2 = jnp.tile(jnp.asarray([[0.25, 0.5]], jnp.float32), (5, 1))
    y2, stats = mok_jax.moe(x, ids2, w2, wgu, wd, return_stats=True)
    y1 = mok_jax.moe(x, ids2[:, :1], jnp.full((5, 1), 0.75, jnp.float32), wgu, wd)
    assert_bitwise(y2, y1, "duplicate id")
    np.testing.assert_array_equal(np.asarray(stats.tokens_per_expert), [0, 10, 0])
    check_forward((x, ids2, w2, wgu, wd), jnp.float32)


def test_zero_weights_give_zero():
    x, ids, w, wgu, wd = make_problem(7, 8, 2, 4, 16, 8, jnp.float32)
    y = mok_jax.moe(x, ids, jnp.zeros_like(w), wgu, wd)
    np.testing.assert_array_equal(np.asarray(y), 0.0)


# --------------------------------------------------------------------------------------
# Capacity
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "c,T,K,E",
    [(1.0, 16, 2, 4), (0.5, 7, 2, 3), (1.25, 10, 3, 4), (2.0, 1, 1, 8), (1e-6, 64, 8, 16),
     (0.75, 37, 3, 5), (9.0, 4, 2, 4), (1e308, 16, 2, 4), (10**400, 16, 2, 4)],
)
def test_capacity_formula(c, T, K, E):
    """ceil(c*T*K/E), clamped at T*K pairs (more can never reach one expert): the
    last three cases are past it, the last two's products past the largest float
    (an int factor is finite at any size)."""
    cap = mok_jax.capacity(c, T, K, E)
    assert isinstance(cap, int)
    want = T * K if c >= 1e308 else min(math.ceil(c * T * K / E), T * K)  # c*T*K: inf
    assert cap == want
    assert mok_jax.capacity(None, T, K, E) is None


@pytest.mark.parametrize("c", [0.0, -1.0, float("nan"), float("inf"), True, "2"])
def test_capacity_refuses_what_moe_refuses(c):
    with pytest.raises(ValueError, match="mok_jax.capacity: capacity_factor must be None"):
        mok_jax.capacity(c, 16, 2, 4)


@pytest.mark.parametrize("T,K,E,name", [(-16, 2, 4, "num_tokens"), (16, 0, 4, "top_k"),
                                         (16, 2, 0, "num_experts"), (16, 2, -4, "num_experts"),
                                         (16.0, 2, 4, "num_tokens"), (16, True, 4, "top_k")])
def test_capacity_refuses_counts_out_of_range(T, K, E, name):
    for c in (1.0, None):
        with pytest.raises(ValueError, match=f"mok_jax.capacity: {name} must be an int"):
            mok_jax.capacity(c, T, K, E)


def test_an_int_capacity_factor_past_a_floats_range_keeps_every_pair():
    args = make_problem(6, 16, 2, 4, 16, 8, jnp.float32)
    y, stats = mok_jax.moe(*args, capacity_factor=10**400, return_stats=True)
    assert_bitwise(y, mok_jax.moe(*args), "10**400 against None")
    assert int(stats.dropped) == 0


def test_capacity_drop_order_hand_checked():
    # cap = ceil(0.5 * 6 * 2 / 3) = 2 rows per expert; pairs in (token, k) order.
    T, K, E = 6, 2, 3
    ids = np.array([[0, 1],
                    [0, 0],   # expert 0 full after (1,0): (1,1) dropped (k tie, same token)
                    [2, 1],
                    [1, 2],   # expert 1: third pair -> dropped
                    [-1, 2],  # invalid pair is not routed and takes no slot; (4,1) dropped
                    [0, 7]],  # expert 0 already full -> dropped; 7 is invalid
                   np.int32)
    want_keep = np.array([[1, 1], [1, 0], [1, 1], [0, 1], [0, 0], [0, 0]], bool)
    assert mok_jax.capacity(0.5, T, K, E) == 2
    tpe, dropped, invalid, keep = np_stats(ids, E, 2)
    np.testing.assert_array_equal(keep, want_keep)  # the oracle agrees with the hand check

    x, _, w, wgu, wd = make_problem(8, T, K, E, 16, 8, jnp.float32)
    args = (x, jnp.asarray(ids), w, wgu, wd)
    y, stats = mok_jax.moe(*args, capacity_factor=0.5, return_stats=True)
    np.testing.assert_array_equal(np.asarray(stats.tokens_per_expert), [4, 3, 3])
    assert int(stats.dropped) == 4
    assert int(stats.invalid) == 2
    # Dropped pairs contribute 0: same as zeroing their weights without capacity.
    y_zeroed = mok_jax.moe(x, jnp.asarray(np.where(ids < E, ids, 0)),
                           jnp.where(jnp.asarray(want_keep), w, 0.0), wgu, wd)
    assert_close(y, y_zeroed, jnp.float32, what="capacity vs zeroed weights")
    np.testing.assert_array_equal(np.asarray(y[4:]), 0.0)  # tokens with nothing kept
    check_forward(args, jnp.float32, capacity_factor=0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c", [0.25, 0.5, 1.0, 1.5])
def test_capacity_random(c, dtype):
    T, K, E = 24, 2, 4
    x, ids, w, wgu, wd = make_problem(9, T, K, E, 16, 8, dtype)
    # Skew the routing so that expert 0 overflows: 16 of 48 pairs (cap at c=1 is 12).
    # A token may now name expert 0 twice; that is a legal routing.
    ids = ids.at[jnp.arange(T) % 3 != 2, 0].set(0)
    args = (x, ids, w, wgu, wd)
    check_forward(args, dtype, capacity_factor=c)
    if c < 1.5:
        _, stats = mok_jax.moe(*args, capacity_factor=c, return_stats=True)
        assert int(stats.dropped) > 0


def test_capacity_tiny_factor_keeps_first_pair_per_expert():
    # ceil(c*T*K/E) >= 1 for every c > 0: each expert keeps exactly its first pair.
    T, K, E = 8, 1, 2
    x, _, w, wgu, wd = make_problem(10, T, K, E, 16, 8, jnp.float32)
    ids = jnp.zeros((T, K), jnp.int32)
    assert mok_jax.capacity(1e-6, T, K, E) == 1
    y, stats = mok_jax.moe(x, ids, w, wgu, wd, capacity_factor=1e-6, return_stats=True)
    assert int(stats.dropped) == T - 1
    np.testing.assert_array_equal(np.asarray(stats.tokens_per_expert), [T, 0])
    np.testing.assert_array_equal(np.asarray(y[1:]), 0.0)
    assert np.all(np.asarray(y[0]) != 0.0)
    y_full = mok_jax.moe(x, ids, w, wgu, wd)
    assert_close(y[0], y_full[0], jnp.float32, what="kept pair")


def test_capacity_large_factor_drops_nothing():
    args = make_problem(11, 16, 2, 4, 16, 8, jnp.float32, routing="one", expert=1)
    y_none = mok_jax.moe(*args)
    # cap = ceil(2 * 16 * 2 / 4) = 16 < 32 pairs on expert 1; factor 4 -> cap 32.
    y_big, stats = mok_jax.moe(*args, capacity_factor=4.0, return_stats=True)
    assert int(stats.dropped) == 0
    assert_close(y_big, y_none, jnp.float32, what="capacity that fits everything")


# --------------------------------------------------------------------------------------
# Invalid expert ids
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [-1, "E", 10**6, I32_MIN])
def test_invalid_ids_contribute_zero(bad, dtype):
    T, K, E = 10, 3, 5
    x, ids, w, wgu, wd = make_problem(12, T, K, E, 16, 8, dtype)
    bad = E if bad == "E" else bad
    mask = np.zeros((T, K), bool)
    mask[[0, 3, 3, 7, 9, 9, 9], [1, 0, 2, 2, 0, 1, 2]] = True  # token 9: all invalid
    ids_bad = jnp.where(jnp.asarray(mask), bad, ids)
    y, stats = mok_jax.moe(x, ids_bad, w, wgu, wd, return_stats=True)
    # Same problem with those pairs made valid but weighted 0.
    y_zero = mok_jax.moe(x, ids, jnp.where(jnp.asarray(mask), 0.0, w).astype(w.dtype), wgu, wd)
    assert_close(y, y_zero, dtype, f32_tol=1e-6, what="invalid vs zero weight")
    np.testing.assert_array_equal(np.asarray(y[9]), 0.0)
    assert int(stats.invalid) == int(mask.sum())
    assert int(stats.dropped) == 0
    tpe, _, _, _ = np_stats(ids_bad, E)
    np.testing.assert_array_equal(np.asarray(stats.tokens_per_expert), tpe)
    assert int(np.asarray(stats.tokens_per_expert).sum()) == T * K - int(mask.sum())
    check_forward((x, ids_bad, w, wgu, wd), dtype)


def test_invalid_ids_take_no_capacity():
    # cap = ceil(0.5 * 4 * 1 / 2) = 1.
    x, _, w, wgu, wd = make_problem(13, 4, 1, 2, 8, 4, jnp.float32)
    ids = jnp.asarray([[-1], [0], [0], [5]], jnp.int32)
    y, stats = mok_jax.moe(x, ids, w, wgu, wd, capacity_factor=0.5, return_stats=True)
    np.testing.assert_array_equal(np.asarray(stats.tokens_per_expert), [2, 0])
    assert int(stats.dropped) == 1 and int(stats.invalid) == 2
    np.testing.assert_array_equal(np.asarray(y[jnp.asarray([0, 2, 3])]), 0.0)
    assert np.all(np.asarray(y[1]) != 0.0)


# --------------------------------------------------------------------------------------
# NaN and Inf
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_in_x_stays_in_its_token(dtype):
    T, K, E = 8, 2, 4
    x, ids, w, wgu, wd = make_problem(14, T, K, E, 16, 8, dtype)
    ids = ids.at[5].set(jnp.asarray([-1, E], jnp.int32))  # token 5 has no valid pair
    y = mok_jax.moe(x, ids, w, wgu, wd)
    x_nan = x.at[2, 3].set(jnp.nan).at[5, 0].set(jnp.nan)
    y_nan = mok_jax.moe(x_nan, ids, w, wgu, wd)
    assert np.all(np.isnan(np.asarray(y_nan[2], np.float32))), "NaN must reach y[2]"
    np.testing.assert_array_equal(np.asarray(y_nan[5], np.float32), 0.0)  # never computed
    others = np.setdiff1d(np.arange(T), [2])
    assert_bitwise(y_nan[others], y[others], "tokens without NaN")
    y_ref = moe_reference(x_nan, ids, w, wgu, wd)
    np.testing.assert_array_equal(np.isnan(np.asarray(y_nan, np.float32)),
                                  np.isnan(np.asarray(y_ref, np.float32)))


def test_nan_in_x_of_fully_dropped_token_gives_zero():
    # cap = ceil(0.5 * 4 * 1 / 1) = 2: tokens 2, 3 dropped.
    x, _, w, wgu, wd = make_problem(15, 4, 1, 1, 8, 4, jnp.float32)
    ids = jnp.zeros((4, 1), jnp.int32)
    y = mok_jax.moe(x.at[3].set(jnp.nan), ids, w, wgu, wd, capacity_factor=0.5)
    np.testing.assert_array_equal(np.asarray(y[2:]), 0.0)
    assert np.all(np.isfinite(np.asarray(y[:2])))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_weight_of_invalid_or_dropped_pair_does_not_propagate(dtype):
    T, K, E = 6, 2, 3
    x, ids, w, wgu, wd = make_problem(16, T, K, E, 16, 8, dtype)
    ids = ids.at[1, 1].set(-1).at[4, 0].set(E + 2)
    w0 = w.at[1, 1].set(0.0).at[4, 0].set(0.0)
    y0 = mok_jax.moe(x, ids, w0, wgu, wd)
    y = mok_jax.moe(x, ids, w.at[1, 1].set(jnp.nan).at[4, 0].set(jnp.inf), wgu, wd)
    assert_bitwise(y, y0, "NaN/Inf weight on invalid pairs")

    # Dropped pairs alike: all on expert 0, cap = ceil(0.5 * 6 * 2 / 3) = 2.
    ids = jnp.zeros((T, K), jnp.int32)
    y0 = mok_jax.moe(x, ids, w.at[3:].set(0.0), wgu, wd, capacity_factor=0.5)
    y = mok_jax.moe(x, ids, w.at[3:].set(jnp.nan), wgu, wd, capacity_factor=0.5)
    assert_bitwise(y, y0, "NaN weight on dropped pairs")
    np.testing.assert_array_equal(np.asarray(y[1:], np.float32), 0.0)


def test_reference_gradients_ignore_what_no_pair_reads():
    # The oracle's gradients, like mok_jax.moe's, stay finite when NaN sits where no
    # kept pair reads it: the weights of an expert no pair reaches, the x row of a
    # token whose pairs are all invalid or all dropped. (The oracle runs every
    # expert on every token: 0 * NaN in those products must not reach dx or the
    # weight gradients.)
    T, K, E = 8, 2, 4
    x, ids, w, wgu, wd = make_problem(18, T, K, E, 16, 8, jnp.float32)
    ids = jnp.clip(ids, 0, E - 2).at[5].set(jnp.asarray([-1, E], jnp.int32))  # expert 3: none
    cases = {
        "NaN in an expert no pair reaches": (x, ids, wgu.at[3].set(jnp.nan), wd.at[3].set(jnp.inf), None),
        "NaN in the x row of a token with no valid pair": (x.at[5].set(jnp.nan), ids, wgu, wd, None),
        "NaN in the x row of a dropped token": (x.at[T - 1].set(jnp.nan), jnp.zeros_like(ids), wgu, wd, 0.5),
    }
    cot = jnp.cos(jnp.arange(16, dtype=jnp.float32))
    for name, (xc, idc, wguc, wdc, cap) in cases.items():
        grads = []
        for f in (mok_jax.moe, moe_reference):
            loss = lambda a, b, c, d, f=f: jnp.sum(f(a, idc, b, c, d, capacity_factor=cap) * cot)
            grads.append(jax.grad(loss, argnums=(0, 1, 2, 3))(xc, w, wguc, wdc))
        for what, got, want in zip(("dx", "d weights", "d w_gate_up", "d w_down"), *grads):
            got, want = np.asarray(got), np.asarray(want)
            assert np.all(np.isfinite(want)), f"{name}: reference {what} not finite"
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                       err_msg=f"{name}: {what}")


def test_inf_propagates_like_reference():
    x, ids, w, wgu, wd = make_problem(17, 8, 2, 4, 16, 8, jnp.float32)
    x = x.at[1, 0].set(jnp.inf).at[6].set(-jnp.inf)
    wgu = wgu.at[3, 2, 1].set(jnp.inf)
    y = np.asarray(mok_jax.moe(x, ids, w, wgu, wd))
    y_ref = np.asarray(moe_reference(x, ids, w, wgu, wd))
    np.testing.assert_array_equal(np.isnan(y), np.isnan(y_ref))
    np.testing.assert_array_equal(np.isinf(y), np.isinf(y_ref))
    fin = np.isfinite(y_ref)
    assert fin.any() and not fin.all()
    np.testing.assert_allclose(y[fin], y_ref[fin], rtol=1e-5, atol=1e-5 * np.abs(y_ref[fin]).max())


# --------------------------------------------------------------------------------------
# Determinism and transformations
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_bitwise_deterministic(dtype):
    args = make_problem(18, 33, 3, 6, 24, 12, dtype)
    y0, s0 = mok_jax.moe(*args, capacity_factor=0.75, return_stats=True)
    for _ in range(20):
        y, s = mok_jax.moe(*args, capacity_factor=0.75, return_stats=True)
        assert_bitwise(y, y0, "eager repeat")
        for a, b in zip(s, s0):
            assert_bitwise(a, b, "stats repeat")
    f = jax.jit(lambda *a: mok_jax.moe(*a, capacity_factor=0.75, return_stats=True))
    for _ in range(20):
        y, s = f(*args)
        assert_bitwise(y, y0, "jit vs eager")
        for a, b in zip(s, s0):
            assert_bitwise(a, b, "stats jit vs eager")
    nested = jax.jit(lambda *a: jax.jit(lambda *b: mok_jax.moe(*b, capacity_factor=0.75))(*a))
    assert_bitwise(nested(*args), y0, "nested jit")


@pytest.mark.parametrize("dtype", DTYPES)
def test_vmap_matches_per_slice(dtype):
    B, T, K, E, H, F = 3, 9, 2, 4, 16, 8
    xs, idss, ws = [], [], []
    _, _, _, wgu, wd = make_problem(19, T, K, E, H, F, dtype)
    for b in range(B):
        x, ids, w, _, _ = make_problem(100 + b, T, K, E, H, F, dtype)
        xs.append(x), idss.append(ids.at[b, 0].set(-1)), ws.append(w)
    xb, ib, wb = jnp.stack(xs), jnp.stack(idss), jnp.stack(ws)

    def f(x, ids, w):
        return mok_jax.moe(x, ids, w, wgu, wd, capacity_factor=1.0, return_stats=True)

    yb, sb = jax.vmap(f)(xb, ib, wb)
    yb_jit, _ = jax.jit(jax.vmap(f))(xb, ib, wb)
    assert yb.shape == (B, T, H)
    assert sb.tokens_per_expert.shape == (B, E) and sb.dropped.shape == (B,)
    for b in range(B):
        y, s = f(xb[b], ib[b], wb[b])
        assert_bitwise(yb[b], y, f"vmap slice {b}")
        assert_bitwise(yb_jit[b], y, f"jit(vmap) slice {b}")
        for got, want in zip(s, sb):
            assert_bitwise(want[b], got, f"vmap stats slice {b}")

    # Only x batched: routing shared by the batch.
    yx = jax.vmap(lambda x: mok_jax.moe(x, ib[0], wb[0], wgu, wd))(xb)
    for b in range(B):
        assert_bitwise(yx[b], mok_jax.moe(xb[b], ib[0], wb[0], wgu, wd), f"vmap x only {b}")


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_donated_inputs():
    # Donation is a hint: XLA may or may not reuse a buffer, the result must not change.
    args = make_problem(20, 8, 2, 4, 16, 8, jnp.float32)
    y = mok_jax.moe(*args)
    copies = [jnp.array(a, copy=True) for a in args]
    y_donated = jax.jit(mok_jax.moe, donate_argnums=(0, 2))(*copies)
    assert_bitwise(y_donated, y, "donated x and expert_weights")


def test_bound_axis_of_size_one_is_ep1():
    # axis_name bound to a one-device axis: expert parallelism of size 1 is plain moe.
    args = make_problem(21, 10, 2, 4, 16, 8, jnp.float32)
    mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
    P = jax.sharding.PartitionSpec
    f = jax.jit(jax.shard_map(
        lambda *a: mok_jax.moe(*a, axis_name="ep", capacity_factor=1.0, return_stats=True),
        mesh=mesh, in_specs=(P(),) * 5, out_specs=(P(), P())))
    y, stats = f(*args)
    y0, stats0 = mok_jax.moe(*args, capacity_factor=1.0, return_stats=True)
    assert_bitwise(y, y0, "EP=1 under shard_map")
    for a, b in zip(stats, stats0):
        assert_bitwise(a, b, "stats EP=1 under shard_map")


# --------------------------------------------------------------------------------------
# Numerics pinning: exact constructions that a tolerance could not see.
# Every value below is exactly representable and every f32 partial sum is exact unless
# a comment says it rounds, so there is exactly one right answer. silu(g) == g exactly
# in f32 for g >= 32 (exp(-g) < 2**-25, so 1 + exp(-g) rounds to 1).
# --------------------------------------------------------------------------------------


def _bf16(v):
    return np.float32(np.asarray(v, np.float32).astype(BF16))


def test_numerics_constructions_are_what_they_claim():
    # The arithmetic the pinning tests rely on, checked in NumPy f32 / bf16.
    f32 = np.float32
    one, big = f32(1), f32(2**24)
    assert (one + big) - big == 0 and (-big + big) + one == 1
    assert f32(33) / (1 + np.exp(-f32(33))) == 33 and f32(172) / (1 + np.exp(-f32(172))) == 172
    h0 = f32(33) * f32(5.25)                      # 173.25: not a bf16 value
    assert h0 == 173.25 and _bf16(h0) == 173
    assert _bf16(f32(129.375)) == 129 and _bf16(f32(129.375) * f32(2.5)) == 324
    assert _bf16(f32(129) * f32(2.5)) == 322
    assert _bf16(f32(128) + f32(1.25)) == 129
    assert _bf16(f32(1) + f32(2**-8) + f32(2**-8)) == f32(1 + 2**-7)
    assert _bf16(_bf16(1 + 2**-8) + f32(2**-8)) == 1  # bf16 running sum would lose it
    w0 = f32(1 + 3 * 2**-10)
    assert _bf16(w0 + f32(3 * 2**-10)) == f32(1 + 2**-7)
    assert _bf16(_bf16(w0) + f32(3 * 2**-10)) == 1


def _one_expert_per_unit_output(E, H, F, dtype):
    """Experts whose FFN maps x = e_0 (one-hot on h=0) to o = ones(H) exactly:
    g = 128 (silu = 128), u = 2**-7, h = 1 in slot 0; slot 1 has g = 0 so h = 0."""
    wgu = np.zeros((E, H, 2 * F), np.float32)
    wgu[:, 0, 0] = 128.0
    wgu[:, 0, F] = 2.0**-7
    wd = np.zeros((E, F, H), np.float32)
    wd[:, 0, :] = 1.0
    wd[:, 1:, :] = 3.0  # multiplied by h = 0
    return jnp.asarray(wgu, dtype), jnp.asarray(wd, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_sums_k_in_ascending_order(dtype):
    E, H, F = 3, 4, 2  # K = 3 picks per token (the ids below)
    wgu, wd = _one_expert_per_unit_output(E, H, F, dtype)
    x = jnp.asarray(np.eye(1, H).repeat(4, 0), dtype)
    big = 2.0**24
    ids = jnp.asarray([[0, 1, 2], [2, 0, 1], [0, 1, 2], [1, 2, 0]], jnp.int32)
    w = jnp.asarray([[1.0, big, -big],   # ascending: (1 + 2**24) rounds to 2**24 -> 0
                                         # descending k would give 1
                     [1.0, big, -big],   # ids permuted: summing in expert order gives 1
                     [-big, big, 1.0],   # ascending: 1; descending k would give 0
                     [-big, big, 1.0]],  # expert order (w=1 first) would give 0
                    jnp.float32)
    y = np.asarray(mok_jax.moe(x, ids, w, wgu, wd), np.float32)
    np.testing.assert_array_equal(
        y, np.array([[0.0] * H, [0.0] * H, [1.0] * H, [1.0] * H]),
        err_msg="combine is not an f32 sum over k in ascending k order")


def test_h_is_rounded_to_x_dtype_before_down_projection():
    # Slot 0: g = 33, u = 5.25 -> h = 173.25 in f32, rounded to bf16 173.
    # Slot 1: g = 172, u = 1 -> h = 172. w_down = [1, -1]: o = 1 (unrounded h: 1.25).
    x = jnp.ones((1, 1), jnp.bfloat16)
    wgu = jnp.asarray([[[33.0, 172.0, 5.25, 1.0]]], jnp.bfloat16)
    wd = jnp.asarray([[[1.0], [-1.0]]], jnp.bfloat16)
    args = (x, jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), jnp.float32), wgu, wd)
    y = float(np.asarray(mok_jax.moe(*args), np.float32)[0, 0])
    assert y == 1.0, f"h not rounded to bf16 before the down projection? y={y} (1.25 if not)"
    assert float(np.asarray(moe_reference(*args), np.float32)[0, 0]) == 1.0


def test_silu_takes_f32_gate_accumulator():
    # g = 128 + 1.375 = 129.375 (f32 accumulator; bf16 would round it to 129), u = 2.5:
    # h = 323.4375 -> bf16 324. Rounding g before silu would give 129 * 2.5 -> 322.
    x = jnp.ones((1, 2), jnp.bfloat16)
    wgu = jnp.asarray([[[128.0, 2.5], [1.375, 0.0]]], jnp.bfloat16)  # [E=1, H=2, 2F=2]
    wd = jnp.asarray([[[1.0, 0.5]]], jnp.bfloat16)                   # [E=1, F=1, H=2]
    args = (x, jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), jnp.float32), wgu, wd)
    y = np.asarray(mok_jax.moe(*args), np.float32)
    np.testing.assert_array_equal(y, [[324.0, 162.0]])
    np.testing.assert_array_equal(np.asarray(moe_reference(*args), np.float32), [[324.0, 162.0]])


@pytest.mark.parametrize("wdtype", [jnp.float32, jnp.bfloat16])
def test_expert_output_is_rounded_before_combine(wdtype):
    # Expert 0: h = [128, 1], w_down = [1, 1.25] -> o = 129.25 in f32 -> bf16 129.
    # Expert 1: h = [128, 1], w_down = [1, 0]    -> o = 128.
    # y = 1 * o0 - 1 * o1 = 1 (1.25 if o were combined unrounded).
    x = jnp.ones((1, 1), jnp.bfloat16)
    wgu = jnp.asarray([[[128.0, 128.0, 1.0, 2.0**-7]]] * 2, jnp.bfloat16)
    wd = jnp.asarray([[[1.0], [1.25]], [[1.0], [0.0]]], jnp.bfloat16)
    args = (x, jnp.asarray([[0, 1]], jnp.int32), jnp.asarray([[1.0, -1.0]], wdtype), wgu, wd)
    y = float(np.asarray(mok_jax.moe(*args), np.float32)[0, 0])
    assert y == 1.0, f"expert output not rounded to bf16 before combine? y={y} (1.25 if not)"
    assert float(np.asarray(moe_reference(*args), np.float32)[0, 0]) == 1.0


def test_combine_accumulates_in_f32_and_rounds_once():
    # o = 1 for all three experts; y = bf16(1 + 2**-8 + 2**-8) = 1 + 2**-7.
    # A bf16 running sum would round 1 + 2**-8 to 1 (tie to even) twice -> 1.
    wgu, wd = _one_expert_per_unit_output(3, 1, 1, jnp.bfloat16)
    args = (jnp.ones((1, 1), jnp.bfloat16), jnp.asarray([[0, 1, 2]], jnp.int32),
            jnp.asarray([[1.0, 2.0**-8, 2.0**-8]], jnp.float32), wgu, wd)
    y = np.asarray(mok_jax.moe(*args))
    assert y.dtype == BF16
    assert float(y[0, 0]) == 1 + 2.0**-7, float(y[0, 0])


def test_f32_weights_are_not_rounded_to_x_dtype():
    # w = [1 + 3*2**-10, 3*2**-10], o = 1: f32 sum 1.005859375 -> bf16 1.0078125.
    # Rounding w0 to bf16 first (-> 1.0) would give bf16(1.0029296875) = 1.0.
    wgu, wd = _one_expert_per_unit_output(2, 1, 1, jnp.bfloat16)
    args = (jnp.ones((1, 1), jnp.bfloat16), jnp.asarray([[0, 1]], jnp.int32),
            jnp.asarray([[1 + 3 * 2.0**-10, 3 * 2.0**-10]], jnp.float32), wgu, wd)
    y = float(np.asarray(mok_jax.moe(*args), np.float32)[0, 0])
    assert y == 1 + 2.0**-7, y


@pytest.mark.parametrize("backend", ["auto", "xla"])
@pytest.mark.parametrize("factor", [1e9, 1e19, 1e308])
def test_a_huge_capacity_factor_drops_nothing(backend, factor):
    """Any positive finite factor is allowed; one whose limit passes T*K rows (past
    int32 and int64 here) can drop nothing and gives the bits of no limit, while a
    limit of T*K - 1 still drops one pair (every pair goes to expert 0)."""
    T, K, E, H, F = 16, 2, 4, 8, 12
    x, ids, w, wgu, wd = make_problem(0, T, K, E, H, F, routing="one")

    def run(cf):
        def loss(x, w, wgu, wd):
            y, s = mok_jax.moe(x, ids, w, wgu, wd, capacity_factor=cf, backend=backend,
                               return_stats=True)
            return jnp.sum(y * y), (y, s)
        (_, (y, s)), g = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
            x, w, wgu, wd)
        return y, s, g

    y, s, g = run(factor)
    y0, s0, g0 = run(None)
    for name, a, b in zip(("y", "dx", "dw", "dwgu", "dwd"), (y, *g), (y0, *g0)):
        assert_bitwise(a, b, name)
    assert int(s.dropped) == 0 and int(s.tokens_per_expert[0]) == T * K
    y_ref, s_ref = moe_reference(x, ids, w, wgu, wd, capacity_factor=factor, return_stats=True)
    assert int(s_ref.dropped) == 0
    assert_close(y, y_ref, jnp.float32)
    # Just below T*K rows the limit bites.
    _, s1, _ = run((T * K - 1) * E / (T * K))
    assert int(s1.dropped) == 1


# backend="xla" runs op by op under disable_jit (4 s): with -m slow.
@pytest.mark.parametrize("backend", ["auto", pytest.param("xla", marks=pytest.mark.slow)])
def test_disable_jit_gives_the_jitted_bits(backend):
    """Under ``jax.disable_jit()`` (debugging) the layer still runs its kernels, forward
    and backward, with the bits of a jitted call."""
    T, K, E, H, F = 12, 2, 4, 8, 12
    x, ids, w, wgu, wd = make_problem(1, T, K, E, H, F)

    def value_and_grad(x, w, wgu, wd):
        def loss(x, w, wgu, wd):
            y = mok_jax.moe(x, ids, w, wgu, wd, capacity_factor=1.0, backend=backend)
            return jnp.sum(y * y), y
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, w, wgu, wd)

    (_, y0), g0 = jax.jit(value_and_grad)(x, w, wgu, wd)
    with jax.disable_jit():
        (_, y), g = value_and_grad(x, w, wgu, wd)
    for name, a, b in zip(("y", "dx", "dw", "dwgu", "dwd"), (y, *g), (y0, *g0)):
        assert_bitwise(a, b, name)
