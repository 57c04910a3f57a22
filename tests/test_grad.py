"""Gradients of mok_jax.moe: against jax.grad of the reference, against finite
differences, exact zeros for dropped/invalid pairs, determinism, transformations."""

import functools
from contextlib import nullcontext

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import mok_jax
from mok_jax.reference import moe_reference

from conftest import assert_bitwise, assert_close, make_problem, np_stats

NATIVE = int(mok_jax.Recipe.NATIVE)  # the primitives' recipe parameter

DIFF_ARGNUMS = (0, 2, 3, 4)  # x, expert_weights, w_gate_up, w_down
NAMES = ("dx", "d_expert_weights", "d_w_gate_up", "d_w_down")
DTYPES = [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16")]


def _loss(fn, x, ids, w, wgu, wd, ct, capacity_factor=None):
    y = fn(x, ids, w, wgu, wd, capacity_factor=capacity_factor)
    return jnp.sum(y.astype(jnp.float32) * ct)


def grads(fn, args, ct, capacity_factor=None):
    return jax.grad(functools.partial(_loss, fn, capacity_factor=capacity_factor),
                    argnums=DIFF_ARGNUMS)(*args, ct)


def _cotangent(seed, T, H):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((T, H), np.float32))


def _assert_grads_bitwise(got, want, what):
    for name, a, b in zip(NAMES, got, want):
        assert_bitwise(a, b, f"{what}: {name}")


# --------------------------------------------------------------------------------------
# Against the reference
# --------------------------------------------------------------------------------------

CASES = [  # T, K, E, H, F, capacity_factor, routing, invalid
    pytest.param(16, 2, 4, 32, 16, None, "topk", False, id="basic"),
    pytest.param(7, 2, 3, 24, 5, 0.5, "topk", True, id="odd-capacity-invalid"),
    pytest.param(1, 1, 1, 8, 4, None, "topk", False, id="T1"),
    pytest.param(13, 4, 4, 16, 8, None, "topk", False, id="K=E"),
    pytest.param(19, 2, 4, 16, 8, 1.0, "one", False, id="one-expert-capacity"),
    pytest.param(29, 3, 6, 12, 7, None, "topk", True, id="empty-experts-invalid"),
]


def _case(seed, T, K, E, H, F, dtype, routing, invalid):
    x, ids, w, wgu, wd = make_problem(seed, T, K, E, H, F, dtype, routing=routing, expert=1)
    if invalid:
        ids = ids.at[::3, K - 1].set(-1).at[1::5, 0].set(E)
    if E == 6:
        ids = jnp.where(ids == 2, 0, ids)  # expert 2 (and maybe others) left empty
    return x, ids, w, wgu, wd


# f32: the backward kernels reduce over tokens (weight gradients) and over F, H (dgrad)
# in their own fixed order, while the reference's autodiff lets XLA choose; at these
# sizes the contract's 1e-5 holds.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K,E,H,F,cf,routing,invalid", CASES)
def test_grads_match_reference(T, K, E, H, F, cf, routing, invalid, dtype):
    args = _case(T + 7 * E, T, K, E, H, F, dtype, routing, invalid)
    ct = _cotangent(T, T, H)
    got = grads(mok_jax.moe, args, ct, cf)
    want = grads(moe_reference, args, ct, cf)
    for name, g, r, a in zip(NAMES, got, want, (args[0], args[2], args[3], args[4])):
        assert g.shape == a.shape and g.dtype == a.dtype, (name, g.shape, g.dtype, a.dtype)
        assert_close(g, r, dtype, what=name)


@pytest.mark.parametrize("x_dtype,w_dtype", [(jnp.float32, jnp.float32),
                                             (jnp.bfloat16, jnp.float32),
                                             (jnp.bfloat16, jnp.bfloat16)])
def test_grad_dtypes(x_dtype, w_dtype):
    args = make_problem(1, 8, 2, 4, 16, 8, x_dtype, weights_dtype=w_dtype)
    g = grads(mok_jax.moe, args, _cotangent(1, 8, 16))
    assert [a.dtype for a in g] == [x_dtype, w_dtype, x_dtype, x_dtype]
    want = grads(moe_reference, args, _cotangent(1, 8, 16))
    for name, a, b in zip(NAMES, g, want):
        assert_close(a, b, x_dtype, what=f"{name} ({x_dtype.__name__} x, {w_dtype.__name__} w)")


# --------------------------------------------------------------------------------------
# Finite differences (f32): independent of the reference
# --------------------------------------------------------------------------------------


def test_directional_finite_differences():
    T, K, E, H, F = 6, 2, 3, 8, 4
    args = make_problem(2, T, K, E, H, F, jnp.float32)
    ct = _cotangent(2, T, H)
    ct64 = np.asarray(ct, np.float64)
    fwd = jax.jit(mok_jax.moe)

    def loss64(a):  # the loss reduction in float64, so that only y's rounding remains
        return float(np.sum(np.asarray(fwd(*a), np.float64) * ct64))

    g = grads(mok_jax.moe, args, ct)
    rng = np.random.default_rng(3)
    eps = 1e-3
    for name, i, gi in zip(NAMES, DIFF_ARGNUMS, g):
        p = np.asarray(args[i], np.float32)
        for _ in range(2):
            v = rng.standard_normal(p.shape).astype(np.float32) * np.float32(p.std())
            plus, minus = list(args), list(args)
            plus[i] = jnp.asarray(p + eps * v)
            minus[i] = jnp.asarray(p - eps * v)
            fd = (loss64(plus) - loss64(minus)) / (2 * eps)
            exact = float(np.sum(np.asarray(gi, np.float64) * v))
            scale = np.linalg.norm(np.asarray(gi, np.float64)) * np.linalg.norm(v)
            assert abs(fd - exact) <= 1e-2 * max(abs(exact), 1e-2 * scale), (name, fd, exact)


# --------------------------------------------------------------------------------------
# Dropped and invalid pairs
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropped_and_invalid_pairs_get_zero_gradient(dtype):
    T, K, E, H, F = 10, 2, 4, 16, 8
    x, ids, w, wgu, wd = make_problem(4, T, K, E, H, F, dtype)
    ids = ids.at[jnp.arange(T) % 2 == 0, 0].set(0)  # overflow expert 0
    ids = ids.at[1, 1].set(-3).at[6, 1].set(E).at[9].set(jnp.asarray([-1, 2**30]))
    ids = jnp.where(ids == 3, 1, ids)               # expert 3 gets no pair at all
    cf = 0.5                                        # cap = ceil(0.5 * 10 * 2 / 4) = 3
    cap = mok_jax.capacity(cf, T, K, E)
    _, dropped, invalid, keep = np_stats(ids, E, cap)
    assert dropped > 0 and invalid == 4
    ct = _cotangent(4, T, H)
    args = (x, ids, w, wgu, wd)
    dx, dw, dwgu, dwd = grads(mok_jax.moe, args, ct, cf)

    dw = np.asarray(dw, np.float32)
    np.testing.assert_array_equal(dw[~keep], 0.0)                 # exactly 0
    assert np.all(dw[keep] != 0.0)
    nothing_kept = ~keep.any(axis=1)
    assert nothing_kept.any()
    np.testing.assert_array_equal(np.asarray(dx, np.float32)[nothing_kept], 0.0)
    np.testing.assert_array_equal(np.asarray(dwgu, np.float32)[3], 0.0)  # empty expert
    np.testing.assert_array_equal(np.asarray(dwd, np.float32)[3], 0.0)

    # Everything else as if those pairs were valid with weight 0 and no capacity.
    ids0 = jnp.where(jnp.asarray(keep), ids, 0)
    w0 = jnp.where(jnp.asarray(keep), w, 0).astype(w.dtype)
    want = grads(mok_jax.moe, (x, ids0, w0, wgu, wd), ct)
    for name, g, r in zip(NAMES, (dx, dw, dwgu, dwd), want):
        if name == "d_expert_weights":
            r = np.where(keep, np.asarray(r, np.float32), 0.0)   # w0's grads at dropped pairs
        assert_close(g, r, dtype, f32_tol=1e-6, what=name)


def test_everything_dropped_but_first_pair():
    # cap = ceil(1e-6 * ...) = 1: only pair (0, 0) on expert 0 survives.
    T, K, E, H, F = 5, 1, 2, 8, 4
    x, _, w, wgu, wd = make_problem(5, T, K, E, H, F, jnp.float32)
    ids = jnp.zeros((T, K), jnp.int32)
    dx, dw, dwgu, dwd = grads(mok_jax.moe, (x, ids, w, wgu, wd), _cotangent(5, T, H), 1e-6)
    np.testing.assert_array_equal(np.asarray(dx)[1:], 0.0)
    np.testing.assert_array_equal(np.asarray(dw)[1:], 0.0)
    np.testing.assert_array_equal(np.asarray(dwgu)[1], 0.0)
    np.testing.assert_array_equal(np.asarray(dwd)[1], 0.0)
    assert np.all(np.asarray(dx)[0] != 0.0) and float(np.asarray(dw)[0, 0]) != 0.0


def test_nan_weight_on_invalid_pair_leaves_grads_finite():
    T, K, E, H, F = 6, 2, 3, 8, 4
    x, ids, w, wgu, wd = make_problem(6, T, K, E, H, F, jnp.float32)
    ids = ids.at[2, 1].set(-1)
    ct = _cotangent(6, T, H)
    g0 = grads(mok_jax.moe, (x, ids, w.at[2, 1].set(0.0), wgu, wd), ct)
    g = grads(mok_jax.moe, (x, ids, w.at[2, 1].set(jnp.nan), wgu, wd), ct)
    _assert_grads_bitwise(g, g0, "NaN weight on an invalid pair")


# --------------------------------------------------------------------------------------
# Determinism and transformations
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_bitwise_deterministic(dtype):
    T, H = 33, 24
    args = make_problem(7, T, 3, 6, H, 12, dtype)
    ct = _cotangent(7, T, H)
    g0 = grads(mok_jax.moe, args, ct, 0.75)
    g_eager = grads(mok_jax.moe, args, ct, 0.75)
    _assert_grads_bitwise(g_eager, g0, "eager repeat")
    f = jax.jit(functools.partial(grads, mok_jax.moe, capacity_factor=0.75))
    for _ in range(20):
        _assert_grads_bitwise(f(args, ct), g0, "jit(grad) vs eager grad")


@pytest.mark.parametrize("dtype", DTYPES)
def test_vjp_forward_equals_forward(dtype):
    # The forward under differentiation (which also saves residuals) gives the same bits.
    args = make_problem(8, 17, 2, 4, 16, 8, dtype)
    y = mok_jax.moe(*args, capacity_factor=1.0)
    y_vjp, _ = jax.vjp(lambda *a: mok_jax.moe(*a, capacity_factor=1.0), *args)
    assert_bitwise(y_vjp, y, "vjp primal")
    (y_stats, stats), _ = jax.vjp(
        lambda x: mok_jax.moe(x, *args[1:], capacity_factor=1.0, return_stats=True), args[0])
    assert_bitwise(y_stats, y, "vjp primal with stats")
    _, stats_ref = mok_jax.moe(*args, capacity_factor=1.0, return_stats=True)
    for a, b in zip(stats, stats_ref):
        assert_bitwise(a, b, "stats under vjp")


def test_grad_with_return_stats():
    args = make_problem(9, 12, 2, 4, 16, 8, jnp.float32)
    ct = _cotangent(9, 12, 16)

    def loss_stats(x, ids, w, wgu, wd):
        y, stats = mok_jax.moe(x, ids, w, wgu, wd, return_stats=True)
        return jnp.sum(y * ct) + 0.0 * stats.dropped

    g = jax.grad(loss_stats, argnums=DIFF_ARGNUMS)(*args)
    _assert_grads_bitwise(g, grads(mok_jax.moe, args, ct), "grad with return_stats")


@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_under_jit_and_remat(dtype):
    T, H = 11, 16
    args = make_problem(10, T, 2, 4, H, 8, dtype)
    ct = _cotangent(10, T, H)
    loss = functools.partial(_loss, mok_jax.moe)
    g = jax.grad(loss, argnums=DIFF_ARGNUMS)(*args, ct)
    g_jit = jax.jit(jax.grad(loss, argnums=DIFF_ARGNUMS))(*args, ct)
    g_remat = jax.grad(jax.checkpoint(loss), argnums=DIFF_ARGNUMS)(*args, ct)
    g_remat_jit = jax.jit(jax.grad(jax.checkpoint(loss), argnums=DIFF_ARGNUMS))(*args, ct)
    _assert_grads_bitwise(g_jit, g, "jit")
    _assert_grads_bitwise(g_remat, g, "checkpoint")
    _assert_grads_bitwise(g_remat_jit, g, "jit(checkpoint)")


@pytest.mark.parametrize("dtype", DTYPES)
def test_vmap_of_grad_matches_per_slice(dtype):
    B, T, K, E, H, F = 3, 7, 2, 4, 16, 8
    _, _, _, wgu, wd = make_problem(11, T, K, E, H, F, dtype)
    xs, idss, ws = zip(*[make_problem(200 + b, T, K, E, H, F, dtype)[:3] for b in range(B)])
    xb, ib, wb = jnp.stack(xs), jnp.stack(idss).at[1, 2, 0].set(-1), jnp.stack(ws)
    ctb = jnp.stack([_cotangent(300 + b, T, H) for b in range(B)])

    def per_example(x, ids, w, ct):
        return grads(mok_jax.moe, (x, ids, w, wgu, wd), ct, 1.0)

    gb = jax.vmap(per_example)(xb, ib, wb, ctb)
    gb_jit = jax.jit(jax.vmap(per_example))(xb, ib, wb, ctb)
    for b in range(B):
        g = per_example(xb[b], ib[b], wb[b], ctb[b])
        _assert_grads_bitwise([a[b] for a in gb], g, f"vmap(grad) slice {b}")
        _assert_grads_bitwise([a[b] for a in gb_jit], g, f"jit(vmap(grad)) slice {b}")


@pytest.mark.parametrize("mesh_shape,spec", [((2,), "b"), ((2, 2), ("dp", "fsdp"))],
                         ids=["one-axis", "two-axes"])
def test_vmap_over_a_batch_sharded_over_mesh_axes(mesh_shape, spec):
    """vmap over a batch that explicit-axis sharding splits over devices: each device
    maps over its own examples (a scan cannot run over a sharded axis), with the
    per-example bits, statistics and gradients, and the batch stays sharded."""
    B, T, K, E, H, F = 4, 7, 2, 4, 16, 8
    _, _, _, wgu, wd = make_problem(13, T, K, E, H, F, jnp.bfloat16)
    xs, idss, ws = zip(*[make_problem(400 + b, T, K, E, H, F, jnp.bfloat16)[:3]
                         for b in range(B)])
    xb, ib, wb = jnp.stack(xs), jnp.stack(idss).at[3, 1, 0].set(-1), jnp.stack(ws)
    ctb = jnp.stack([_cotangent(500 + b, T, H) for b in range(B)])
    names = ("b",) if len(mesh_shape) == 1 else spec
    mesh = jax.make_mesh(mesh_shape, names,
                         axis_types=(jax.sharding.AxisType.Explicit,) * len(mesh_shape))

    def forward(x, ids, w):
        return mok_jax.moe(x, ids, w, wgu, wd, capacity_factor=1.0, return_stats=True)

    def per_example(x, ids, w, ct):
        return grads(mok_jax.moe, (x, ids, w, wgu, wd), ct, 1.0)

    with jax.set_mesh(mesh):
        sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(spec))
        args = [jax.device_put(a, sharded) for a in (xb, ib, wb, ctb)]
        yb, sb = jax.jit(jax.vmap(forward))(*args[:3])
        gb = jax.jit(jax.vmap(per_example))(*args)
        assert jax.typeof(yb).sharding.spec[0] == spec
    yb, sb, gb = jax.tree.map(np.asarray, (yb, sb, gb))
    for b in range(B):
        y, s = forward(xb[b], ib[b], wb[b])
        assert_bitwise(yb[b], y, f"vmap slice {b}")
        for got, want in zip(s, sb):
            assert_bitwise(want[b], got, f"vmap stats slice {b}")
        g = per_example(xb[b], ib[b], wb[b], ctb[b])
        _assert_grads_bitwise([a[b] for a in gb], g, f"vmap(grad) slice {b}")


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_vmap_of_a_call_traced_on_a_mesh(axis_type):
    """Under jax.set_mesh, a call traced before vmap sees it (jax.jit, jax.checkpoint)
    is the partitioned one; vmap of it runs every example as its own call, with the
    per-example bits, statistics and gradients."""
    B, T, K, E, H, F = 2, 6, 2, 4, 8, 8
    _, _, _, wgu, wd = make_problem(17, T, K, E, H, F, jnp.float32)
    xs, idss, ws = zip(*[make_problem(600 + b, T, K, E, H, F, jnp.float32)[:3]
                         for b in range(B)])
    xb, ib, wb = jnp.stack(xs), jnp.stack(idss).at[1, 0, 1].set(E), jnp.stack(ws)
    ctb = jnp.stack([_cotangent(700 + b, T, H) for b in range(B)])
    mesh = jax.make_mesh((2,), ("d",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))

    def forward(x, ids, w):
        return mok_jax.moe(x, ids, w, wgu, wd, capacity_factor=1.0, return_stats=True)

    def per_example(x, ids, w, ct):
        return grads(mok_jax.moe, (x, ids, w, wgu, wd), ct, 1.0)

    with jax.set_mesh(mesh):
        yb, sb = jax.vmap(jax.jit(forward))(xb, ib, wb)
        yc, _ = jax.jit(jax.vmap(jax.checkpoint(forward)))(xb, ib, wb)
        gb = jax.vmap(jax.jit(per_example))(xb, ib, wb, ctb)
    for b in range(B):
        y, s = forward(xb[b], ib[b], wb[b])
        assert_bitwise(yb[b], y, f"vmap(jit) slice {b}")
        assert_bitwise(yc[b], y, f"jit(vmap(checkpoint)) slice {b}")
        for got, want in zip(s, sb):
            assert_bitwise(want[b], got, f"vmap(jit) stats slice {b}")
        g = per_example(xb[b], ib[b], wb[b], ctb[b])
        _assert_grads_bitwise([a[b] for a in gb], g, f"vmap(jit(grad)) slice {b}")


# --------------------------------------------------------------------------------------
# The forward's x_rows residual (the backward reads it instead of gathering x again)
# --------------------------------------------------------------------------------------


def _x_rows_case(dtype):
    """A problem with capacity drops, invalid ids and an empty expert; its capacity."""
    T, K, E, H, F = 13, 3, 5, 16, 8
    x, ids, w, wgu, wd = make_problem(12, T, K, E, H, F, dtype)
    ids = ids.at[::4, 0].set(1).at[2, 2].set(-1).at[7, 1].set(E).at[11, 0].set(2**30)
    ids = jnp.where(ids == 4, 0, ids)  # expert 4 gets no pair
    cap = mok_jax.capacity(0.5, T, K, E)
    return (x, ids, w, wgu, wd), cap


def _np_x_rows(x, ids, E, cap):
    """x's row of every kept pair in the routing plan's order (expert, then token, then
    k): the rows the backward gathered itself before the forward saved them."""
    _, _, _, keep = np_stats(ids, E, cap)
    ids, x = np.asarray(ids), np.asarray(x)
    order = [(t, k) for e in range(E) for t in range(ids.shape[0]) for k in range(ids.shape[1])
             if keep[t, k] and ids[t, k] == e]
    return x[[t for t, _ in order]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_saves_x_rows_in_plan_order(dtype):
    from mok_jax._src import primitives as prim
    args, cap = _x_rows_case(dtype)
    x, ids, _, wgu, _ = args
    T, K, E, H = *ids.shape, wgu.shape[0], x.shape[1]
    want = _np_x_rows(x, ids, E, cap)
    _, dropped, invalid, _ = np_stats(ids, E, cap)
    assert dropped > 0 and invalid == 3 and 0 < want.shape[0] < T * K

    y, gate_up, x_rows, _, n_dropped, n_invalid = prim.moe_fwd_p.bind(
        *args, recipe=NATIVE, capacity=cap, save_gate_up=True)
    assert (int(n_dropped), int(n_invalid)) == (dropped, invalid)
    assert x_rows.shape == (T * K, H) and x_rows.dtype == x.dtype
    assert_bitwise(x_rows[:want.shape[0]], want, "saved x rows")
    if jax.devices()[0].platform == "cpu":  # rows past the kept ones: zeros on CPU only
        assert_bitwise(x_rows[want.shape[0]:], np.zeros((T * K - want.shape[0], H), want.dtype),
                       "x rows past the kept ones")

    # Not differentiated: no residuals, the same y.
    y0, gate_up0, x_rows0, *_ = prim.moe_fwd_p.bind(*args, recipe=NATIVE, capacity=cap, save_gate_up=False)
    assert gate_up0.shape == (0, wgu.shape[2]) and gate_up0.dtype == x.dtype
    assert x_rows0.shape == (0, H) and x_rows0.dtype == x.dtype
    assert_bitwise(y0, y, "y without residuals")
    del gate_up


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_reads_the_forwards_x_rows(dtype):
    from mok_jax._src import primitives as prim
    args, cap = _x_rows_case(dtype)
    x, ids, w, wgu, wd = args
    T, H = x.shape
    ct = _cotangent(12, T, H)
    got = grads(mok_jax.moe, args, ct, 0.5)

    # The gradients are those of the backward given x's rows gathered in plan order
    # (what it gathered itself before), the same bits.
    _, gate_up, _, *_ = prim.moe_fwd_p.bind(*args, recipe=NATIVE, capacity=cap, save_gate_up=True)
    rows = _np_x_rows(x, ids, wgu.shape[0], cap)
    padded = np.zeros((ids.size, H), rows.dtype)
    padded[:rows.shape[0]] = rows
    dy = ct.astype(x.dtype)
    want = prim.moe_bwd_p.bind(*args, gate_up, jnp.asarray(padded), dy, recipe=NATIVE, capacity=cap)
    _assert_grads_bitwise(got, want, "grad vs backward of numpy-gathered x rows")

    # It reads them: twice the rows give twice d_w_gate_up (exact), the rest unchanged.
    twice = prim.moe_bwd_p.bind(*args, gate_up, jnp.asarray(padded) * 2, dy, recipe=NATIVE, capacity=cap)
    for name, a, b in zip(NAMES, twice, want):
        if name == "d_w_gate_up":
            assert np.any(np.asarray(b, np.float32) != 0.0)
            assert_bitwise(a, b * 2, "d_w_gate_up of doubled x rows")
        else:
            assert_bitwise(a, b, f"{name} of doubled x rows")


@pytest.mark.parametrize("backend", ["auto", "xla"])  # one-call backward, EP pieces' backward
@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.slow
def test_w_down_gradient_takes_the_weighted_h_rounded_once(w_dtype, backend):
    """dW_down = sum_r round_x(w h_r)^T dy_r (docs/architecture.md's rounding points):
    the combine weight is applied to h and rounded once, and dy is used as it is.

    Each token goes to its own expert (one row an expert: no sum), and dy_t is c times
    a unit vector, so column j_t of dW_down[t] is round_x(round_x(w_t h_t) c) exactly
    (a product of two bf16 values is exact in f32). h_t itself is read from a run with
    w = 1 and c = 1, so the check needs no SwiGLU of its own. The former rounding
    point, h round_x(w dy), gives other bits here."""
    T, H, F = 4, 16, 8
    x, _, _, wgu, wd = make_problem(21, T, 1, T, H, F, jnp.bfloat16)
    ids = jnp.arange(T, dtype=jnp.int32)[:, None]
    rows, cols = np.arange(T), np.array([3, 0, 15, 7])

    def d_w_down(w, c):
        dy = np.zeros((T, H), np.float32)
        dy[rows, cols] = c
        _, vjp = jax.vjp(lambda wd: mok_jax.moe(x, ids, w, wgu, wd, backend=backend), wd)
        return np.asarray(vjp(jnp.asarray(dy, jnp.bfloat16))[0], np.float32)[rows, :, cols]

    def bf16(v):
        return np.asarray(v, np.float32).astype(jnp.bfloat16).astype(np.float32)

    h = d_w_down(jnp.ones((T, 1), w_dtype), 1.0)  # [T, F]: h_t (round_x(1 h) = h)
    assert np.all(np.isfinite(h)) and np.count_nonzero(h) > T * F // 2
    w, c = jnp.full((T, 1), 0.3, w_dtype), bf16(1.3)
    w32 = np.asarray(w.astype(jnp.float32))[0, 0]
    got = d_w_down(w, c)
    want = bf16(bf16(w32 * h) * c)
    np.testing.assert_array_equal(got, want)
    former = bf16(h * bf16(w32 * c))
    assert np.any(former != want), "the case must tell the two rounding points apart"


SECOND_ORDER = "mok_jax.moe has no second-order derivatives"


def _second_order_forms(loss, x):
    """The ways to ask for a second derivative of `loss` w.r.t. x, each traced."""
    return {
        "grad of grad": lambda: jax.make_jaxpr(
            jax.grad(lambda x: jnp.sum(jax.grad(loss)(x))))(x),
        "hessian": lambda: jax.make_jaxpr(jax.hessian(loss))(x),
        "jvp of the gradient": lambda: jax.make_jaxpr(
            lambda x: jax.jvp(jax.grad(loss), (x,), (x,)))(x),
    }


@pytest.mark.parametrize("where", ["one device", "auto mesh", "explicit mesh", "shard_map"])
def test_second_order_raises_one_error_on_every_path(where):
    """moe is first order only. Every second-order form raises the one
    NotImplementedError on every execution path: one device (one FFI call), plain
    jit on sharded arrays (the partitioned path, on Auto and Explicit axes) and
    the EP layer inside shard_map; JAX's own message would name whichever
    primitive it meets first (the forward's FFI call, custom_partitioning)."""
    T, K, E, H, F = 8, 2, 4, 8, 8
    x, ids, w, wgu, wd = make_problem(31, T, K, E, H, F, jnp.float32)
    devices = jax.devices("cpu")[:2]
    mesh = None
    if where == "one device":
        layer = lambda x: mok_jax.moe(x, ids, w, wgu, wd)
    else:
        axis_type = (jax.sharding.AxisType.Explicit if where == "explicit mesh"
                     else jax.sharding.AxisType.Auto)
        mesh = jax.make_mesh((2,), ("d",), devices=devices, axis_types=(axis_type,))
        x, ids, w, wgu, wd = (jax.device_put(a, NamedSharding(mesh, P("d")))
                              for a in (x, ids, w, wgu, wd))
        if where == "shard_map":
            ep = jax.shard_map(
                lambda x, ids, w, wgu, wd: mok_jax.moe(x, ids, w, wgu, wd, axis_name="d"),
                mesh=mesh, in_specs=(P("d"),) * 5, out_specs=P("d"))
            layer = lambda x: ep(x, ids, w, wgu, wd)
        else:
            layer = lambda x: mok_jax.moe(x, ids, w, wgu, wd)

    def loss(x):
        return jnp.sum(layer(x) ** 2)

    with jax.set_mesh(mesh) if mesh is not None else nullcontext():
        assert jnp.all(jnp.isfinite(jax.grad(loss)(x))), "first order must work"
        for what, trace in _second_order_forms(loss, x).items():
            with pytest.raises(NotImplementedError, match=SECOND_ORDER):
                trace()
                pytest.fail(f"{what} did not raise")
