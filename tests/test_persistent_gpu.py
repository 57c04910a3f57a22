"""The persistent kernels (one kernel per pass after the routing plan; the forward:
gather, GEMM1 with SwiGLU, GEMM2, combine; the backward: dgrads, SwiGLU's backward,
weight gradients, the dx combine) give the kernel chains' bits on the GPU.

`_mok.set_persistent_kernels(OFF)` makes the handlers run the chains (gathers,
grouped GEMMs, SwiGLU, combines as separate kernels), `ALWAYS` the persistent
kernels wherever they can run (the default, `AUTO`, picks them by rows per
expert, experts and expert size: test_auto_mode_takes_few_rows_per_expert_only);
y, the residuals and every gradient must be equal bit for bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax
from mok_jax import _mok
from mok_jax._src import ep
from mok_jax.reference import moe_reference

pytestmark = pytest.mark.gpu


def _problem(T, K, E, H, F, seed=0, skew=False, weight_dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (T, H), jnp.float32).astype(jnp.bfloat16)
    logits = jax.random.normal(ks[1], (T, E))
    if skew:  # most tokens prefer expert 0: ragged groups, some experts empty
        logits = logits.at[:, 0].add(4.0).at[:, E // 2:].add(-8.0)
    w, ids = jax.lax.top_k(jax.nn.softmax(logits), K)
    wgu = (jax.random.normal(ks[2], (E, H, 2 * F)) * H**-0.5).astype(jnp.bfloat16)
    wd = (jax.random.normal(ks[3], (E, F, H)) * F**-0.5).astype(jnp.bfloat16)
    return x, ids.astype(jnp.int32), w.astype(weight_dtype), wgu, wd


@pytest.fixture
def persistent():
    """run(fn, enabled): fn() with the persistent kernels always (where they can run)
    or never, the mode restored after."""
    if not hasattr(_mok, "set_persistent_kernels"):
        pytest.fail("this build has no persistent kernels (sm_90a code)")
    modes = {True: _mok.PersistentMode.ALWAYS, False: _mok.PersistentMode.OFF}

    def run(fn, enabled):
        previous = _mok.set_persistent_kernels(modes[enabled])
        try:
            return jax.block_until_ready(fn())
        finally:
            _mok.set_persistent_kernels(previous)

    return run


def _forward_and_grads(x, ids, w, wgu, wd, **kw):
    cot = jnp.cos(jnp.arange(x.shape[1], dtype=jnp.float32))

    def loss(x, w, wgu, wd):
        y, stats = mok_jax.moe(x, ids, w, wgu, wd, return_stats=True, **kw)
        return jnp.sum(y.astype(jnp.float32) * cot), (y, stats)

    # The arrays as arguments, not closed over: constants in the executable would
    # make it as large as the weights (1.2 GB at few-tokens).
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    return lambda: grad(x, w, wgu, wd)


def _assert_same(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        u, v = np.atleast_1d(np.asarray(u)), np.atleast_1d(np.asarray(v))
        np.testing.assert_array_equal(u.view(np.uint8), v.view(np.uint8))


def _always_takes(T, K, E, H, F):
    """Whether, under ALWAYS (the mode restored after), the persistent kernels take
    this shape: the forward without and with residuals, and the backward."""
    previous = _mok.set_persistent_kernels(_mok.PersistentMode.ALWAYS)
    try:
        return (_mok.persistent_shape(T, K, E, H, F),
                _mok.persistent_shape(T, K, E, H, F, residuals=True),
                _mok.persistent_backward_shape(T, K, E, H, F))
    finally:
        _mok.set_persistent_kernels(previous)


def _check(persistent, args, **kw):
    T, K = args[1].shape
    E, H, F2 = args[3].shape
    assert _always_takes(T, K, E, H, F2 // 2) == (True, True, True), (
        "the persistent kernels do not take this shape")
    fwd = lambda: mok_jax.moe(*args, return_stats=True, **kw)
    step = _forward_and_grads(*args, **kw)
    _assert_same(persistent(fwd, True), persistent(fwd, False))
    _assert_same(persistent(step, True), persistent(step, False))
    return persistent(fwd, True)


SHAPES = [
    (512, 4, 8, 256, 128),
    (300, 2, 6, 128, 64),
    (77, 3, 5, 40, 24),       # H and F below one 64-wide K block
    (100, 2, 4, 136, 200),    # H and F not multiples of 64 (partial K blocks and columns)
    (1, 1, 1, 8, 8),          # T = 1
    (256, 8, 128, 2048, 768), # few tokens over many experts
    (600, 2, 4, 136, 200),    # 128-row tiles, H and F not multiples of 64
    (520, 2, 4, 200, 72),     # 128-row tiles, one partial gate/up tile, a partial H tile
    (4096, 2, 2, 1536, 640),  # 4096 rows per expert: weight-gradient tasks of 4 N tiles
]


def test_the_shapes_take_both_tile_heights():
    """Under ALWAYS the forward takes 64-row tiles up to 64 rows per expert and
    128-row tiles past that (E <= 2048); the shapes above run both."""
    assert {_mok.persistent_tile_rows(*s) for s in SHAPES} == {64, 128}
    assert _mok.persistent_tile_rows(1024, 8, 128, 2048, 768) == 64    # 64 rows per expert
    assert _mok.persistent_tile_rows(1025, 8, 128, 2048, 768) == 128   # just over
    assert _mok.persistent_tile_rows(32768, 8, 2048, 512, 256) == 128
    assert _mok.persistent_tile_rows(32768, 8, 2049, 512, 256) == 64   # E > 2048


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("skew", [False, True])
def test_persistent_forward_gives_the_chain_bits(persistent, shape, skew):
    args = _problem(*shape, seed=3, skew=skew)
    y, stats = _check(persistent, args)
    y_ref, stats_ref = moe_reference(*args, return_stats=True)
    np.testing.assert_array_equal(stats.tokens_per_expert, stats_ref.tokens_per_expert)
    a, b = np.asarray(y, np.float64), np.asarray(y_ref, np.float64)
    assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b)


def _check_expert_rows(persistent, counts, H, F, seed):
    """_check with top-1 routing that gives expert e counts[e] rows (in a random
    token order), on 128-row tiles; and the routed counts."""
    T = sum(counts)
    x, _, _, wgu, wd = _problem(T, 1, len(counts), H, F, seed=seed)
    ids = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
    ids = jnp.asarray(np.random.default_rng(seed).permutation(ids)[:, None])
    w = jax.random.uniform(jax.random.key(seed), (T, 1), minval=0.5, maxval=1.5)
    assert _mok.persistent_tile_rows(T, 1, len(counts), H, F) == 128
    _, stats = _check(persistent, (x, ids, w, wgu, wd))
    np.testing.assert_array_equal(stats.tokens_per_expert, counts)


def test_the_most_experts_on_128_row_tiles(persistent):
    """2048 experts, the most that the 128-row instantiations take (their shared
    memory holds the stages, the store buffers and the experts' row-block prefix
    sums), 130 rows each: both passes launch and give the chain's bits."""
    _check_expert_rows(persistent, (130,) * 2048, 64, 72, seed=17)


@pytest.mark.parametrize("counts,F,tile_rows", [
    ((3, 133, 264, 77), 128, 128),
    ((3, 133, 264, 77), 520, 128),
    ((3, 61, 64, 13), 128, 64),
])
def test_saved_x_rows_are_the_chains(persistent, counts, F, tile_rows):
    """The forward's saved x rows (the backward's residual) are the chain's gathered
    rows and x's rows in routing-plan order, bit for bit. The persistent forward's
    GEMM1 tasks of a row block copy its rows, each a share of the columns: experts of
    3 rows, blocks ending 5 rows past a multiple of 8 and on one, H = 200 (not a
    multiple of the 64-column K block), blocks of one GEMM1 task and of five (more
    than the four K blocks), both tile heights."""
    from mok_jax._src import primitives as prim
    T, H = sum(counts), 200
    x, _, _, wgu, wd = _problem(T, 1, len(counts), H, F, seed=15)
    ids = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
    ids = jnp.asarray(np.random.default_rng(15).permutation(ids)[:, None])
    w = jnp.ones((T, 1), jnp.float32)
    assert _always_takes(T, 1, len(counts), H, F)[1]
    assert _mok.persistent_tile_rows(T, 1, len(counts), H, F) == tile_rows
    fwd = jax.jit(lambda *a: prim.moe_fwd_p.bind(
        *a, recipe=int(mok_jax.Recipe.NATIVE), capacity=prim.NO_CAPACITY,
        save_gate_up=True)[2])
    got = persistent(lambda: fwd(x, ids, w, wgu, wd), True)
    want = persistent(lambda: fwd(x, ids, w, wgu, wd), False)
    assert got.shape == (T, H)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                  np.asarray(want).view(np.uint16))
    # Routing-plan row order: by expert, then token.
    order = np.argsort(np.asarray(ids[:, 0]), kind="stable")
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                  np.asarray(x)[order].view(np.uint16))


def test_wide_tiles_at_the_block_edges(persistent):
    """128-row tiles with experts of exactly one block (128 rows), one row past it
    (129: a second block of one row, its epilogue's warp groups one partial and one
    empty), two whole blocks (256) and 385 rows (three blocks and one row)."""
    _check_expert_rows(persistent, (128, 129, 256, 385), 136, 200, seed=13)


def test_experts_past_one_band(persistent):
    """Experts of many row blocks: their GEMM tasks go in bands of 8 blocks, column
    tile by column tile (ffi/kernels/band_order.h). Experts of 2304, 1153, 0 and 130
    rows: 18, 10, 0 and 2 blocks of 128 in the forward (two whole bands and a part),
    36, 19, 0 and 3 blocks of 64 in the backward; several column tiles in every
    GEMM (H 264, F 520). The chain's bits, forward and backward."""
    _check_expert_rows(persistent, (2304, 1153, 0, 130), 264, 520, seed=14)


@pytest.mark.parametrize("experts,tile_rows", [(2, 128), (32, 64)])
def test_special_values_round_as_in_the_chain(persistent, experts, tile_rows):
    """The persistent epilogues round h, g, u and the expert-output rows with the
    hardware's conversion, as the chain's SwiGLU epilogue does: with GEMM1
    accumulators that reach NaNs, infinities, subnormals and halfway cases (test_gpu's
    special_values_problem), y and the saved residual are the chain's bits, with
    both tile heights. (W_down = I: GEMM2's accumulators are h's bf16 values, so its
    rounding sees exact values, infinities and NaNs only.)"""
    from mok_jax._src import primitives as prim
    from test_gpu import assert_special_values_reached, special_values_problem
    T, H, F = 1536, 128, 128
    x, ids, w, wgu, wd, kind = special_values_problem(T, experts, H, F)
    assert _always_takes(T, 1, experts, H, F)[1]
    assert _mok.persistent_tile_rows(T, 1, experts, H, F) == tile_rows
    fwd = jax.jit(lambda *a: prim.moe_fwd_p.bind(
        *a, recipe=int(mok_jax.Recipe.NATIVE), capacity=prim.NO_CAPACITY,
        save_gate_up=True)[:2])
    got = persistent(lambda: fwd(x, ids, w, wgu, wd), True)
    want = persistent(lambda: fwd(x, ids, w, wgu, wd), False)
    for name, a, b in zip(("y", "gate_up"), got, want):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16),
                                      np.asarray(b).view(np.uint16), err_msg=name)
    assert_special_values_reached(got[1], got[0], kind)


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0])
def test_capacity_drops(persistent, capacity_factor):
    args = _problem(640, 4, 16, 256, 192, seed=4, skew=True)
    y, stats = _check(persistent, args, capacity_factor=capacity_factor)
    assert int(stats.dropped) > 0


def test_bf16_combine_weights(persistent):
    _check(persistent, _problem(384, 4, 8, 192, 128, seed=5, weight_dtype=jnp.bfloat16))


def test_one_expert_takes_every_row_and_invalid_ids(persistent):
    x, ids, w, wgu, wd = _problem(400, 3, 6, 128, 96, seed=6)
    ids = ids.at[:, 0].set(2)                                # expert 2: 400+ rows, 7 row blocks
    ids = ids.at[::5, 1].set(-1).at[1::9, 2].set(6)          # invalid: nothing, no gradient
    ids = ids.at[:, 1:].set(jnp.where(ids[:, 1:] == 2, 3, ids[:, 1:]))
    y, stats = _check(persistent, (x, ids, w, wgu, wd))
    assert int(stats.invalid) > 0
    assert int(stats.tokens_per_expert[2]) == 400


def test_every_pair_invalid_gives_zeros(persistent):
    x, ids, w, wgu, wd = _problem(64, 2, 4, 64, 64, seed=7)
    ids = jnp.full_like(ids, 9)
    y, _ = _check(persistent, (x, ids, w, wgu, wd))
    assert not np.any(np.asarray(y, np.float32))


def test_no_tokens_give_zero_weight_gradients(persistent):
    """T = 0: the backward launches with no rows (its row tensor maps left unencoded)
    and gives the chain's zero weight gradients and empty y and dx."""
    x, ids, w, wgu, wd = _problem(8, 2, 4, 64, 64, seed=8)
    args = (x[:0], ids[:0], w[:0], wgu, wd)
    y, _ = _check(persistent, args)
    assert y.shape == (0, 64)
    step = _forward_and_grads(*args)
    (dx, dw, dwgu, dwd), _ = persistent(step, True)
    assert dx.shape == (0, 64) and dw.shape == (0, 2)
    assert not np.any(np.asarray(dwgu, np.float32)) and not np.any(np.asarray(dwd, np.float32))


def test_auto_mode_takes_few_rows_per_expert_only():
    """AUTO: both passes persistent over at least 64 experts up to 4096 rows per
    expert for experts of H·F <= 2048·1024, up to 256 for larger ones; over fewer
    experts, the forward up to 64 rows per expert (for a forward that keeps no
    residuals, inference: 128, or 4096 for experts of H·F <= 2048·1024 with H >= 2048)
    and the chain's backward; OFF: never."""
    assert _mok.set_persistent_kernels(_mok.PersistentMode.AUTO) == _mok.PersistentMode.AUTO
    for residuals in (False, True):
        assert _mok.persistent_shape(256, 8, 128, 2048, 768, residuals)    # 16 rows per expert
        assert _mok.persistent_shape(1024, 8, 128, 2048, 768, residuals)   # 64
        assert _mok.persistent_shape(4096, 8, 128, 2048, 768, residuals)   # 256
        assert _mok.persistent_shape(16384, 8, 128, 2048, 768, residuals)  # 1024, H·F small
        assert _mok.persistent_shape(16384, 8, 64, 2048, 1024, residuals)  # 2048, E = 64
        assert _mok.persistent_shape(65536, 8, 128, 2048, 768, residuals)  # 4096
        assert not _mok.persistent_shape(65537, 8, 128, 2048, 768, residuals)  # just over 4096
        assert not _mok.persistent_shape(65536, 8, 64, 2048, 1024, residuals)  # 8192
        assert _mok.persistent_shape(65536, 8, 128, 1024, 2048, residuals)  # 4096, H·F = 2^21
        assert not _mok.persistent_shape(8192, 8, 128, 1024, 2056, residuals)  # 512, H·F > 2^21
        assert _mok.persistent_shape(4096, 8, 128, 2048, 1032, residuals)  # 256, H·F > 2^21
        assert not _mok.persistent_shape(4097, 8, 128, 2048, 1032, residuals)  # just over 256
        assert not _mok.persistent_shape(8192, 8, 128, 7168, 2048, residuals)  # 512, H = 7168
        assert not _mok.persistent_shape(256, 8, 128, 2048, 764, residuals)  # F % 8 != 0
        assert not _mok.persistent_shape(256, 8, 5000, 2048, 768, residuals)  # E > 4096
    # Fewer than 64 experts: up to 64 rows per expert, 128 without residuals.
    assert _mok.persistent_shape(1024, 4, 32, 1024, 1024)               # 128, E = 32
    assert not _mok.persistent_shape(1025, 4, 32, 1024, 1024)           # just over 128
    assert _mok.persistent_shape(512, 4, 32, 1024, 1024, residuals=True)  # 64
    assert not _mok.persistent_shape(513, 4, 32, 1024, 1024, residuals=True)
    assert not _mok.persistent_shape(1024, 4, 32, 1024, 1024, residuals=True)
    assert _mok.persistent_shape(512, 8, 63, 1024, 1024)                # 65 rows, E = 63
    assert not _mok.persistent_shape(1024, 8, 63, 1024, 1024)           # 130 rows
    assert not _mok.persistent_shape(512, 8, 63, 1024, 1024, residuals=True)
    # ... and without residuals up to 4096 for small experts with H >= 2048.
    assert _mok.persistent_shape(16384, 8, 32, 2048, 768)               # 4096, E = 32
    assert not _mok.persistent_shape(16385, 8, 32, 2048, 768)           # just over 4096
    assert not _mok.persistent_shape(16384, 8, 32, 2048, 768, residuals=True)
    assert _mok.persistent_shape(16384, 2, 8, 2048, 1024)               # 4096, E = 8
    assert _mok.persistent_shape(16384, 4, 16, 4096, 512)               # 4096, H = 4096
    assert not _mok.persistent_shape(16384, 4, 16, 1024, 1024)          # 4096, H = 1024
    assert not _mok.persistent_shape(16384, 4, 16, 2040, 1024)          # 4096, H = 2040
    assert _mok.persistent_shape(512, 4, 16, 2040, 1024)                # 128, H = 2040
    assert not _mok.persistent_shape(32768, 4, 32, 1024, 1024)          # the h200 preset's
    assert not _mok.persistent_shape(8192, 4, 32, 1024, 1024)           # 1024, H = 1024
    assert not _mok.persistent_shape(8192, 4, 32, 2048, 1032)           # 1024, H·F > 2^21
    assert _mok.persistent_shape(1024, 4, 32, 2048, 1032)               # 128, H·F > 2^21
    # The backward's kernel over 64 or more experts: up to 4096 rows per expert
    # for experts of H·F <= 2048·1024, 256 for larger ones.
    assert _mok.persistent_backward_shape(256, 8, 128, 2048, 768)      # 16 rows, E = 128
    assert _mok.persistent_backward_shape(1025, 8, 128, 2048, 768)     # just over 64
    assert _mok.persistent_backward_shape(16384, 8, 128, 2048, 768)    # 1024
    assert _mok.persistent_backward_shape(16384, 8, 64, 2048, 1024)    # 2048, E = 64
    assert _mok.persistent_backward_shape(65536, 8, 128, 2048, 768)    # 4096
    assert not _mok.persistent_backward_shape(65537, 8, 128, 2048, 768)  # just over 4096
    assert _mok.persistent_backward_shape(4096, 8, 128, 2048, 1032)    # 256, H·F > 2^21
    assert not _mok.persistent_backward_shape(4097, 8, 128, 2048, 1032)  # just over 256
    assert not _mok.persistent_backward_shape(256, 8, 63, 2048, 1024)   # 32.5 rows, E = 63
    assert not _mok.persistent_backward_shape(256, 2, 8, 4096, 14336)   # 64 rows, E = 8
    assert not _mok.persistent_backward_shape(256, 8, 128, 2048, 764)   # F % 8 != 0
    _mok.set_persistent_kernels(_mok.PersistentMode.OFF)
    try:
        assert not _mok.persistent_backward_shape(256, 8, 128, 2048, 768)
    finally:
        _mok.set_persistent_kernels(_mok.PersistentMode.AUTO)
    _mok.set_persistent_kernels(_mok.PersistentMode.ALWAYS)
    try:
        assert _mok.persistent_backward_shape(256, 8, 128, 2048, 768)
        assert _mok.persistent_backward_shape(256, 2, 8, 4096, 14336)
        assert _mok.persistent_backward_shape(16384, 8, 128, 2048, 768)
        assert not _mok.persistent_backward_shape(256, 8, 128, 2048, 764)
    finally:
        _mok.set_persistent_kernels(_mok.PersistentMode.AUTO)


def test_bitwise_deterministic_over_20_runs(persistent):
    args = _problem(2048, 8, 64, 512, 256, seed=8, skew=True)
    fwd = jax.jit(lambda *a: mok_jax.moe(*a))
    first = np.asarray(persistent(lambda: fwd(*args), True))
    for _ in range(19):
        np.testing.assert_array_equal(np.asarray(persistent(lambda: fwd(*args), True)), first)


def test_backward_bitwise_deterministic_over_20_runs(persistent):
    """The backward's tasks land on different CTAs from run to run; every gradient
    stays the same bits (each element reduced by one CTA, in a fixed order)."""
    step = _forward_and_grads(*_problem(2048, 8, 64, 512, 256, seed=9, skew=True))
    first = persistent(step, True)
    for _ in range(19):
        _assert_same(persistent(step, True), first)



# --- the EP role on virtual ranks ---------------------------------------------------------

VRANK_SHAPES = [(256, 8, 128, 2048, 768), (96, 3, 8, 136, 200),
                (512, 4, 8, 256, 128),  # 128-row tiles in the forward
                (8, 2, 8, 64, 72),      # one token per rank at P = 8
                # Enough tokens that every rank's combine tasks take eight tokens
                # at P = 1, 2, 4 and 8 (at least four such tasks a CTA on 132 SMs).
                (8704, 3, 8, 64, 72)]


def _vranks_grads(ids, fn):
    """A jitted (x, w, wgu, wd) -> (the four gradients of sum(y * cot), y), y =
    fn(x, ids, w, wgu, wd)."""

    def loss(x, w, wgu, wd):
        y = fn(x, ids, w, wgu, wd)
        cot = jnp.cos(jnp.arange(x.shape[1], dtype=jnp.float32))
        return jnp.sum(y.astype(jnp.float32) * cot), y

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", VRANK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_virtual_ranks_give_the_one_device_bits(ranks, shape):
    """P ranks in one launch per pass, each with its own windows: y and every
    gradient bit for bit the EP=1 layer's (`mok_jax.moe`, whichever path its mode
    picks: all give the same bits), skewed routing (empty experts, experts past one
    64-row block), invalid ids and capacity drops, f32 and bf16 combine weights."""
    T, K, E, H, F = shape
    for weight_dtype in (jnp.float32, jnp.bfloat16):
        x, ids, w, wgu, wd = _problem(*shape, seed=11, skew=True, weight_dtype=weight_dtype)
        ids = ids.at[::7, 0].set(E + 3).at[1::11, K - 1].set(-1)
        for cap in (None, max(1, T * K // E // 2)):
            cf = None if cap is None else cap * E / (T * K)
            assert mok_jax.capacity(cf, T, K, E) == cap
            one = lambda *a: mok_jax.moe(*a, capacity_factor=cf)
            ranked = lambda *a: ep.moe_on_virtual_ranks(*a, ranks=ranks, capacity=cap)
            want = jax.jit(one)(x, ids, w, wgu, wd)
            _assert_same(jax.jit(ranked)(x, ids, w, wgu, wd), want)
            grads, y = _vranks_grads(ids, ranked)(x, w, wgu, wd)
            grads_want, y_want = _vranks_grads(ids, one)(x, w, wgu, wd)
            _assert_same(y, want)
            _assert_same(y_want, want)
            _assert_same(grads, grads_want)


def test_virtual_ranks_repeat_bit_for_bit():
    """20 runs of each pass at P = 4 (the backward at a shape whose gradients are
    small enough to compare 20 times on the host in seconds)."""
    x, ids, w, wgu, wd = _problem(256, 8, 128, 2048, 768, seed=12)
    f = jax.jit(lambda *a: ep.moe_on_virtual_ranks(*a, ranks=4))
    first = f(x, ids, w, wgu, wd)
    for _ in range(19):
        _assert_same(f(x, ids, w, wgu, wd), first)
    x, ids, w, wgu, wd = _problem(2048, 8, 64, 512, 256, seed=12, skew=True)
    step = _vranks_grads(ids, lambda *a: ep.moe_on_virtual_ranks(*a, ranks=4))
    first = step(x, w, wgu, wd)
    for _ in range(19):
        _assert_same(step(x, w, wgu, wd), first)
