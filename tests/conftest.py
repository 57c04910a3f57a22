"""Shared test set-up for mok_jax: host devices, platform, compilation cache,
markers, random MoE problems.

Everything that must happen before JAX initializes its backends lives at the top of
this file: pytest imports conftest.py before any test module, so what is set here
holds for the whole session, and the environment variables for the scripts the
tests start as well:

* XLA_FLAGS: 8 host devices on CPU (the EP tests want them).
* JAX_PLATFORMS=cpu when the installed mok_jax has no CUDA handlers (a CPU-only
  build, as the README's test command installs): on a machine with a GPU, JAX would
  otherwise run everything there, where such a build has no handlers. The GPU tests
  are then skipped by marker and the CPU tests run on the CPU.
* Where JAX can only run on the CPU here (the platform pinned to the CPU, or no
  JAX CUDA plugin installed), XLA's CPU backend at LLVM optimization level 0
  (--xla_backend_optimization_level=0) and a persistent JAX compilation cache in
  a fresh directory of this pytest run (removed at its end): a program that a test, an
  example run in-process or a script the tests start has compiled is loaded, not
  compiled again, by the next one that builds the same program (the key is the
  program's text, the compile options, XLA_FLAGS, the devices and jaxlib's
  version). Nothing from an earlier run or another build is reused. Not on GPUs:
  there the cache compresses every executable it writes with zlib, and a GPU
  test's executable can hold a gigabyte of constants (minutes to compress).
  Compiling dominates the CPU tests' time, and at level 0 XLA compiles a
  training step of the examples in two thirds of the time.
  The programs compute the same functions (XLA does not enable fast-math either
  way); mok_jax's CPU kernels are compiled C++, which no XLA flag reaches.
"""

import contextlib
import importlib.util
import os
import re
import shutil
import sys
import tempfile

_HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"
if _HOST_DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" {_HOST_DEVICES_FLAG}=8"
    ).strip()

import jax  # noqa: E402  (must come after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def platforms_for_tests(cuda_kernels: bool) -> str | None:
    """The JAX platforms the tests must run on, given whether the installed mok_jax
    has its CUDA handlers (``mok_jax.build_info().cuda_kernels``): "cpu" without
    them (JAX's default backend may be a GPU, where that build cannot run), else
    None (JAX chooses)."""
    return None if cuda_kernels else "cpu"


try:
    # _mok.CUDA_KERNELS is what build_info() reports as cuda_kernels; build_info()
    # itself would load the NVLink transport (and libnccl) into this process.
    from mok_jax import _mok as _installed_mok
except ImportError:  # no built mok_jax: the test modules say so when they import it
    PINNED_PLATFORMS = None
else:
    PINNED_PLATFORMS = platforms_for_tests(bool(_installed_mok.CUDA_KERNELS))
if PINNED_PLATFORMS is not None:
    os.environ["JAX_PLATFORMS"] = PINNED_PLATFORMS  # the scripts the tests start
    jax.config.update("jax_platforms", PINNED_PLATFORMS)  # before any backend starts


def jax_cuda_plugin_installed() -> bool:
    """Whether JAX's CUDA plugin is installed (jax[cuda12] / jax[cuda13]), found
    without starting JAX's GPU backend."""
    return any(importlib.util.find_spec(f"jax_cuda{v}_plugin") is not None for v in (12, 13))


def compilation_cache_wanted(platforms: str, jax_gpu_plugin: bool) -> bool:
    """Whether the tests use a compilation cache: only where JAX runs on the CPU
    alone (`platforms`, JAX_PLATFORMS as set, is "cpu", or JAX has no GPU plugin)."""
    return platforms == "cpu" or not jax_gpu_plugin


# The compilation cache, for this process and the scripts it starts (which read the
# variable when they import jax). JAX writes the programs that took at least a
# second to compile (jax_persistent_cache_min_compile_time_secs): the train steps
# of the examples, which several tests build alike. Caching every program (a
# threshold of 0) made the fast set slower, 412 s against 376 s (2026-12-03, two
# x86 cores): its many small programs almost never recur. A second copy of this
# module, as --import-mode=importlib makes, keeps the first one's directory, and so do
# pytest-xdist's workers (-n), which inherit the variable from the process that
# starts them: they share one cache, which only that process removes.
_CPU_OPT_LEVEL_FLAG = "--xla_backend_optimization_level"
JAX_CACHE_DIR = None
OWNS_JAX_CACHE_DIR = False
if compilation_cache_wanted(os.environ.get("JAX_PLATFORMS", ""), jax_cuda_plugin_installed()):
    JAX_CACHE_DIR = os.environ.get("MOK_JAX_TESTS_JAX_CACHE_DIR", "")
    if not os.path.isdir(JAX_CACHE_DIR):
        JAX_CACHE_DIR = tempfile.mkdtemp(prefix="mok_jax_tests_jax_cache_")
        os.environ["MOK_JAX_TESTS_JAX_CACHE_DIR"] = JAX_CACHE_DIR
        OWNS_JAX_CACHE_DIR = True
    os.environ["JAX_COMPILATION_CACHE_DIR"] = JAX_CACHE_DIR
    jax.config.update("jax_compilation_cache_dir", JAX_CACHE_DIR)
    # Read when JAX starts its first backend, which nothing above has done.
    if _CPU_OPT_LEVEL_FLAG not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += f" {_CPU_OPT_LEVEL_FLAG}=0"


def load_script(name: str):
    """scripts/<name>.py as a module (scripts/ is not a package), for the tests of the
    repository's tools."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "scripts", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script_env(*, host_devices: bool = True) -> dict:
    """This process's environment for a script a test starts. The mok_jax this
    process imported (the installed package, or the source tree of a development
    build) comes first on PYTHONPATH, which precedes site-packages. With
    host_devices=False, for a script that chooses its own device count: XLA_FLAGS
    without conftest's 8 host devices (its other flags kept)."""
    import mok_jax  # here: conftest itself loads without a built mok_jax
    env = dict(os.environ)
    if not host_devices:
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith(_HOST_DEVICES_FLAG)]
        env["XLA_FLAGS"] = " ".join(flags)
        if not env["XLA_FLAGS"]:
            del env["XLA_FLAGS"]
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(mok_jax.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


# The reference's f32 matmuls must be true f32 on GPUs too (XLA may otherwise use
# TF32 there), or the contract's 1e-5 f32 tolerance would measure the oracle.
jax.config.update("jax_default_matmul_precision", "highest")

BF16 = np.dtype(jnp.bfloat16)

# Text that points at the project's old private design document, which is not in the
# repository (docs/contract.md is the contract). Spelled in pieces so that the
# pattern does not match itself in this file.
_DIR, _DOC = "../" + "shar" + "ed", "DES" + "IGN"
PRIVATE_DOC_REF = re.compile("|".join(re.escape(p) for p in (_DIR, _DIR[3:] + "/" + _DOC,
                                                              _DOC)))

# Test modules do `from conftest import make_problem, ...`. That works under pytest's
# default import mode; putting this directory on sys.path keeps it working under
# --import-mode=importlib too (the helpers below are pure functions, so a second copy
# of this module is harmless).
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    # Also registered in pyproject.toml; registering twice is harmless and keeps
    # `pytest tests` working from any directory with --strict-markers.
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped on CPU)")
    config.addinivalue_line("markers", "multigpu: needs at least 2 CUDA GPUs")
    config.addinivalue_line("markers", "slow: CPU tests of several seconds each (-m slow)")


def pytest_unconfigure(config):
    if OWNS_JAX_CACHE_DIR:
        shutil.rmtree(JAX_CACHE_DIR, ignore_errors=True)


def _num_gpus():
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:  # no GPU backend in this jaxlib / on this machine
        return 0


def pytest_collection_modifyitems(config, items):
    marked = [it for it in items if "gpu" in it.keywords or "multigpu" in it.keywords]
    if not marked:
        return  # do not initialize a backend just to skip nothing
    gpus = _num_gpus() if jax.devices()[0].platform == "gpu" else 0
    skip_gpu = pytest.mark.skip(reason="needs a GPU (jax.devices()[0] is not a GPU)")
    skip_multi = pytest.mark.skip(reason=f"needs >= 2 GPUs, found {gpus}")
    for it in marked:
        if "multigpu" in it.keywords and gpus < 2:
            it.add_marker(skip_multi)
        elif "gpu" in it.keywords and gpus < 1:
            it.add_marker(skip_gpu)


# --------------------------------------------------------------------------------------
# Random problems
# --------------------------------------------------------------------------------------


def _rng(key_or_seed):
    if isinstance(key_or_seed, (int, np.integer)):
        return np.random.default_rng(int(key_or_seed))
    # A JAX PRNG key (new-style or raw uint32): derive a NumPy seed from it, so that
    # problems are made host-side without compiling one jax.random op per shape.
    bits = np.asarray(jax.random.bits(key_or_seed, (2,), jnp.uint32), dtype=np.uint64)
    return np.random.default_rng(int(bits[0] << np.uint64(32) | bits[1]))


def make_problem(key_or_seed, T, K, E, H, F, dtype=jnp.float32, *,
                 weights_dtype=jnp.float32, routing="topk", expert=0):
    """A random MoE problem as JAX arrays `(x, ids, weights, w_gate_up, w_down)`.

    Shapes: x [T, H] dtype; ids [T, K] int32; weights [T, K] weights_dtype;
    w_gate_up [E, H, 2F] dtype; w_down [E, F, H] dtype.

    routing="topk": ids are the top-K of random router scores (distinct per token)
    and weights their softmax, as a router would produce. routing="one": every pair
    goes to `expert` (ids repeat within a token; requires nothing of K vs E).
    Weight matrices are scaled by 1/sqrt(fan_in) so g, u, h, o and y stay O(1) and
    relative error norms are meaningful.
    """
    rng = _rng(key_or_seed)
    x = rng.standard_normal((T, H), dtype=np.float32)
    scores = rng.standard_normal((T, E), dtype=np.float32)
    if routing == "topk":
        assert K <= E, (K, E)
        ids = np.argsort(-scores, axis=1, kind="stable")[:, :K].astype(np.int32)
        top = np.take_along_axis(scores, ids, axis=1)
    elif routing == "one":
        ids = np.full((T, K), expert, np.int32)
        top = scores[:, :K] if K <= E else rng.standard_normal((T, K), dtype=np.float32)
    else:
        raise ValueError(f"unknown routing {routing!r}")
    weights = np.exp(top - top.max(axis=1, keepdims=True))
    weights = (weights / weights.sum(axis=1, keepdims=True)).astype(np.float32)
    wgu = rng.standard_normal((E, H, 2 * F), dtype=np.float32) / np.sqrt(H)
    wd = rng.standard_normal((E, F, H), dtype=np.float32) / np.sqrt(F)
    return (
        jnp.asarray(x, dtype),
        jnp.asarray(ids),
        jnp.asarray(weights, weights_dtype),
        jnp.asarray(wgu, dtype),
        jnp.asarray(wd, dtype),
    )


def np_stats(ids, E, capacity=None):
    """NumPy routing oracle: (tokens_per_expert [E], dropped, invalid, keep [T, K]).

    Pairs are visited in (token, k) order; each expert keeps its first `capacity`
    valid pairs. Invalid ids (< 0 or >= E) are neither routed nor dropped.
    """
    ids = np.asarray(ids)
    T, K = ids.shape
    tpe = np.zeros(E, np.int64)
    keep = np.zeros((T, K), bool)
    invalid = dropped = 0
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            if not 0 <= e < E:
                invalid += 1
                continue
            if capacity is None or tpe[e] < capacity:
                keep[t, k] = True
            else:
                dropped += 1
            tpe[e] += 1
    return tpe, dropped, invalid, keep


def rel_fro(got, want):
    """||got - want||_F / ||want||_F in float64 (0 when both are 0)."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    num = np.linalg.norm((got - want).ravel())
    den = np.linalg.norm(want.ravel())
    return num / den if den > 0 else num


def assert_close(got, want, dtype, *, f32_tol=1e-5, bf16_tol=2e-2, what=""):
    """The contract's tolerances: f32 1e-5 relative (Frobenius and elementwise with
    atol scaled by max|want|), bf16 2e-2 relative Frobenius."""
    got64 = np.asarray(got, np.float64)
    want64 = np.asarray(want, np.float64)
    assert got64.shape == want64.shape, (what, got64.shape, want64.shape)
    err = rel_fro(got64, want64)
    if np.dtype(dtype) == np.float32:
        assert err <= f32_tol, f"{what}: relative Frobenius error {err:.3g} > {f32_tol}"
        atol = f32_tol * max(float(np.max(np.abs(want64), initial=0.0)), 1e-30)
        np.testing.assert_allclose(got64, want64, rtol=f32_tol, atol=atol, err_msg=what)
    else:
        assert err <= bf16_tol, f"{what}: relative Frobenius error {err:.3g} > {bf16_tol}"


def assert_usage_error(capsys, run, message):
    """``run()`` exits as argparse does for a usage error (status 2), saying `message`."""
    with pytest.raises(SystemExit) as exit_info:
        run()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err, err


def bits(a):
    """The raw bits of an array, for exact (bitwise) comparisons incl. NaN payloads."""
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}")) if a.dtype.kind == "f" or a.dtype == BF16 else a


def assert_bitwise(a, b, what=""):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    diff = np.flatnonzero(bits(a).ravel() != bits(b).ravel())
    assert diff.size == 0, (
        f"{what}: {diff.size} of {a.size} elements differ in bits; first at flat index "
        f"{diff[0]}: {a.ravel()[diff[0]]!r} vs {b.ravel()[diff[0]]!r}"
    )


@contextlib.contextmanager
def cpu_threads(n: int):
    """The CPU handlers run on n threads inside the block
    (``mok_jax._mok.set_cpu_threads``); the previous setting holds again after it."""
    from mok_jax import _mok
    previous = _mok.set_cpu_threads(n)
    try:
        assert _mok.cpu_threads() == n
        yield
    finally:
        _mok.set_cpu_threads(previous)
