"""The fp8 recipe (docs/contract.md, "The fp8 recipe") on CPU.

The oracle is a float64 emulation written here in numpy, independent of the
library's code: quantization by ml_dtypes (``np.clip(v / s, -448, 448)`` in f32,
then ``astype(float8_e4m3fn)``), block scales ``amax / 448`` in f32, and every
GEMM as a float64 sum of the e4m3 values times the f32 product of their two
block scales. The kernels accumulate in f32 instead, so their results differ
from the emulation by f32 accumulation error, carried through the roundings
(bf16, e4m3) that follow it; each comparison below says what it allows and why.
"""

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import mok_jax
from mok_jax._src import primitives
from mok_jax.reference import moe_reference

from conftest import assert_bitwise, cpu_threads, make_problem, np_stats, rel_fro

F8 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
BLOCK = 128
# H and F not multiples of 128: every blocking has a partial last block.
T, K, E, H, F = 48, 2, 8, 192, 160
CPUS = jax.devices("cpu")


@pytest.fixture(autouse=True)
def _on_the_cpu():
    """These tests check the CPU kernels against the emulation's f32-accumulation
    bounds; on a machine whose default device is a GPU they still run on the CPU
    (tests/test_fp8_gpu.py holds the GPU's comparisons, with wgmma's bounds)."""
    with jax.default_device(CPUS[0]):
        yield


# --- the float64 emulation -------------------------------------------------------------

def f32(a):
    return np.asarray(a, np.float32)


def bf16(a):
    """Rounds to bfloat16 (RNE), as f32."""
    return np.asarray(a, np.float32).astype(BF16).astype(np.float32)


def scale_of(amax):
    amax = np.asarray(amax, np.float32)
    with np.errstate(invalid="ignore"):
        return np.where(amax == 0, np.float32(1), amax / np.float32(448)).astype(np.float32)


def q8(v, s):
    """e4m3 value of v / s (f32 division), as float64."""
    with np.errstate(all="ignore"):
        t = (f32(v) / f32(s)).astype(np.float32)
    return np.clip(t, -448, 448).astype(F8).astype(np.float64)


def amax_of(v, axis):
    with np.errstate(invalid="ignore"):
        return np.max(np.abs(f32(v)), axis=axis)


def bounds(n, parts=1):
    """Block boundaries: 128 long within each of `parts` equal parts of n."""
    out, part = [0], n // parts
    for p in range(parts):
        b0, b1 = p * part, (n if p == parts - 1 else (p + 1) * part)
        out += list(range(b0 + BLOCK, b1, BLOCK)) + [b1]
    return out


def quant_rows(v, kb):
    """Row blocks along the last dim: q [n, K] float64, s [n, nkb] f32."""
    v = f32(v)
    q = np.zeros(v.shape)
    s = np.zeros((v.shape[0], len(kb) - 1), np.float32)
    for b in range(len(kb) - 1):
        blk = v[:, kb[b]:kb[b + 1]]
        s[:, b] = scale_of(amax_of(blk, 1))
        q[:, kb[b]:kb[b + 1]] = q8(blk, s[:, b:b + 1])
    return q, s


def quant_cols(v, rb):
    """Column blocks along rows (blocks of rows `rb`): q [n, C], s [nrb, C]."""
    v = f32(v)
    q = np.zeros(v.shape)
    s = np.zeros((len(rb) - 1, v.shape[1]), np.float32)
    for a in range(len(rb) - 1):
        blk = v[rb[a]:rb[a + 1]]
        s[a] = scale_of(amax_of(blk, 0))
        q[rb[a]:rb[a + 1]] = q8(blk, s[a][None, :])
    return q, s


def quant_matrix(w, rb, cb):
    """128x128 blocks: q [R, C], s [nrb, ncb]."""
    w = f32(w)
    q = np.zeros(w.shape)
    s = np.zeros((len(rb) - 1, len(cb) - 1), np.float32)
    for a in range(len(rb) - 1):
        for b in range(len(cb) - 1):
            blk = w[rb[a]:rb[a + 1], cb[b]:cb[b + 1]]
            s[a, b] = scale_of(amax_of(blk, None))
            q[rb[a]:rb[a + 1], cb[b]:cb[b + 1]] = q8(blk, s[a, b])
    return q, s


def col_of(cb):
    out = np.zeros(cb[-1], int)
    for b in range(len(cb) - 1):
        out[cb[b]:cb[b + 1]] = b
    return out


def gemm_rows(aq, sa, bq, sb, kb, cb):
    """sum over K-blocks of f32(sa[i, kb] * sb[kb, block of j]) * P_kb in float64."""
    out = np.zeros((aq.shape[0], bq.shape[1]))
    cols = col_of(cb)
    for b in range(len(kb) - 1):
        p = aq[:, kb[b]:kb[b + 1]] @ bq[kb[b]:kb[b + 1]]
        out += p * (sa[:, b:b + 1] * sb[b][cols][None, :]).astype(np.float64)
    return out


def gemm_wgrad(a, b):
    """a^T @ b over an expert's rows, both in column blocks of 128 rows."""
    rb = bounds(a.shape[0])
    aq, sa = quant_cols(a, rb)
    bq, sb = quant_cols(b, rb)
    out = np.zeros((a.shape[1], b.shape[1]))
    for r in range(len(rb) - 1):
        p = aq[rb[r]:rb[r + 1]].T @ bq[rb[r]:rb[r + 1]]
        out += p * (sa[r][:, None] * sb[r][None, :]).astype(np.float64)
    return out


def sigmoid(g):
    return (np.float32(1) / (np.float32(1) + np.exp(-g))).astype(np.float32)


def expert_forward(xr, wgu, wd):
    """One expert on rows xr [n, H]: (out rows bf16, gate_up f32, h f32, sh)."""
    hid, ffn = xr.shape[1], wd.shape[0]
    bh, bf, bgu = bounds(hid), bounds(ffn), bounds(2 * ffn, 2)
    wq, ws = quant_matrix(wgu, bh, bgu)
    dq, ds = quant_matrix(wd, bf, bh)
    xq, sx = quant_rows(xr, bh)
    gu = f32(gemm_rows(xq, sx, wq, ws, bh, bgu))
    g, u = gu[:, :ffn], gu[:, ffn:]
    h = (g * sigmoid(g) * u).astype(np.float32)
    hq, sh = quant_rows(h, bf)
    out = bf16(gemm_rows(hq, sh, dq, ds, bf, bh))
    return out, gu, h, sh


def expert_backward(xr, dyr, wr, gu_saved, wgu, wd):
    """One expert's backward on its rows: (dx rows, d w rows, dWgu, dWd)."""
    hid, ffn = xr.shape[1], wd.shape[0]
    bh, bf, bgu = bounds(hid), bounds(ffn), bounds(2 * ffn, 2)
    wq, ws = quant_matrix(wgu, bh, bgu)
    dq, ds = quant_matrix(wd, bf, bh)
    dyq, sdy = quant_rows(dyr, bh)
    dh = f32(gemm_rows(dyq, sdy, dq.T, ds.T, bh, bf))
    g, u = gu_saved[:, :ffn], gu_saved[:, ffn:]
    wv = f32(wr)[:, None]
    sg = sigmoid(g)
    silu = (g * sg).astype(np.float32)
    hv = bf16(silu * u)
    hr = bf16(wv * hv)
    dw = np.sum(dh.astype(np.float64) * hv, axis=1)
    dhv = (wv * dh).astype(np.float32)
    dg = bf16((dhv * u) * (sg * (np.float32(1) + g * (np.float32(1) - sg))))
    du = bf16(dhv * silu)
    dgu = np.concatenate([dg, du], axis=1)
    dguq, sdgu = quant_rows(dgu, bgu)
    dx = bf16(gemm_rows(dguq, sdgu, wq.T, ws.T, bgu, bh))
    return dx, dw, bf16(gemm_wgrad(xr, dgu)), bf16(gemm_wgrad(hr, dyr))


def emulate(x, ids, w, wgu, wd, dy=None, capacity=None):
    """y (and, with dy, the four gradients) of the fp8 recipe in float64 GEMMs."""
    x, w, wgu, wd = f32(x), f32(w), f32(wgu), f32(wd)
    ids = np.asarray(ids)
    tokens, top_k = ids.shape
    experts, hid, ffn = wgu.shape[0], wgu.shape[1], wd.shape[1]
    keep = np_stats(ids, experts, capacity)[3]
    o = np.zeros((tokens, top_k, hid), np.float32)
    dxr = np.zeros((tokens, top_k, hid), np.float32)
    dw = np.zeros((tokens, top_k))
    dwgu = np.zeros(wgu.shape, np.float32)
    dwd = np.zeros(wd.shape, np.float32)
    for e in range(experts):
        pairs = [(t, k) for t in range(tokens) for k in range(top_k)
                 if keep[t, k] and ids[t, k] == e]
        if not pairs:
            continue
        ts, ks = np.array(pairs).T
        out, gu, _, _ = expert_forward(x[ts], wgu[e], wd[e])
        o[ts, ks] = out
        if dy is not None:
            rx, rw, gwgu, gwd = expert_backward(x[ts], f32(dy)[ts], w[ts, ks], bf16(gu),
                                                wgu[e], wd[e])
            dxr[ts, ks], dw[ts, ks], dwgu[e], dwd[e] = rx, rw, gwgu, gwd
    acc = np.zeros((tokens, hid), np.float32)
    dacc = np.zeros((tokens, hid), np.float32)
    for k in range(top_k):  # ascending k, f32, one rounding at the end
        m = keep[:, k][:, None]
        acc = np.where(m, acc + w[:, k:k + 1] * o[:, k], acc).astype(np.float32)
        dacc = np.where(m, dacc + dxr[:, k], dacc).astype(np.float32)
    if dy is None:
        return bf16(acc)
    return bf16(acc), (bf16(dacc), dw.astype(np.float32), dwgu, dwd)


# --- problems and runners -----------------------------------------------------------

def problem(seed=0, tokens=T, top_k=K, experts=E, hid=H, ffn=F, **kw):
    return make_problem(seed, tokens, top_k, experts, hid, ffn, jnp.bfloat16, **kw)


def cotangent(seed, shape):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), jnp.bfloat16)


def run(x, ids, w, wgu, wd, dy, **kw):
    """y and the four gradients of the fp8 recipe (jitted)."""
    def f(x, w, wgu, wd):
        return mok_jax.moe(x, ids, w, wgu, wd, recipe="fp8", **kw)
    y, vjp = jax.vjp(f, x, w, wgu, wd)
    return y, vjp(dy)


_run = jax.jit(run, static_argnames=("capacity_factor", "backend"))

GRADS = ("dx", "d_expert_weights", "d_w_gate_up", "d_w_down")


def ulp_bf16(v):
    """One bf16 ulp at |v| (subnormals ignored: the values here are O(1))."""
    v = np.maximum(np.abs(np.asarray(v, np.float64)), 2.0 ** -126)
    return 2.0 ** (np.floor(np.log2(v)) - 7)


def near_e4m3_midpoint(v, s, window=2.0 ** -18):
    """Where v / s lies so close to a rounding midpoint of e4m3 that f32
    accumulation error (well below `window` relative) could round it the other
    way."""
    t = (f32(v) / f32(s)).astype(np.float64)
    lo = np.clip(t - window * np.abs(t) - 2.0 ** -20, -448, 448)
    hi = np.clip(t + window * np.abs(t) + 2.0 ** -20, -448, 448)
    return lo.astype(np.float32).astype(F8).astype(np.float32) != \
        hi.astype(np.float32).astype(F8).astype(np.float32)


# --- conversion -----------------------------------------------------------------------

def _quantize_and_check(x):
    """Runs mok_jax.quantize_rows_fp8 on x [N, K] and checks scales and codes
    bitwise against numpy (f32 division) and ml_dtypes."""
    q, s = mok_jax.quantize_rows_fp8(jnp.asarray(x))
    q, s = np.asarray(q), np.asarray(s)
    n, cols = x.shape
    assert q.dtype == np.dtype(F8) and q.shape == (n, cols)
    assert s.dtype == np.float32 and s.shape == (n, math.ceil(cols / BLOCK))
    kb = bounds(cols)
    xs = f32(x)
    want_s = np.stack([scale_of(amax_of(xs[:, kb[b]:kb[b + 1]], 1))
                       for b in range(len(kb) - 1)], axis=1)
    np.testing.assert_array_equal(s.view(np.uint32), want_s.view(np.uint32))
    with np.errstate(all="ignore"):
        t = (xs / np.repeat(want_s, BLOCK, axis=1)[:, :cols]).astype(np.float32)
    want_q = np.clip(t, -448, 448).astype(F8)
    nan = np.isnan(t)
    bad = (q.view(np.uint8) != want_q.view(np.uint8)) & ~nan
    assert not bad.any(), (f"{bad.sum()} codes differ; first input {t[bad][:5]}: got "
                           f"{q.view(np.uint8)[bad][:5]}, want {want_q.view(np.uint8)[bad][:5]}")
    assert np.all(np.isnan(q.astype(np.float32))[nan])
    return q, s


def _with_scale_one(values):
    """Rows of 128 whose first element is 448: scale 1, so q is e4m3(v) itself."""
    values = np.asarray(values, np.float32)
    pad = -values.size % (BLOCK - 1)
    values = np.concatenate([values, np.zeros(pad, np.float32)]).reshape(-1, BLOCK - 1)
    return np.concatenate([np.full((values.shape[0], 1), 448, np.float32), values], axis=1)


def _conversion_sweep(step):
    """f32 values to convert: every `step`-th f32 bit pattern (with an odd offset, so
    mantissas vary) of magnitude <= 448; every e4m3 rounding midpoint and the f32
    values within 3 ulps of it (both signs: the ties and the nearest non-ties,
    subnormal e4m3 included); every 64th f32 in [2^-11, 2^-5) (the e4m3
    subnormals and the rounding to zero) and a sample of f32 subnormals."""
    pat = (np.arange(0, 2 ** 32, step, dtype=np.uint64) + 37).astype(np.uint32)
    v = pat.view(np.float32)
    v = v[np.abs(v) <= 448]
    codes = np.arange(0x7f, dtype=np.uint8).view(F8).astype(np.float32)  # 0 .. 448
    mid = ((codes[:-1].astype(np.float64) + codes[1:]) / 2).astype(np.float32)
    near = [mid]
    for d in (1, 2, 3):
        near += [(mid.view(np.int32) + d).view(np.float32),
                 (mid.view(np.int32) - d).view(np.float32)]
    near = np.concatenate(near)
    small = np.arange(0x3a000000, 0x3d000000, 64, dtype=np.uint32).view(np.float32)
    tiny = np.arange(1, 0x00800000, 4099, dtype=np.uint32).view(np.float32)
    return np.concatenate([v, near, -near, small, -small, tiny, -tiny,
                           np.float32([0.0, -0.0, 448.0, -448.0, 2.0 ** -10, 2.0 ** -9])])


def _check_conversion(values):
    x = _with_scale_one(values)
    q, s = _quantize_and_check(x)
    assert np.all(s == 1)
    want = np.clip(x, -448, 448).astype(F8)  # scale 1: the plain conversion
    np.testing.assert_array_equal(q.view(np.uint8), want.view(np.uint8))


def test_conversion_matches_ml_dtypes():
    """Blocks of scale exactly 1 (a 448 in each): q must be e4m3(v) itself, bit
    for bit, for every value of the sweep (every 2^12-th f32 here)."""
    _check_conversion(_conversion_sweep(2 ** 12))


@pytest.mark.slow
def test_conversion_matches_ml_dtypes_on_a_dense_sweep_of_f32():
    _check_conversion(_conversion_sweep(2 ** 8))


def test_quantizer_scales_nan_inf_zeros_and_partial_blocks():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((6, 300)) * np.exp(rng.uniform(-20, 20, (6, 1)))).astype(np.float32)
    x[1, :128] = 0                    # a block of zeros: scale 1, zeros
    x[2, 5] = np.nan                  # its block: NaN scale, NaN values
    x[3, 130] = np.inf                # its block: Inf scale
    x[4, 256:] = 1e30                 # large values in the partial last block (44)
    x[5, 7] = -1e-30                  # one small value: q = -448
    x[5, :7] = 0
    x[5, 8:128] = 0
    q, s = _quantize_and_check(x)
    assert s[1, 0] == 1 and not np.any(q[1, :128].astype(np.float32))
    assert np.isnan(s[2, 0]) and np.all(np.isnan(q[2, :128].astype(np.float32)))
    assert np.all(np.isfinite(s[2, 1:])) and np.all(np.isfinite(q[2, 128:].astype(np.float32)))
    assert np.isinf(s[3, 1]) and np.all(np.isfinite(s[3, [0, 2]]))
    assert q[5, 7].astype(np.float32) == -448 and s.shape == (6, 3)


def test_quantizer_takes_every_bf16_value():
    v = np.arange(2 ** 16, dtype=np.uint16).view(BF16)
    v = v[np.isfinite(v.astype(np.float32))]
    x = np.asarray(np.resize(v, (v.size // 256 + 1) * 256).reshape(-1, 256))
    _quantize_and_check(x)


def test_quantizer_refuses_other_ranks_and_dtypes():
    with pytest.raises(ValueError, match="x must be \\[N, K\\]"):
        mok_jax.quantize_rows_fp8(jnp.zeros((2, 3, 4)))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        mok_jax.quantize_rows_fp8(jnp.zeros((2, 3), jnp.float16))


# --- forward and backward against the emulation ---------------------------------------

def test_expert_rows_match_the_emulation():
    """The expert FFN on grouped rows (mok_expert_ffn_fwd) against the emulation.

    The kernels' gate_up differs from the float64 one by f32 accumulation error
    (~1e-6 relative), so its bf16 rounding may land one ulp away; the same holds
    for each output row, whose e4m3 inputs (x, the weights) are bitwise those of
    the emulation. h, however, is quantized after the f32 accumulation: where
    h / s lies next to an e4m3 rounding midpoint the two may round it apart,
    which moves that row's outputs by more than one ulp; those rows are found
    in the emulation and only checked loosely."""
    x, _, _, wgu, wd = problem(1)
    sizes = np.array([20, 0, 33, 1, 130, 7, 0, 9], np.int32)  # 130: two row blocks
    rows = int(sizes.sum())
    xr = jnp.asarray(np.random.default_rng(2).standard_normal((rows, H)), jnp.bfloat16)
    out, gate_up = primitives.expert_ffn_fwd_p.bind(
        xr, jnp.asarray(sizes), wgu, wd, recipe=int(mok_jax.Recipe.FP8), save_gate_up=True)
    out, gate_up = f32(out), f32(gate_up)
    begin = np.concatenate([[0], np.cumsum(sizes)])
    flagged = np.zeros(rows, bool)
    want = np.zeros((rows, H), np.float32)
    want_gu = np.zeros((rows, 2 * F), np.float32)
    for e in range(E):
        r0, r1 = begin[e], begin[e + 1]
        if r1 == r0:
            continue
        o, gu, h, sh = expert_forward(f32(xr)[r0:r1], f32(wgu)[e], f32(wd)[e])
        want[r0:r1], want_gu[r0:r1] = o, bf16(gu)
        s_full = np.repeat(sh, BLOCK, axis=1)[:, :F]
        flagged[r0:r1] = near_e4m3_midpoint(h, s_full).any(axis=1)
    assert np.all(np.abs(gate_up - want_gu) <= ulp_bf16(want_gu))
    assert np.mean(gate_up == want_gu) > 0.99
    ok = ~flagged
    assert ok.sum() > 0.8 * rows, f"{flagged.sum()} of {rows} rows near a midpoint"
    # one bf16 ulp, plus the f32 accumulation error of an output that cancels to
    # nearly nothing (<= 192 terms, each rounding at most 2^-24 of a partial sum
    # of the row's magnitude: 2^-14 of the row's largest output leaves margin)
    row_max = np.max(np.abs(want), axis=1, keepdims=True)
    diff = np.abs(out - want)[ok]
    assert np.all(diff <= (ulp_bf16(want) + 2.0 ** -14 * row_max)[ok]), f"max {diff.max()}"
    assert np.mean(out[ok] == want[ok]) > 0.98
    assert rel_fro(out, want) < 2.0 ** -8  # the flagged rows too, as a whole


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_forward_and_gradients_match_the_emulation(capacity_factor):
    """y within one bf16 ulp per term of the combine; every gradient within 2^-8
    (one bf16 ulp, relative) in Frobenius norm.

    Why 2^-8: the gradients' inputs to each fp8 GEMM (dy, x, the weights) are
    bitwise the emulation's, and the bf16 intermediates (d_gate_up, w*h) differ
    from it only where an f32 accumulation error tips a bf16 rounding (one ulp,
    2^-8 relative, on a small fraction of elements); the e4m3 quantization of
    those can move a few elements by one e4m3 step. The norm of such
    differences stays well below one bf16 ulp of the whole, while fp8 against
    the native recipe differs by far more (checked below, so this bound can fail)."""
    x, ids, w, wgu, wd = problem(4)
    ids = ids.at[3, 1].set(-1).at[7, 0].set(E + 2)  # invalid ids: nothing, no gradient
    dy = cotangent(5, (T, H))
    cap = mok_jax.capacity(capacity_factor, T, K, E)
    y, grads = _run(x, ids, w, wgu, wd, dy, capacity_factor=capacity_factor)
    y_emu, grads_emu = emulate(x, ids, w, wgu, wd, dy, capacity=cap)
    y = f32(y)
    # each kept pair's row may sit one bf16 ulp away (see the test above), weighted
    # by its combine weight, plus y's own rounding
    o_bound = np.zeros((T, H))
    for k in range(K):
        o_bound += np.abs(f32(w)[:, k:k + 1]) * ulp_bf16(np.abs(y_emu) + 1)
    bound = o_bound + ulp_bf16(y_emu)
    assert np.mean(np.abs(y - y_emu) <= bound) > 0.995
    assert rel_fro(y, y_emu) < 2.0 ** -8
    native = jax.vjp(lambda *a: mok_jax.moe(a[0], ids, *a[1:], capacity_factor=capacity_factor),
                     x, w, wgu, wd)
    native_grads = native[1](dy)
    for name, got, want, nat in zip(GRADS, grads, grads_emu, native_grads):
        err = rel_fro(f32(got), want)
        assert err < 2.0 ** -8, f"{name}: {err:.3g} from the emulation"
        assert rel_fro(f32(nat), want) > 8 * 2.0 ** -8, f"{name}: fp8 is not the native recipe"
    dw = f32(grads[1])
    assert dw[3, 1] == 0 and dw[7, 0] == 0
    if capacity_factor is not None:
        keep = np_stats(ids, E, cap)[3]
        assert not keep.all() and np.all(dw[~keep] == 0)


def test_fp8_is_within_the_recipes_error_of_native():
    """e4m3 keeps 4 significant bits: each quantized value is within 2^-4
    relative of its input (half a step), about 2^-4 / sqrt(3) ~ 3.6% rms.
    A GEMM of two quantized operands over many terms carries roughly that rms
    relative error (sqrt(2) * 2.5% per product, averaged), and the FFN chains
    two of them, so y and the gradients land at a few percent of the native
    recipe: bounded here by 12%, and above 0.5% (it quantizes at all)."""
    x, ids, w, wgu, wd = problem(6)
    dy = cotangent(7, (T, H))
    y8, g8 = _run(x, ids, w, wgu, wd, dy)
    yn, vjp = jax.vjp(lambda *a: mok_jax.moe(a[0], ids, *a[1:]), x, w, wgu, wd)
    gn = vjp(dy)
    for name, a, b in zip(("y",) + GRADS, (y8,) + tuple(g8), (yn,) + tuple(gn)):
        err = rel_fro(f32(a), f32(b))
        assert 0.005 < err < 0.12, f"{name}: fp8 vs native {err:.3g}"


def test_the_jnp_reference_matches_the_kernels():
    x, ids, w, wgu, wd = problem(8)
    y = f32(mok_jax.moe(x, ids, w, wgu, wd, recipe="fp8"))
    y_ref = f32(jax.jit(functools.partial(moe_reference, recipe="fp8"))(x, ids, w, wgu, wd))
    assert rel_fro(y, y_ref) < 2.0 ** -8
    assert np.mean(y == y_ref) > 0.97
    y_native = f32(moe_reference(x, ids, w, wgu, wd))
    assert rel_fro(y_ref, y_native) > 0.005


def straight_through_grads(x, ids, w, wgu, wd, dy, capacity=None):
    """The gradients of the fp8 forward with every e4m3 rounding taken as the
    identity (a straight-through estimator), in float64 GEMMs: the derivative
    of the unquantized FFN at the quantized forward's values. The cotangent of
    each expert's output row, ``w * dy``, is rounded to bfloat16 as the row is."""
    x, w, wgu, wd, dy = f32(x), f32(w), f32(wgu), f32(wd), f32(dy)
    ids = np.asarray(ids)
    tokens, top_k = ids.shape
    experts, hid, ffn = wgu.shape[0], wgu.shape[1], wd.shape[1]
    keep = np_stats(ids, experts, capacity)[3]
    bh, bf, bgu = bounds(hid), bounds(ffn), bounds(2 * ffn, 2)
    dx = np.zeros((tokens, hid))
    dw = np.zeros((tokens, top_k))
    dwgu, dwd = np.zeros(wgu.shape), np.zeros(wd.shape)
    for e in range(experts):
        ts, ks = np.nonzero(keep & (ids == e))
        if ts.size == 0:
            continue
        wq, ws = quant_matrix(wgu[e], bh, bgu)
        dq, ds = quant_matrix(wd[e], bf, bh)
        w_deq = wq * np.repeat(ws, BLOCK, 0)[:hid][:, col_of(bgu)]
        d_deq = dq * np.repeat(ds, BLOCK, 0)[:ffn][:, col_of(bh)]
        out, gu, h, sh = expert_forward(x[ts], wgu[e], wd[e])
        xq, sx = quant_rows(x[ts], bh)
        x_deq = xq * np.repeat(sx, BLOCK, 1)[:, :hid]
        hq, _ = quant_rows(h, bf)
        h_deq = hq * np.repeat(sh, BLOCK, 1)[:, :ffn]
        ct = bf16(w[ts, ks][:, None] * dy[ts]).astype(np.float64)
        g, u = gu[:, :ffn].astype(np.float64), gu[:, ffn:].astype(np.float64)
        sg = 1 / (1 + np.exp(-g))
        dh = ct @ d_deq.T
        dgu = np.concatenate([dh * u * sg * (1 + g * (1 - sg)), dh * g * sg], axis=1)
        np.add.at(dx, ts, dgu @ w_deq.T)
        dw[ts, ks] = np.sum(dy[ts] * out, axis=1)
        dwgu[e], dwd[e] = x_deq.T @ dgu, h_deq.T @ ct
    return dx, dw, dwgu, dwd


@pytest.mark.parametrize("dy_scale", [1.0, 2.0 ** 12, 2.0 ** -12])
def test_the_references_gradient_goes_straight_through_the_roundings(dy_scale):
    """jax.grad of moe_reference(recipe="fp8") takes each e4m3 rounding as the
    identity: a gradient within bf16 rounding of the float64 straight-through
    one for any scale of dy (the gradient is linear in dy), and not one whose
    cotangents are themselves rounded to e4m3 without a scale (which zeroes
    those under 2^-10 and makes those over 448 NaN)."""
    x, ids, w, wgu, wd = problem(27, tokens=24)
    dy = cotangent(28, (24, H)) * dy_scale
    _, vjp = jax.vjp(lambda *a: moe_reference(a[0], ids, *a[1:], recipe="fp8"),
                     x, w, wgu, wd)
    got = vjp(dy)
    want = straight_through_grads(x, ids, w, wgu, wd, dy)
    for name, g, ww in zip(GRADS, got, want):
        assert np.all(np.isfinite(f32(g))), name
        assert rel_fro(f32(g), ww) < 2.0 ** -7, f"{name}: {rel_fro(f32(g), ww):.3g}"


@pytest.mark.parametrize("case", ["no valid pair", "every pair dropped"])
def test_the_references_gradient_ignores_x_rows_no_pair_reads(case):
    """A NaN in the x row of a token whose pairs are all invalid or all dropped
    reaches none of moe_reference(recipe="fp8")'s gradients (its dx row is 0),
    as in the native recipe: the oracle runs every expert on every token, and
    0 * NaN in the rows an expert does not take must not reach dx or the
    weight gradients."""
    tokens = 24
    x, ids, w, wgu, wd = problem(29, tokens=tokens)
    capacity_factor, cap, row = None, None, 5
    if case == "no valid pair":
        ids = ids.at[row].set(jnp.asarray([-1, E], jnp.int32))
    else:  # every token on experts 0 and 1: the last tokens' pairs are dropped
        ids = jnp.zeros_like(ids).at[:, 1].set(1)
        capacity_factor, cap, row = 1.0, tokens * K // E, tokens - 1  # cap = 6 rows
    x = x.at[row].set(jnp.nan)
    dy = cotangent(30, (tokens, H))
    _, vjp = jax.vjp(lambda *a: moe_reference(a[0], ids, *a[1:], recipe="fp8",
                                              capacity_factor=capacity_factor),
                     x, w, wgu, wd)
    got = vjp(dy)
    want = straight_through_grads(x, ids, w, wgu, wd, dy, capacity=cap)
    for name, g, ww in zip(GRADS, got, want):
        assert np.all(np.isfinite(f32(g))), name
        assert rel_fro(f32(g), ww) < 2.0 ** -7, f"{name}: {rel_fro(f32(g), ww):.3g}"
    assert not np.any(f32(got[0])[row])


def test_no_tokens_give_an_empty_y_in_the_op_and_the_reference():
    x, ids, w, wgu, wd = (a[:0] if i < 3 else a for i, a in enumerate(problem(8)))
    for fn in (mok_jax.moe, moe_reference):
        y = fn(x, ids, w, wgu, wd, recipe="fp8")
        assert y.shape == (0, H) and y.dtype == x.dtype, fn


# --- determinism and expert-parallel invariance ------------------------------------------

def test_twenty_runs_give_the_same_bits():
    x, ids, w, wgu, wd = problem(9)
    dy = cotangent(10, (T, H))
    first = jax.tree.leaves(_run(x, ids, w, wgu, wd, dy, capacity_factor=1.0))
    for _ in range(19):
        again = jax.tree.leaves(_run(x, ids, w, wgu, wd, dy, capacity_factor=1.0))
        for a, b in zip(first, again):
            assert_bitwise(a, b)


def test_thread_count_does_not_change_bits():
    x, ids, w, wgu, wd = problem(11)
    dy = cotangent(12, (T, H))
    results = []
    for threads in (1, 3):
        with cpu_threads(threads):  # the step runs to its end inside
            results.append(jax.block_until_ready(jax.tree.leaves(_run(x, ids, w, wgu, wd, dy))))
    for a, b in zip(*results):
        assert_bitwise(a, b)


def _ep_run(ep, x, ids, w, wgu, wd, dy, capacity_factor):
    mesh = jax.make_mesh((ep,), ("ep",), devices=CPUS[:ep])

    def local(x, ids, w, wgu, wd):
        return mok_jax.moe(x, ids, w, wgu, wd, axis_name="ep", recipe="fp8",
                           capacity_factor=capacity_factor, backend="xla")

    layer = jax.shard_map(local, mesh=mesh, in_specs=(P("ep"),) * 5, out_specs=P("ep"))
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))  # noqa: E731
    x, ids, w, wgu, wd, dy = map(put, (x, ids, w, wgu, wd, dy))

    @jax.jit
    def step(x, w, wgu, wd, dy):
        y, vjp = jax.vjp(lambda x, w, a, b: layer(x, ids, w, a, b), x, w, wgu, wd)
        return y, vjp(dy)

    return step(x, w, wgu, wd, dy)


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
@pytest.mark.parametrize("ep", [pytest.param(2, marks=pytest.mark.slow), 4,
                                pytest.param(8, marks=pytest.mark.slow)])
def test_expert_parallel_sizes_give_the_bits_of_one_device(ep, capacity_factor):
    x, ids, w, wgu, wd = problem(13)
    ids = ids.at[2, 0].set(-3)
    dy = cotangent(14, (T, H))
    one = jax.tree.leaves(_run(x, ids, w, wgu, wd, dy, capacity_factor=capacity_factor))
    got = jax.tree.leaves(_ep_run(ep, x, ids, w, wgu, wd, dy, capacity_factor))
    for name, a, b in zip(("y",) + GRADS, got, one):
        assert_bitwise(np.asarray(a), np.asarray(b), name)


def test_the_xla_backend_on_one_device_gives_the_same_bits():
    """backend="xla" runs the EP pieces (mok_expert_ffn_*) with a trivial exchange;
    "auto" the one-call launchers: the same bits."""
    x, ids, w, wgu, wd = problem(15)
    dy = cotangent(16, (T, H))
    a = jax.tree.leaves(_run(x, ids, w, wgu, wd, dy, capacity_factor=0.75))
    b = jax.tree.leaves(_run(x, ids, w, wgu, wd, dy, capacity_factor=0.75, backend="xla"))
    for u, v in zip(a, b):
        assert_bitwise(u, v)


# --- edge cases ---------------------------------------------------------------------

def test_one_expert_taking_every_row():
    """300 rows in one expert: the weight gradients' column blocks along rows are
    128, 128 and 44 rows from the expert's first row."""
    tokens = 150
    x, ids, w, wgu, wd = problem(17, tokens=tokens, experts=4, routing="one", expert=2)
    dy = cotangent(18, (tokens, H))
    y, grads = _run(x, ids, w, wgu, wd, dy)
    y_emu, grads_emu = emulate(x, ids, w, wgu, wd, dy)
    assert rel_fro(f32(y), y_emu) < 2.0 ** -8
    for name, got, want in zip(GRADS, grads, grads_emu):
        assert rel_fro(f32(got), want) < 2.0 ** -8, name
    for e in (0, 1, 3):
        assert not np.any(f32(grads[2])[e]) and not np.any(f32(grads[3])[e])


def test_a_block_of_zeros_gives_finite_results():
    x, ids, w, wgu, wd = problem(19)
    x = x.at[:, :128].set(0).at[5].set(0)       # zero blocks, and a whole zero row
    wgu = wgu.at[:, :128, :128].set(0)          # a zero weight block
    dy = cotangent(20, (T, H)).at[9].set(0)
    y, grads = _run(x, ids, w, wgu, wd, dy)
    for a in (y,) + tuple(grads):
        assert np.all(np.isfinite(f32(a)))
    assert not np.any(f32(y)[5])
    q, s = mok_jax.quantize_rows_fp8(x)
    assert np.all(np.asarray(s)[:, 0] == 1)
    y_emu = emulate(x, ids, w, wgu, wd)
    assert rel_fro(f32(y), y_emu) < 2.0 ** -8


def test_a_block_whose_scale_underflows_stays_finite():
    """A finite block whose amax / 448 underflows f32 (amax below about 6.5e-43:
    only f32 blocks, such as h or an f32 input of the quantizer) must quantize to
    finite values, and a token with such an h must get a finite y. Here x[0] holds
    one 2^-72 and the experts are identities, so h[0] = silu(2^-72) * 2^-72, about
    2^-145, and y[0], about 2^-145, rounds to 0 in bfloat16."""
    x = np.zeros((2, BLOCK), np.float32)
    x[0, 0], x[1, 1] = 1e-44, 3e-43
    q, s = mok_jax.quantize_rows_fp8(jnp.asarray(x))
    assert np.all(np.isfinite(np.asarray(q).astype(np.float32)))
    assert np.all(np.asarray(s) > 0)

    tokens, hid, ffn = 2, BLOCK, BLOCK
    xs = np.zeros((tokens, hid), np.float32)
    xs[0, 0], xs[1] = 2.0 ** -72, 1.0
    eye = np.eye(hid, dtype=np.float32)
    wgu = np.concatenate([eye, eye], axis=1)[None]
    wd = eye[None]
    ids = jnp.zeros((tokens, 1), jnp.int32)
    w = jnp.ones((tokens, 1), jnp.float32)
    g = np.float64(2.0 ** -72)
    h0 = g / (1 + np.exp(-g)) * g                     # float64: about 2^-145
    want0 = bf16(np.where(np.arange(hid) == 0, h0, 0.0))   # the identity FFN's row
    y = f32(mok_jax.moe(jnp.asarray(xs, jnp.bfloat16), ids, w, jnp.asarray(wgu, jnp.bfloat16),
                        jnp.asarray(wd, jnp.bfloat16), recipe="fp8"))
    np.testing.assert_array_equal(y[0], want0)
    assert np.all(np.isfinite(y[1]))


def test_subnormal_results_of_the_combine_are_kept():
    """Combine weights of 2^-125 make much of y and dx f32 subnormals (below
    2^-126). The kernels compute with IEEE subnormals, the combine included,
    while XLA's CPU threads flush them: y and dx must be the emulation's (numpy,
    IEEE), not zeros where the weighted rows or their sums fall below 2^-126."""
    x, ids, w, wgu, wd = problem(31)
    w = jnp.full(w.shape, 2.0 ** -125, jnp.float32)
    dy = cotangent(32, (T, H))
    y, grads = _run(x, ids, w, wgu, wd, dy)
    y_emu, grads_emu = emulate(x, ids, w, wgu, wd, dy)
    sub = (y_emu != 0) & (np.abs(y_emu) < 2.0 ** -126)
    assert sub.sum() > 0.2 * y_emu.size  # the case this checks
    assert np.count_nonzero(f32(y)[sub]) > 0.99 * sub.sum()
    assert rel_fro(f32(y), y_emu) < 2.0 ** -8
    assert rel_fro(f32(grads[0]), grads_emu[0]) < 2.0 ** -8


def test_a_nan_in_one_token_stays_in_that_token():
    x, ids, w, wgu, wd = problem(21)
    x = x.at[11, 150].set(jnp.nan)
    dy = cotangent(22, (T, H))
    y, grads = _run(x, ids, w, wgu, wd, dy)
    finite = np.all(np.isfinite(f32(y)), axis=1)
    assert not finite[11] and finite[np.arange(T) != 11].all()
    dx = f32(grads[0])
    # dx of a token reads only its own rows' d gate_up (no weight-gradient blocks)
    assert np.all(np.isfinite(dx[np.arange(T) != 11]))
    dw = f32(grads[1])
    assert np.all(np.isfinite(dw[np.arange(T) != 11]))


def test_fp8_needs_bfloat16():
    x, ids, w, wgu, wd = make_problem(23, 8, 2, 4, 16, 8, jnp.float32)
    with pytest.raises(ValueError, match=r"mok_jax.moe: recipe 'fp8' needs bfloat16 x; got "
                                         r"float32"):
        mok_jax.moe(x, ids, w, wgu, wd, recipe="fp8")
    xb = x.astype(jnp.bfloat16)
    with pytest.raises(ValueError, match=r"recipe 'fp8' needs bfloat16 w_gate_up; got float32"):
        mok_jax.moe(xb, ids, w, wgu, wd.astype(jnp.bfloat16), recipe="fp8")
    with pytest.raises(ValueError, match=r"recipe 'fp8' needs bfloat16 w_down; got float32"):
        mok_jax.moe(xb, ids, w, wgu.astype(jnp.bfloat16), wd, recipe=mok_jax.Recipe.FP8)
    with pytest.raises(ValueError, match=r"moe_reference: recipe 'fp8' needs bfloat16 x"):
        moe_reference(x, ids, w, wgu, wd, recipe="fp8")
    with pytest.raises(ValueError, match=r"MoE: recipe 'fp8' needs bfloat16 dtype"):
        mok_jax.nn.MoE(hidden_size=16, ffn_size=8, num_experts=4, top_k=2, recipe="fp8",
                       dtype=jnp.float32, rngs=__import__("flax").nnx.Rngs(0))
    # dtype=None infers float32 from param_dtype's default: refused at construction,
    # not at every call, and bfloat16 parameters are fine.
    with pytest.raises(ValueError, match=r"MoE: recipe 'fp8' needs bfloat16 dtype.*"
                                         r"param_dtype=float32"):
        mok_jax.nn.MoE(hidden_size=16, ffn_size=8, num_experts=4, top_k=2, recipe="fp8",
                       rngs=__import__("flax").nnx.Rngs(0))
    mok_jax.nn.MoE(hidden_size=16, ffn_size=8, num_experts=4, top_k=2, recipe="fp8",
                   param_dtype=jnp.bfloat16, rngs=__import__("flax").nnx.Rngs(0))
    # bf16 combine weights are fine
    xb, ids, w, wgu, wd = make_problem(24, 8, 2, 4, 16, 8, jnp.bfloat16,
                                       weights_dtype=jnp.bfloat16)
    assert mok_jax.moe(xb, ids, w, wgu, wd, recipe="fp8").dtype == jnp.bfloat16


def test_the_handlers_refuse_fp8_with_f32():
    """Past the Python checks, the launchers say why."""
    x, ids, w, wgu, wd = make_problem(25, 8, 2, 4, 16, 8, jnp.float32)
    with pytest.raises(Exception, match=r"recipe fp8 needs bfloat16 x"):
        jax.block_until_ready(primitives.moe_fwd_p.bind(
            x, ids, w, wgu, wd, recipe=int(mok_jax.Recipe.FP8), capacity=-1,
            save_gate_up=False))
    sizes = jnp.asarray(np.array([4, 4, 4, 4], np.int32))
    with pytest.raises(Exception, match=r"recipe fp8 needs bfloat16 x"):
        jax.block_until_ready(primitives.expert_ffn_fwd_p.bind(
            jnp.zeros((16, 16), jnp.float32), sizes, wgu, wd,
            recipe=int(mok_jax.Recipe.FP8), save_gate_up=False))


def test_nn_moe_runs_the_fp8_recipe():
    from flax import nnx
    layer = mok_jax.nn.MoE(hidden_size=H, ffn_size=F, num_experts=4, top_k=2, recipe="fp8",
                           dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert layer.recipe is mok_jax.Recipe.FP8
    xs = jnp.asarray(np.random.default_rng(26).standard_normal((16, H)), jnp.bfloat16)
    y, _ = layer(xs)
    # The layer's y is the fp8 recipe's on its routing, and not the native recipe's.
    ids, w = layer.route(xs)[:2]
    wgu, wd = layer.w_gate_up[...], layer.w_down[...]
    assert_bitwise(y, mok_jax.moe(xs, ids, w, wgu, wd, recipe="fp8"), "nn.MoE fp8")
    assert rel_fro(y, mok_jax.moe(xs, ids, w, wgu, wd, recipe="native")) > 5e-3
