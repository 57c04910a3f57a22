"""GPU-only checks of the CUDA handlers (run by scripts/gpu_ci.sh).

The rest of the suite runs on the GPU as well when the default device is one;
these tests add what only makes sense there: the tensor-core grouped GEMMs on
sizes they serve, the SIMT fallback on sizes they do not, agreement with the
CPU handlers, and determinism at a size where many CTAs share the work.
"""

import os
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax
from mok_jax._src import ext
from mok_jax.reference import moe_reference

from conftest import assert_bitwise

NATIVE = int(mok_jax.Recipe.NATIVE)  # the primitives' recipe parameter

pytestmark = pytest.mark.gpu


def _problem(T, K, E, H, F, dtype, seed=0, skew=False):
    ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(ks[0], (T, H), jnp.float32).astype(dtype)
    logits = jax.random.normal(ks[1], (T, E))
    if skew:  # most tokens prefer expert 0: ragged groups, some experts empty
        logits = logits.at[:, 0].add(4.0).at[:, E // 2:].add(-8.0)
    w, ids = jax.lax.top_k(jax.nn.softmax(logits), K)
    wgu = (jax.random.normal(ks[2], (E, H, 2 * F)) * H**-0.5).astype(dtype)
    wd = (jax.random.normal(ks[3], (E, F, H)) * F**-0.5).astype(dtype)
    return x, ids.astype(jnp.int32), w, wgu, wd


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _loss_fn(fn, ids, cot, **kw):
    def loss(x, w, wgu, wd):
        return jnp.sum(fn(x, ids, w, wgu, wd, **kw).astype(jnp.float32) * cot)
    return loss


def test_cuda_handlers_are_registered():
    assert "cuda" in ext.registered_platforms(), "built without CUDA handlers"


# (T, K, E, H, F): multiples of 8 take the tensor-core path; the last does not.
SHAPES = [(512, 4, 8, 256, 128), (300, 2, 6, 128, 64), (77, 3, 5, 40, 20), (33, 2, 4, 24, 5)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("skew", [False, True])
@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_bf16_forward_and_grads_match_reference(shape, skew, capacity_factor):
    T, K, E, H, F = shape
    x, ids, w, wgu, wd = _problem(T, K, E, H, F, jnp.bfloat16, skew=skew)
    cot = jnp.cos(jnp.arange(H, dtype=jnp.float32))
    kw = dict(capacity_factor=capacity_factor)
    y, stats = mok_jax.moe(x, ids, w, wgu, wd, return_stats=True, **kw)
    y_ref, stats_ref = moe_reference(x, ids, w, wgu, wd, return_stats=True, **kw)
    assert _rel(y, y_ref) <= 2e-2
    np.testing.assert_array_equal(stats.tokens_per_expert, stats_ref.tokens_per_expert)
    assert int(stats.dropped) == int(stats_ref.dropped)
    g = jax.jit(jax.grad(_loss_fn(mok_jax.moe, ids, cot, **kw), argnums=(0, 1, 2, 3)))(
        x, w, wgu, wd)
    g_ref = jax.grad(_loss_fn(moe_reference, ids, cot, **kw), argnums=(0, 1, 2, 3))(
        x, w, wgu, wd)
    for name, a, b in zip(("dx", "dw", "dwgu", "dwd"), g, g_ref):
        assert _rel(a, b) <= 2e-2, name


# Shapes where GEMM1 runs with SwiGLU in its epilogue (asserted below): F a multiple
# of 128 (first: two 256-column tiles; second: ragged rows that leave tiles partly
# empty) and many rows per weight byte.
FUSED_SHAPES = [(512, 4, 4, 64, 256), (300, 2, 4, 16, 128)]


@pytest.fixture
def unfused_swiglu():
    """A function that runs its argument with GEMM1's SwiGLU epilogue switched off
    (`_mok.set_swiglu_epilogue`, read by the handlers at every call), restoring it."""
    from mok_jax import _mok

    def run(fn):
        previous = _mok.set_swiglu_epilogue(False)
        try:
            return jax.block_until_ready(fn())
        finally:
            _mok.set_swiglu_epilogue(previous)

    return run


@pytest.mark.parametrize("shape", FUSED_SHAPES)
@pytest.mark.parametrize("skew", [False, True])
@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_swiglu_epilogue_gives_the_unfused_bits(unfused_swiglu, shape, skew, capacity_factor):
    """GEMM1 with SwiGLU in its epilogue (the default for bf16 on sm_90a where
    mok/swiglu_rule.h allows it: F % 128 == 0, 4*E*H <= T*K) and GEMM1 to f32
    followed by the SwiGLU kernel (the epilogue switched off) give the same bits: y,
    the saved gate/up residual, every gradient, and the EP pieces' expert FFN."""
    from mok_jax import _mok
    from mok_jax._src import primitives as prim
    T, K, E, H, F = shape
    # Else both runs would be unfused and equal whatever the epilogue does.
    assert _mok.swiglu_epilogue_shape(E, H, F, T * K)
    assert _mok.HAS_SM90A_KERNELS and jax.devices()[0].compute_capability == "9.0"
    x, ids, w, wgu, wd = _problem(T, K, E, H, F, jnp.bfloat16, seed=5, skew=skew)
    ids = ids.at[::7, 0].set(E + 3)  # invalid ids too
    cot = jnp.cos(jnp.arange(H, dtype=jnp.float32))
    cap = mok_jax.capacity(capacity_factor, T, K, E)
    cap = prim.NO_CAPACITY if cap is None else cap
    fwd = jax.jit(lambda *a: prim.moe_fwd_p.bind(*a, recipe=NATIVE, capacity=cap, save_gate_up=True))
    grad = jax.jit(jax.grad(_loss_fn(mok_jax.moe, ids, cot, capacity_factor=capacity_factor),
                            argnums=(0, 1, 2, 3)))
    sizes = jnp.array([T * K // E] * (E - 2) + [0, T * K - (E - 2) * (T * K // E)], jnp.int32)
    x_rows = jnp.tile(x, (K, 1))
    ffn = jax.jit(lambda *a: prim.expert_ffn_fwd_p.bind(*a, recipe=NATIVE, save_gate_up=True))

    def run():
        y, gate_up, _, _, dropped, invalid = fwd(x, ids, w, wgu, wd)
        gate_up = gate_up[:T * K - int(dropped) - int(invalid)]  # rows past these: untouched
        out_rows, ep_gate_up = ffn(x_rows, sizes, wgu, wd)
        return [y, gate_up, out_rows, ep_gate_up, *grad(x, w, wgu, wd)]

    fused = jax.block_until_ready(run())  # finished before the switch changes
    unfused = unfused_swiglu(run)
    names = ("y", "gate_up", "ep out_rows", "ep gate_up", "dx", "dw", "dwgu", "dwd")
    for name, a, b in zip(names, fused, unfused):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16 if a.dtype == jnp.bfloat16
                                                         else np.uint32),
                                      np.asarray(b).view(np.uint16 if b.dtype == jnp.bfloat16
                                                         else np.uint32), err_msg=name)
    y_ref = moe_reference(x, ids, w, wgu, wd, capacity_factor=capacity_factor)
    assert _rel(fused[0], y_ref) <= 2e-2


# Finite bf16 bit patterns the rounding must get right beside ordinary values:
# zeros, the largest values (the sum of two overflows f32 to infinity; the largest
# plus 2^119 (0x7B00) lies halfway between it and infinity in bf16 and rounds to
# infinity, plus 1.5 * 2^119 (0x7B40) rounds up, plus 2^118 (0x7A80) rounds down),
# subnormals, powers of two that make halfway cases (1 + 2^-8 lies halfway between
# two bf16 values), 1 + one ulp. (No infinities or NaNs among the weights: an x
# entry of 0 times one would make the whole accumulator NaN.)
SPECIAL_BF16 = [0x0000, 0x8000, 0x7F7F, 0xFF7F, 0x7F70, 0x0001, 0x807F, 0x0080, 0x3F80,
                0xBF80, 0x3B80, 0x3B40, 0x3F81, 0x7F00, 0x0100, 0x7B00, 0x7B40, 0x7A80]
# NaNs with a sign and a payload, and infinities, for x.
NONFINITE_BF16 = [0x7FC1, 0xFFC5, 0x7F80, 0xFF80]


def special_values_problem(T, E, H, F, seed=11):
    """Layer inputs whose accumulators reach the rounding's special cases (K = 1,
    W_down = I). Each x row holds two nonzeros, so each accumulator is the f32 sum of
    two weight entries (or their products with a NaN or an infinity). Three kinds of
    rows (`kind`, returned last): (0) sums of entries drawn from SPECIAL_BF16 and
    random values; (1) sums of finite values from subnormal to 2^30 and halfway
    makers, so that h is finite and seen exactly through y; (2) a NaN or an infinity
    in x."""
    rng = np.random.default_rng(seed)
    half = H // 2

    def bf16_values(bits):
        return np.array(bits, np.uint16).view(jnp.bfloat16).astype(np.float32)

    special = bf16_values(SPECIAL_BF16)
    wgu = np.empty((E, H, 2 * F), np.float32)
    shape = (E, half, 2 * F)
    # W rows [0, H/2): half special values, half random normals.
    wgu[:, :half] = np.where(rng.random(shape) < 0.5,
                             special[rng.integers(0, len(special), shape)],
                             rng.standard_normal(shape) * 4.0)
    # W rows [H/2, H): finite, exponents from the subnormals up, and halfway makers.
    finite = rng.standard_normal(shape) * np.exp2(rng.integers(-133, 30, shape))
    halfway = rng.choice([1.0, 2.0**-8, 3 * 2.0**-9, -1.0], shape)
    wgu[:, half:] = np.where(rng.random(shape) < 0.2, halfway, finite)
    wgu = jnp.asarray(wgu, jnp.bfloat16)
    kind = np.arange(T) % 3
    a = rng.integers(0, half, T)
    b = (a + rng.integers(1, half, T)) % half
    offset = np.where(kind == 1, half, 0)
    x = np.zeros((T, H), np.float32)
    x[np.arange(T), a + offset] = np.where(
        kind == 2, bf16_values(NONFINITE_BF16)[rng.integers(0, len(NONFINITE_BF16), T)], 1.0)
    x[np.arange(T), b + offset] = 1.0
    x = jnp.asarray(x, jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, E, (T, 1)), jnp.int32)
    w = jnp.ones((T, 1), jnp.float32)
    wd = jnp.broadcast_to(jnp.eye(F, H, dtype=jnp.bfloat16), (E, F, H))
    return x, ids, w, wgu, wd, kind


def assert_special_values_reached(gate_up, y, kind):
    """The draw reaches the cases: NaNs, both infinities and subnormals among g and u,
    and every h of a finite row is finite (y's rows are the tokens' own rows)."""
    gu = np.asarray(gate_up).view(np.uint16)
    exponent, mantissa = gu & 0x7F80, gu & 0x7F
    assert ((exponent == 0x7F80) & (mantissa != 0)).any(), "no NaN"
    assert (gu == 0x7F80).any() and (gu == 0xFF80).any(), "no infinity"
    assert ((exponent == 0) & (mantissa != 0)).any(), "no subnormal"
    y = np.asarray(y).view(np.uint16)[kind == 1]
    assert ((y & 0x7F80) < 0x7F80).all(), "h of a finite row is not finite"


def test_swiglu_epilogue_rounds_special_values_like_unfused(unfused_swiglu):
    """The epilogue rounds h, g and u to bf16 with the hardware's conversion; the
    unfused SwiGLU kernel with float_to_bf16. special_values_problem's rows; the
    saved residual (g and u) and y must have the same bits in both paths. (h's
    rounding is seen on finite rows only: a row whose h holds an infinity or a NaN is
    NaN in y through 0 * inf.)"""
    from mok_jax import _mok
    from mok_jax._src import primitives as prim
    T, E, H, F = 1536, 2, 128, 128
    assert _mok.swiglu_epilogue_shape(E, H, F, T)
    assert _mok.HAS_SM90A_KERNELS and jax.devices()[0].compute_capability == "9.0"
    x, ids, w, wgu, wd, kind = special_values_problem(T, E, H, F)
    fwd = jax.jit(lambda *args: prim.moe_fwd_p.bind(*args, recipe=NATIVE, capacity=prim.NO_CAPACITY,
                                                    save_gate_up=True)[:2])
    fused = jax.block_until_ready(fwd(x, ids, w, wgu, wd))
    unfused = unfused_swiglu(lambda: fwd(x, ids, w, wgu, wd))
    for name, got, want in zip(("y (h)", "gate_up"), fused, unfused):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                      np.asarray(want).view(np.uint16), err_msg=name)
    assert_special_values_reached(fused[1], fused[0], kind)


def test_sigmoid_is_its_documented_form_on_every_float(tmp_path):
    """The kernels' sigmoid (ffi/kernels/swiglu_math.cuh, ex2 and rcp with .ftz)
    against __fdividef(1, 1 + __expf(-g)) bit for bit and against the logistic
    function in double precision (within __expf's documented error bound and 2 ulp),
    over all 2^32 float inputs (tests/sigmoid_bits.cu)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc on PATH")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    exe = tmp_path / "sigmoid_bits"
    built = subprocess.run(
        [nvcc, "-std=c++20", "-O3", "-arch=native",
         "-I", os.path.join(root, "ffi", "kernels"), "-I", os.path.join(root, "ffi", "include"),
         "-I", os.path.join(root, "scripts"),
         os.path.join(root, "tests", "sigmoid_bits.cu"), "-o", str(exe)],
        capture_output=True, text=True)
    assert built.returncode == 0, f"nvcc failed:\n{built.stderr}"
    ran = subprocess.run([str(exe)], capture_output=True, text=True)
    out = ran.stdout.strip()
    m = re.fullmatch(r"mismatches (\d+) max_ulp (\d+) beyond_bound (\d+)", out)
    assert m, out + ran.stderr
    assert int(m.group(1)) == 0, out  # bit for bit the __fdividef / __expf form
    assert int(m.group(3)) == 0, out  # within __expf's bound, plus 2 ulp
    assert ran.returncode == 0, out


@pytest.mark.parametrize("shape", SHAPES[1:])
def test_f32_matches_reference_tightly(shape):
    T, K, E, H, F = shape
    x, ids, w, wgu, wd = _problem(T, K, E, H, F, jnp.float32, seed=3)
    cot = jnp.sin(jnp.arange(H, dtype=jnp.float32))
    assert _rel(mok_jax.moe(x, ids, w, wgu, wd), moe_reference(x, ids, w, wgu, wd)) <= 1e-5
    g = jax.grad(_loss_fn(mok_jax.moe, ids, cot), argnums=(0, 1, 2, 3))(x, w, wgu, wd)
    g_ref = jax.grad(_loss_fn(moe_reference, ids, cot), argnums=(0, 1, 2, 3))(x, w, wgu, wd)
    for name, a, b in zip(("dx", "dw", "dwgu", "dwd"), g, g_ref):
        assert _rel(a, b) <= 1e-5, name


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rows_longer_than_one_pass_of_the_row_kernels(dtype):
    # H = 2056: 257 bf16 vectors (3 passes of a warp's 128, the last ragged), 514
    # f32 ones (5 passes). The x gather once stored such rows one element at a time.
    T, K, E, H, F = 96, 2, 4, 2056, 64
    x, ids, w, wgu, wd = _problem(T, K, E, H, F, dtype, seed=7, skew=True)
    cot = jnp.sin(jnp.arange(H, dtype=jnp.float32))
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert _rel(mok_jax.moe(x, ids, w, wgu, wd), moe_reference(x, ids, w, wgu, wd)) <= tol
    g = jax.grad(_loss_fn(mok_jax.moe, ids, cot), argnums=(0, 1, 2, 3))(x, w, wgu, wd)
    g_ref = jax.grad(_loss_fn(moe_reference, ids, cot), argnums=(0, 1, 2, 3))(x, w, wgu, wd)
    for name, a, b in zip(("dx", "dw", "dwgu", "dwd"), g, g_ref):
        assert _rel(a, b) <= tol, name


def test_gpu_agrees_with_cpu_handlers():
    T, K, E, H, F = 256, 4, 8, 128, 64
    gpu_args = _problem(T, K, E, H, F, jnp.bfloat16, seed=5)
    cpu_args = jax.device_put(gpu_args, jax.devices("cpu")[0])
    y_gpu = mok_jax.moe(*gpu_args)
    y_cpu = mok_jax.moe(*cpu_args)
    assert _rel(y_gpu, y_cpu) <= 2e-2


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_bitwise_deterministic_over_20_runs(dtype):
    T, K, E, H, F = 2048, 8, 32, 512, 256
    x, ids, w, wgu, wd = _problem(T, K, E, H, F, dtype, seed=11, skew=True)
    cot = jnp.cos(jnp.arange(H, dtype=jnp.float32))
    step = jax.jit(jax.value_and_grad(_loss_fn(mok_jax.moe, ids, cot), argnums=(0, 1, 2, 3)))
    fwd = jax.jit(lambda *a: mok_jax.moe(*a))
    first_y = np.asarray(fwd(x, ids, w, wgu, wd))
    first = [np.asarray(a) for a in jax.tree.leaves(step(x, w, wgu, wd))]
    for _ in range(19):
        np.testing.assert_array_equal(np.asarray(fwd(x, ids, w, wgu, wd)), first_y)
        for a, b in zip(jax.tree.leaves(step(x, w, wgu, wd)), first):
            np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.parametrize("routing", ["even", "expert 17 at 8x", "uneven"])
def test_weight_gradients_under_uneven_routing_match_the_reference(routing):
    """The weight-gradient GEMM's groups go in order of their rows, most first
    (setup_groups in ffi/kernels/cutlass_grouped.cuh): a real permutation of both
    problems' groups under uneven loads (ties, an empty expert, one busy expert that
    is not the first). Every gradient still matches the reference, and the expert
    without rows gets a zero gradient."""
    from mok_jax import _mok, bench
    assert _mok.HAS_SM90A_KERNELS and jax.devices()[0].compute_capability == "9.0"
    T, K, E, H, F = 2048, 4, 32, 256, 256
    x, ids, w, wgu, wd = _problem(T, K, E, H, F, jnp.bfloat16, seed=5)
    shape = bench.Shape("skewed", T, K, E, H, F)
    if routing == "expert 17 at 8x":
        ids = jnp.asarray(bench.skewed_expert_ids(shape, 8.0, seed=5, hot=17))
    elif routing == "uneven":  # expert e picked with weight ~ (e % 7 + 1)^2, expert 3 never
        rng = np.random.default_rng(5)
        p = (np.arange(E) % 7 + 1.0) ** 2
        p[3] = 0.0
        ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False, p=p / p.sum())
                                    for _ in range(T)]).astype(np.int32))
    counts = np.bincount(np.asarray(ids).ravel(), minlength=E)
    if routing != "even":
        assert counts.max() > 2.0 * counts.mean()
    cot = jnp.cos(jnp.arange(H, dtype=jnp.float32))
    grad = jax.jit(jax.grad(_loss_fn(mok_jax.moe, ids, cot), argnums=(0, 1, 2, 3)))
    want = jax.jit(jax.grad(_loss_fn(moe_reference, ids, cot), argnums=(0, 1, 2, 3)))
    got = grad(x, w, wgu, wd)
    for name, a, b in zip(("dx", "dw", "dwgu", "dwd"), got, want(x, w, wgu, wd)):
        assert _rel(a, b) <= 2e-2, name
    dwgu = np.asarray(got[2], np.float32)
    assert np.abs(dwgu).max() > 0  # the gradients are not empty
    if routing == "uneven":  # the expert without rows has a zero gradient, the others not
        assert not dwgu[3].any() and all(dwgu[e].any() for e in range(E) if e != 3)


# (experts, capacity factor): scan_plan's lanes per expert are 32, 16, 8, 4, 2 and 1
# (one thread an expert), and two experts a thread past 512 experts.
ROUTING_CASES = [(3, None), (32, 0.8), (40, 0.9), (100, None), (200, 1.0), (300, 1.0),
                 (1000, 1.0)]


@pytest.mark.parametrize("experts,capacity_factor", ROUTING_CASES)
def test_routing_plan_matches_the_cpu_plan_over_many_chunks(experts, capacity_factor):
    """The CUDA routing plan (per-chunk histograms, the scan over chunks, the ordered
    placement: ffi/kernels/routing.cu) puts every kept pair in the CPU plan's row:
    an expert's rows in token order, then k, the first `capacity` of them kept. Seen
    through the forward's x_rows residual, whose row r is x of row r's token (x rows
    are distinct), at 42 chunks of pairs (the last one partial) with invalid ids:
    few experts (lanes share an expert's scan over chunks, some with no chunks) and
    many (a thread each, or two). (x_rows cannot tell two pairs of one token apart:
    random ids can send a token twice to one expert, and a swap of those two rows
    would pass.)"""
    from mok_jax._src import primitives as prim
    T, K, H, F = 10750, 4, 16, 16
    rng = np.random.default_rng(experts)
    ids = rng.integers(0, experts, (T, K)).astype(np.int32)
    ids[rng.random((T, K)) < 0.02] = experts + 1
    x = np.zeros((T, H), np.float32)
    x[:, 0], x[:, 1] = np.arange(T) % 256, np.arange(T) // 256  # exact in bf16
    args = (jnp.asarray(x, jnp.bfloat16), jnp.asarray(ids),
            jnp.asarray(rng.random((T, K)), jnp.float32),
            jnp.asarray(rng.standard_normal((experts, H, 2 * F)) * 0.25, jnp.bfloat16),
            jnp.asarray(rng.standard_normal((experts, F, H)) * 0.25, jnp.bfloat16))
    cap = mok_jax.capacity(capacity_factor, T, K, experts)
    cap = prim.NO_CAPACITY if cap is None else cap
    fwd = jax.jit(lambda *a: prim.moe_fwd_p.bind(*a, recipe=NATIVE, capacity=cap, save_gate_up=True)[2:])
    plans = [fwd(*jax.device_put(args, device))
             for device in (jax.devices("gpu")[0], jax.devices("cpu")[0])]
    (x_rows, per_expert, dropped, invalid), (x_rows_cpu, per_expert_cpu, dropped_cpu,
                                             invalid_cpu) = plans
    assert (int(dropped), int(invalid)) == (int(dropped_cpu), int(invalid_cpu))
    np.testing.assert_array_equal(np.asarray(per_expert), np.asarray(per_expert_cpu))
    assert int(invalid) > 0 and (int(dropped) > 0) == (capacity_factor is not None)
    kept = T * K - int(dropped) - int(invalid)  # rows past these: untouched on the GPU
    np.testing.assert_array_equal(np.asarray(x_rows[:kept]).view(np.uint16),
                                  np.asarray(x_rows_cpu[:kept]).view(np.uint16))


def test_invalid_ids_and_all_on_one_expert():
    T, K, E, H, F = 130, 2, 4, 64, 32
    x, ids, w, wgu, wd = _problem(T, K, E, H, F, jnp.bfloat16, seed=2)
    ids = ids.at[:, 0].set(1)                       # every token's first slot on expert 1
    ids = ids.at[::7, 1].set(-3).at[1::11, 1].set(E + 2)
    y, stats = mok_jax.moe(x, ids, w, wgu, wd, return_stats=True)
    y_ref, stats_ref = moe_reference(x, ids, w, wgu, wd, return_stats=True)
    assert int(stats.invalid) == int(stats_ref.invalid) > 0
    np.testing.assert_array_equal(stats.tokens_per_expert, stats_ref.tokens_per_expert)
    assert _rel(y, y_ref) <= 2e-2


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_expert_parallel_pieces_match_the_cpu_kernels(dtype):
    """The CUDA expert-FFN and combine kernels that expert parallelism composes,
    checked against the CPU kernels (which tests/test_ep.py ties bitwise to the
    single-device layer). 8-multiple sizes: tensor-core GEMMs for bf16."""
    from mok_jax._src import primitives as prim
    R, E, H, F, T, K = 96, 4, 64, 32, 40, 2
    ks = jax.random.split(jax.random.key(9), 8)
    x_rows = jax.random.normal(ks[0], (R, H)).astype(dtype)
    dy_rows = jax.random.normal(ks[1], (R, H)).astype(dtype)
    w_rows = jax.random.uniform(ks[2], (R,), jnp.float32)
    sizes = jnp.array([40, 0, 30, 10], jnp.int32)          # 80 of 96 rows used, one empty
    wgu = (jax.random.normal(ks[3], (E, H, 2 * F)) * H**-0.5).astype(dtype)
    wd = (jax.random.normal(ks[4], (E, F, H)) * F**-0.5).astype(dtype)
    rows_by_pair = jax.random.normal(ks[5], (T * K, H)).astype(dtype)
    weights = jax.random.uniform(ks[6], (T, K), jnp.float32)
    kept = (jax.random.uniform(ks[7], (T, K)) > 0.3).astype(jnp.int32)

    def run(device):
        put = lambda a: jax.device_put(a, device)  # noqa: E731
        out, gate_up = prim.expert_ffn_fwd_p.bind(put(x_rows), put(sizes), put(wgu), put(wd),
                                                  recipe=NATIVE, save_gate_up=True)
        grads = prim.expert_ffn_bwd_p.bind(put(x_rows), put(dy_rows), put(w_rows), put(sizes),
                                           put(wgu), put(wd), gate_up, recipe=NATIVE)
        (y,) = prim.combine_p.bind(put(rows_by_pair), put(weights), put(kept), weighted=True)
        used = int(sizes.sum())
        return [np.asarray(out)[:used], np.asarray(gate_up)[:used], np.asarray(grads[0])[:used],
                np.asarray(grads[1])[:used], np.asarray(grads[2]), np.asarray(grads[3]),
                np.asarray(y)]

    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    names = ("out_rows", "gate_up", "dx_rows", "dw_rows", "d_w_gate_up", "d_w_down", "combine")
    for name, g, c in zip(names, run(jax.devices("gpu")[0]), run(jax.devices("cpu")[0])):
        assert _rel(g, c) <= tol, name
    # The empty expert's weight gradients are exactly zero.
    gpu = run(jax.devices("gpu")[0])
    assert not np.any(gpu[4][1]) and not np.any(gpu[5][1])


def test_split_router_logits_keep_f32_accuracy_on_the_gpu():
    # XLA's GPU pipeline may fold f32 -> bf16 -> f32 round trips when it allows
    # excess precision; the router's three-term split must survive it.
    from test_nn import check_router_logits_accuracy
    assert jax.default_backend() == "gpu"
    check_router_logits_accuracy(T=4096)
