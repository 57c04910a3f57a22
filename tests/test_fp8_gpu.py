"""GPU checks of the fp8 recipe's CUDA kernels (sm_90a; run by scripts/gpu_ci.sh).

The CPU handlers are the oracle: both quantize the same bf16 values with the same
rule (so the e4m3 operands and their scales are the same bits), and differ only
in how the GEMMs accumulate (wgmma's own order and internal precision between the
scale promotions every 128 of K, against an ascending f32 sum on CPU).

Tolerance: the f32 accumulators then differ by a few 1e-5 relative (wgmma's fp8
accumulation keeps fewer bits than f32 within each 128-deep block; CUTLASS
promotes to f32 after every block). Where such a difference moves h (or d
gate_up) across an e4m3 rounding boundary, that one element changes by one e4m3
step (at most 2^-3 of its block's scale range, usually far less); these flips are
rare (about the ratio of the f32 difference to the e4m3 step) and spread, so the
outputs' relative Frobenius difference stays well below 1e-2, and the bf16
roundings add ~4e-3. The bound is the contract's bf16 bound, 2e-2, for y and
every gradient; the quantization error itself (a few percent against exact
math) is common to both sides and cancels.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax

from conftest import assert_bitwise

pytestmark = pytest.mark.gpu

TOL = 2e-2


def _gpu():
    return jax.devices("gpu")[0]


def _cpu():
    return jax.devices("cpu")[0]


def _problem(T, K, E, H, F, seed=0, routing="topk"):
    ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(ks[0], (T, H), jnp.float32).astype(jnp.bfloat16)
    logits = jax.random.normal(ks[1], (T, E))
    if routing == "skew":  # most tokens prefer expert 0; the upper half stays empty
        logits = logits.at[:, 0].add(4.0).at[:, E // 2:].add(-30.0)
    w, ids = jax.lax.top_k(jax.nn.softmax(logits), K)
    ids = ids.astype(jnp.int32)
    if routing == "one":  # every pair to expert 1 (the others empty)
        ids = jnp.full_like(ids, 1)
    wgu = (jax.random.normal(ks[2], (E, H, 2 * F)) * H**-0.5).astype(jnp.bfloat16)
    wd = (jax.random.normal(ks[3], (E, F, H)) * F**-0.5).astype(jnp.bfloat16)
    return x, ids, w, wgu, wd


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _run(args, cot, capacity_factor, device):
    """y and the four gradients (x, weights, w_gate_up, w_down) on `device`."""
    x, ids, w, wgu, wd = jax.device_put(args, device)
    cot = jax.device_put(cot, device)
    kw = dict(capacity_factor=capacity_factor, recipe="fp8")

    def loss(x, w, wgu, wd):
        y = mok_jax.moe(x, ids, w, wgu, wd, **kw)
        return jnp.sum(y.astype(jnp.float32) * cot)

    y = jax.jit(lambda *a: mok_jax.moe(*a, **kw))(x, ids, w, wgu, wd)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, w, wgu, wd)
    return jax.block_until_ready((y, *grads))


NAMES = ("y", "dx", "dw", "dw_gate_up", "dw_down")

# (T, K, E, H, F, routing): H and F multiples of 128 (no padding); not multiples of
# 128 (padded K blocks, partial N tiles, a split 128-block between gate and up);
# empty experts; one expert taking every row.
SHAPES = [
    (256, 2, 4, 256, 128, "topk"),
    (200, 2, 6, 200, 100, "topk"),
    (96, 2, 8, 136, 68, "skew"),
    (130, 1, 4, 264, 132, "one"),
    (3, 2, 4, 128, 256, "topk"),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_fp8_forward_and_grads_match_cpu(shape, capacity_factor):
    T, K, E, H, F, routing = shape
    args = _problem(T, K, E, H, F, seed=T + H, routing=routing)
    cot = jnp.cos(jnp.arange(H, dtype=jnp.float32) * 0.37)
    gpu = _run(args, cot, capacity_factor, _gpu())
    cpu = _run(args, cot, capacity_factor, _cpu())
    for name, g, c in zip(NAMES, gpu, cpu):
        assert g.dtype == c.dtype and g.shape == c.shape, name
        assert np.all(np.isfinite(np.asarray(g, np.float32))), name
        assert _rel(g, c) <= TOL, (name, _rel(g, c))
    if routing in ("skew", "one"):  # experts without rows: zero weight gradients
        _, ids, _, _, _ = args
        used = np.zeros(E, bool)
        used[np.asarray(ids).ravel()] = True
        for name, g in zip(NAMES[3:], gpu[3:]):
            assert not np.any(np.asarray(g, np.float32)[~used]), name


def test_fp8_is_deterministic():
    """20 runs of the forward and backward give the same bits (no atomics, one CTA
    per output tile, fixed orders)."""
    T, K, E, H, F = 512, 4, 8, 256, 192
    args = _problem(T, K, E, H, F, seed=11, routing="skew")
    cot = jnp.sin(jnp.arange(H, dtype=jnp.float32))
    first = _run(args, cot, None, _gpu())
    for _ in range(19):
        again = _run(args, cot, None, _gpu())
        for name, a, b in zip(NAMES, first, again):
            assert_bitwise(a, b, name)


def test_weight_gradients_past_65535_row_blocks():
    """The backward quantizes the weight gradients' operands transposed, by 128-row
    blocks of the padded rows (R + 127 E rounded up to 128); past 65535 such blocks
    (8M rows: T = 2^20 tokens at K = 8) one launch's y dimension cannot give each
    its own thread block. Expert 1's rows lie in blocks 65536 and 65537: its weight
    gradients, and the rows' gradients, must be the bits of a call that has its
    rows alone (every row's arithmetic, and each expert's over its own rows, is the
    same wherever they sit). About 35 GB of GPU memory."""
    from mok_jax._src import primitives as prim
    fp8 = int(mok_jax.Recipe.FP8)
    H = F = 128
    n0 = 65536 * 128 - 120  # expert 0: padded to 65536 row blocks
    n1 = 256                # expert 1: row blocks 65536 and 65537
    R = n0 + n1
    ks = jax.device_put(jax.random.split(jax.random.key(13), 6), _gpu())
    make = jax.jit(lambda ks: (
        jax.random.normal(ks[0], (R, H), jnp.bfloat16),
        jax.random.normal(ks[1], (R, H), jnp.bfloat16),
        jax.random.uniform(ks[2], (R,), jnp.float32),
        (jax.random.normal(ks[3], (2, H, 2 * F)) * H**-0.5).astype(jnp.bfloat16),
        (jax.random.normal(ks[4], (2, F, H)) * F**-0.5).astype(jnp.bfloat16),
        jax.random.normal(ks[5], (R, 2 * F), jnp.bfloat16)))
    x_rows, dy_rows, w_rows, wgu, wd, gate_up = make(ks)
    bwd = jax.jit(lambda *a: prim.expert_ffn_bwd_p.bind(*a, recipe=fp8))
    big = bwd(x_rows, dy_rows, w_rows, jnp.array([n0, n1], jnp.int32), wgu, wd, gate_up)
    big = jax.block_until_ready((big[0][n0:], big[1][n0:], big[2][1], big[3][1]))
    alone = bwd(x_rows[n0:], dy_rows[n0:], w_rows[n0:], jnp.array([0, n1], jnp.int32), wgu, wd,
                gate_up[n0:])
    alone = (alone[0], alone[1], alone[2][1], alone[3][1])
    for name, a, b in zip(("dx_rows", "dw_rows", "d_w_gate_up", "d_w_down"), big, alone):
        assert_bitwise(a, b, name)
    assert np.any(np.asarray(big[2], np.float32)), "expert 1's weight gradient is not zero"


def _nan_free_bits(q):
    """e4m3 bits with every NaN (0x7F, 0xFF) as 0x7F: the rule keeps NaN, not its sign."""
    b = np.asarray(q).view(np.uint8).copy()
    b[(b & 0x7F) == 0x7F] = 0x7F
    return b


def _assert_same_quantization(x):
    q_gpu, s_gpu = jax.block_until_ready(mok_jax.quantize_rows_fp8(jax.device_put(x, _gpu())))
    q_cpu, s_cpu = jax.block_until_ready(mok_jax.quantize_rows_fp8(jax.device_put(x, _cpu())))
    assert q_gpu.dtype == jnp.float8_e4m3fn and s_gpu.dtype == jnp.float32
    assert q_gpu.shape == q_cpu.shape and s_gpu.shape == s_cpu.shape
    np.testing.assert_array_equal(_nan_free_bits(q_gpu), _nan_free_bits(q_cpu))
    s_gpu, s_cpu = np.asarray(s_gpu), np.asarray(s_cpu)
    nan = np.isnan(s_cpu)
    np.testing.assert_array_equal(np.isnan(s_gpu), nan)
    assert_bitwise(s_gpu[~nan], s_cpu[~nan], "scales")


def test_quantize_rows_every_bf16_value():
    """Every finite bf16 bit pattern, in blocks whose amax varies (so v / s is not
    exact), and each value alone in its block (s = |v| / 448)."""
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    values = patterns.view(jnp.bfloat16)
    finite = values[np.isfinite(values.astype(np.float32))]
    n = finite.size // 128 * 128
    rows = finite[:n].reshape(-1, 128)
    _assert_same_quantization(jnp.asarray(rows))
    rng = np.random.default_rng(0)
    _assert_same_quantization(jnp.asarray(rng.permutation(finite[:n]).reshape(-1, 256)))
    alone = np.zeros((n // 8, 128), jnp.bfloat16)
    alone[:, 5] = finite[: n // 8]
    _assert_same_quantization(jnp.asarray(alone))


def test_quantize_rows_ties_and_saturation():
    """f32 blocks with amax 448 (s = 1 exactly): every e4m3 rounding midpoint and its
    two f32 neighbours, subnormals, and values past 448 after division."""
    e4m3 = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)
    e4m3 = np.unique(e4m3[np.isfinite(e4m3)])
    mids = (e4m3[:-1] + e4m3[1:]) / 2  # exact in f32
    sweep = np.concatenate([mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf),
                            e4m3, np.float32([1e-10, -1e-10, 2.0**-10, 2.0**-9 * 1.5])])
    sweep = sweep.astype(np.float32)
    per_row = 127
    n = -(-sweep.size // per_row) * per_row
    body = np.zeros(n, np.float32)
    body[: sweep.size] = sweep
    x = np.concatenate([np.full((n // per_row, 1), 448.0, np.float32),
                        body.reshape(-1, per_row)], axis=1)
    _assert_same_quantization(jnp.asarray(x))
    # amax not a multiple of 448: inexact divisions; values saturate at +-448.
    rng = np.random.default_rng(1)
    y = (rng.standard_normal((64, 1000)) * np.exp(rng.uniform(-30, 30, (64, 1)))).astype(np.float32)
    _assert_same_quantization(jnp.asarray(y))


def test_quantize_rows_scale_underflow():
    """float32 blocks whose amax / 448 underflows (amax under 448 * 2^-150, about
    6.5e-43) get scale 1, as zero blocks do: their values stay finite (v / 1 is 0 in
    e4m3) and the bits are the CPU's. A token whose h is such a block (x = 2^-72
    through identity experts: h about 2^-145) gets y = 0, not NaN."""
    x = np.zeros((2, 256), np.float32)
    x[0, 0] = 1e-44
    x[1, 7], x[1, 200] = -3e-43, 1.0  # the second block of row 1 is ordinary
    q, s = mok_jax.quantize_rows_fp8(jax.device_put(jnp.asarray(x), _gpu()))
    q, s = np.asarray(q).astype(np.float32), np.asarray(s)
    assert np.all(np.isfinite(q))
    np.testing.assert_array_equal(s[:, 0], [1.0, 1.0])
    np.testing.assert_array_equal(q[:, :128], 0.0)
    _assert_same_quantization(jnp.asarray(x))

    hid = 128
    xs = np.zeros((2, hid), np.float32)
    xs[0, 0], xs[1] = 2.0 ** -72, 1.0
    eye = np.eye(hid, dtype=np.float32)
    args = jax.device_put((jnp.asarray(xs, jnp.bfloat16), jnp.zeros((2, 1), jnp.int32),
                           jnp.ones((2, 1), jnp.float32),
                           jnp.asarray(np.concatenate([eye, eye], 1)[None], jnp.bfloat16),
                           jnp.asarray(eye[None], jnp.bfloat16)), _gpu())
    y = np.asarray(mok_jax.moe(*args, recipe="fp8")).astype(np.float32)
    np.testing.assert_array_equal(y[0], 0.0)
    assert np.all(np.isfinite(y[1]))


@pytest.mark.parametrize("cols", [1, 5, 127, 128, 129, 300, 1024])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantize_rows_shapes_and_specials(cols, dtype):
    """Short last blocks, zero blocks (scale 1), NaN and Inf in one row (its blocks
    only), for both input types."""
    rng = np.random.default_rng(cols)
    x = rng.standard_normal((9, cols)).astype(np.float32) * 3.0
    x[2] = 0.0
    x[4, cols // 2] = np.nan
    x[6, cols - 1] = np.inf
    x[7, 0] = -np.inf
    _assert_same_quantization(jnp.asarray(x, dtype))
