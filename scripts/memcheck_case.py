"""A small forward + backward of mok_jax.moe (and mok_jax.add_rms_norm) for
compute-sanitizer (scripts/gpu_ci.sh).

Covers both GEMM paths (tensor-core sizes and odd sizes), GEMM1 with SwiGLU in its
epilogue (on sm_90a), the persistent forward (64- and 128-row tiles, and its EP
role on virtual ranks) and backward (forced on, sm_90a; its EP role on virtual
ranks too), capacity drops,
invalid ids and an empty expert, so memcheck sees every kernel; then the fused
residual add + RMSNorm on rows of every team width, with row counts that end a
scale-gradient group part way.

In the persistent cases, y and every gradient must also be the kernel chain's bits
(with virtual ranks, the one-device chain's), computed in the same process after
them: a run under racecheck or synccheck that reports nothing still checks what the
instrumented kernels computed (the chain's kernels run uninstrumented under
`--kernel-name kns=_persistent`).

`--persistent-only` runs the persistent-kernel cases alone; `--persistent-case I`
runs the I-th of them alone (I < PERSISTENT_CASES; `--repeat N` after it runs
its jitted step N times, each compared), for `--kernel-name
kns=_persistent` runs of racecheck and synccheck one case per process (over all
cases in one process both ended in a segmentation fault of the host process
after the first case, with no report, on 2026-12-04).
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import mok_jax


def the_chains_bits(name, outs, compute):
    """Asserts that each of `outs` (y and the gradients, as computed, once per
    repeat) has the bits of compute() run on the kernel chain (the persistent
    kernels off)."""
    from mok_jax import _mok
    previous = _mok.set_persistent_kernels(_mok.PersistentMode.OFF)
    try:
        want = jax.tree.leaves(jax.block_until_ready(compute()))
    finally:
        _mok.set_persistent_kernels(previous)
    for run, out in enumerate(outs):
        got = jax.tree.leaves(out)
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(got, want)):
            a, b = np.asarray(a), np.asarray(b)
            if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
                bad = (int(np.sum(a.view(np.uint8) != b.view(np.uint8)))
                       if a.shape == b.shape else -1)
                raise AssertionError(f"{name}, run {run + 1}: output {i} of y and the "
                                     f"gradients ({a.dtype}{list(a.shape)}) is not the "
                                     f"kernel chain's: {bad} bytes differ")


def y_and_grads(loss):
    """Jitted: (y, the gradients w.r.t. x, w, w_gate_up, w_down) of loss(...) ->
    (value, y)."""
    def f(*args):
        (_, y), g = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(*args)
        return y, g
    return jax.jit(f)


def run(T, K, E, H, F, dtype, capacity_factor, against_chain=False, repeat=1):
    ks = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(ks[0], (T, H)).astype(dtype)
    w, ids = jax.lax.top_k(jax.nn.softmax(jax.random.normal(ks[1], (T, E))), K)
    ids = ids.astype(jnp.int32).at[0, 0].set(-1).at[1, 0].set(E)
    ids = jnp.where(ids == E - 1, 0, ids)  # expert E-1 stays empty
    wgu = (jax.random.normal(ks[2], (E, H, 2 * F)) * H**-0.5).astype(dtype)
    wd = (jax.random.normal(ks[3], (E, F, H)) * F**-0.5).astype(dtype)

    def loss(x, w, wgu, wd):  # the loss's value is XLA's sum: y is compared instead
        y = mok_jax.moe(x, ids, w, wgu, wd, capacity_factor=capacity_factor)
        return y.astype(jnp.float32).sum(), y

    step = y_and_grads(loss)
    outs = [jax.block_until_ready(step(x, w, wgu, wd)) for _ in range(repeat)]
    case = f"T={T} K={K} E={E} H={H} F={F} {jnp.dtype(dtype).name} cf={capacity_factor}"
    if against_chain:
        the_chains_bits(case, outs, lambda: step(x, w, wgu, wd))
        case += f", the kernel chain's bits ({repeat} run{'s' * (repeat > 1)})"
    print(f"ok {case}")


def run_norm(rows, dim, dtype):
    ks = jax.random.split(jax.random.key(1), 3)
    x, b = (jax.random.normal(k, (rows, dim)).astype(dtype) for k in ks[:2])
    scale = jax.random.normal(ks[2], (dim,))

    def loss(x, b, scale):
        s, n = mok_jax.add_rms_norm(x, b, scale)
        return (s.astype(jnp.float32) * n.astype(jnp.float32)).sum()

    jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, b, scale))
    print(f"ok add_rms_norm rows={rows} dim={dim} {jnp.dtype(dtype).name}")


def persistent_cases(repeat=1):
    """The persistent kernels (forward and backward) forced on: rows past a 64-row
    block, H and F not multiples of the 64-wide tiles, capacity drops, T below a
    block; then the EP role on virtual ranks (each rank's windows its own), both
    tile heights; then the backward's 128-row blocks with H > F + 256, whose
    SwiGLU tasks stream dy rows in stages of their own; then enough tokens for
    combine tasks of eight tokens (at least 32 a CTA on 132 SMs), on one rank and
    on two virtual ranks."""
    def one(*shape):
        return lambda: run(*shape, against_chain=True, repeat=repeat)
    return [one(200, 2, 6, 128, 64, jnp.bfloat16, None),
            one(100, 2, 4, 136, 200, jnp.bfloat16, 0.5),
            one(3, 2, 3, 8, 8, jnp.bfloat16, None),
            lambda: run_virtual_ranks(96, 3, 8, 136, 200, 4, repeat),
            lambda: run_virtual_ranks(512, 4, 8, 256, 128, 2, repeat),
            one(600, 2, 4, 520, 136, jnp.bfloat16, None),
            one(4352, 2, 4, 64, 72, jnp.bfloat16, None),
            lambda: run_virtual_ranks(8704, 3, 8, 64, 72, 2, repeat)]


PERSISTENT_CASES = 8


def run_persistent(only=None, repeat=1):
    """The persistent cases (all, or the `only`-th) with the persistent kernels
    forced on; nothing where the build has no sm_90a code."""
    from mok_jax import _mok
    if not hasattr(_mok, "set_persistent_kernels"):  # no sm_90a code in this build
        return
    cases = persistent_cases(repeat)
    assert len(cases) == PERSISTENT_CASES
    previous = _mok.set_persistent_kernels(_mok.PersistentMode.ALWAYS)
    try:
        assert _mok.persistent_shape(100, 2, 4, 136, 200)
        assert _mok.persistent_backward_shape(100, 2, 4, 136, 200)
        assert _mok.persistent_tile_rows(200, 2, 6, 128, 64) == 128
        assert _mok.persistent_tile_rows(100, 2, 4, 136, 200) == 64
        for i, case in enumerate(cases):
            if only is None or i == only:
                case()
    finally:
        _mok.set_persistent_kernels(previous)


def run_virtual_ranks(T, K, E, H, F, ranks, repeat=1):
    from mok_jax._src import ep
    ks = jax.random.split(jax.random.key(2), 4)
    x = jax.random.normal(ks[0], (T, H)).astype(jnp.bfloat16)
    w, ids = jax.lax.top_k(jax.nn.softmax(jax.random.normal(ks[1], (T, E))), K)
    ids = ids.astype(jnp.int32).at[0, 0].set(-1)
    wgu = (jax.random.normal(ks[2], (E, H, 2 * F)) * H**-0.5).astype(jnp.bfloat16)
    wd = (jax.random.normal(ks[3], (E, F, H)) * F**-0.5).astype(jnp.bfloat16)

    cap = T * K // E

    def loss(x, w, wgu, wd):
        y = ep.moe_on_virtual_ranks(x, ids, w, wgu, wd, ranks=ranks, capacity=cap)
        return y.astype(jnp.float32).sum(), y

    def loss_one_device(x, w, wgu, wd):
        y = mok_jax.moe(x, ids, w, wgu, wd, capacity_factor=cap * E / (T * K))
        return y.astype(jnp.float32).sum(), y

    assert mok_jax.capacity(cap * E / (T * K), T, K, E) == cap
    step = y_and_grads(loss)
    outs = [jax.block_until_ready(step(x, w, wgu, wd)) for _ in range(repeat)]
    case = f"virtual ranks P={ranks} T={T} K={K} E={E} H={H} F={F} (forward + backward)"
    the_chains_bits(case, outs, lambda: y_and_grads(loss_one_device)(x, w, wgu, wd))
    print(f"ok {case}, the one-device kernel chain's bits ({repeat} run{'s' * (repeat > 1)})")


if __name__ == "__main__":
    if sys.argv[1:] == ["--persistent-only"]:
        run_persistent()
        sys.exit(0)
    if len(sys.argv) in (3, 5) and sys.argv[1] == "--persistent-case":
        index = int(sys.argv[2])
        if not 0 <= index < PERSISTENT_CASES:
            sys.exit(f"--persistent-case takes 0..{PERSISTENT_CASES - 1}, not {index}")
        repeat = 1
        if len(sys.argv) == 5:
            if sys.argv[3] != "--repeat" or int(sys.argv[4]) < 1:
                sys.exit("usage: --persistent-case I [--repeat N], N >= 1")
            repeat = int(sys.argv[4])
        run_persistent(only=index, repeat=repeat)
        sys.exit(0)
    run(200, 2, 6, 128, 64, jnp.bfloat16, None)
    run(200, 2, 6, 128, 64, jnp.bfloat16, 0.5)
    run(37, 3, 5, 24, 5, jnp.bfloat16, None)
    run(37, 3, 5, 24, 5, jnp.float32, 0.8)
    # F % 128 == 0 and 4*E*H <= T*K: the SwiGLU-epilogue GEMM (ragged tiles in the second).
    from mok_jax import _mok
    assert _mok.swiglu_epilogue_shape(4, 64, 256, 512 * 4)
    assert _mok.swiglu_epilogue_shape(4, 16, 128, 300 * 2)
    run(512, 4, 4, 64, 256, jnp.bfloat16, None)
    run(300, 2, 4, 16, 128, jnp.bfloat16, 0.75)
    run_persistent()  # one kernel per pass after the routing plan
    for rows, dim, dtype in ((37, 1024, jnp.bfloat16), (5, 2056, jnp.bfloat16),
                             (9, 4096, jnp.bfloat16), (6, 8192, jnp.bfloat16),
                             (17, 16384, jnp.bfloat16), (3, 8, jnp.bfloat16),
                             (7, 1024, jnp.float32), (5, 4096, jnp.float32),
                             (19, 8192, jnp.float32), (9, 200, jnp.float32)):
        run_norm(rows, dim, dtype)
