"""The extension's registrations, the platform guard of mok_jax.moe, and the
platform the tests run on."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conftest
import mok_jax
from conftest import (compilation_cache_wanted, jax_cuda_plugin_installed, platforms_for_tests,
                      script_env)
from mok_jax import _mok
from mok_jax._src import ext


def _tiny_problem():
    x = jnp.ones((4, 8), jnp.float32)
    ids = jnp.array([[0, 1]] * 4, jnp.int32)
    w = jnp.full((4, 2), 0.5, jnp.float32)
    return x, ids, w, jnp.ones((2, 8, 6), jnp.float32), jnp.ones((2, 3, 8), jnp.float32)


def test_cpu_handlers_are_registered():
    regs = _mok.registrations()
    assert set(regs["cpu"]) == {ext.MOE_FORWARD, ext.MOE_BACKWARD, ext.EXPERT_FFN_FORWARD,
                                ext.EXPERT_FFN_BACKWARD, ext.COMBINE,
                                ext.QUANTIZE_ROWS_FP8}
    assert "cpu" in ext.registered_platforms()


def test_dtype_enum_is_exported():
    assert int(_mok.DType.F32) == 0 and int(_mok.DType.BF16) == 1
    assert _mok.NO_CAPACITY == mok_jax._src.primitives.NO_CAPACITY


def test_lowering_names_the_ffi_targets():
    hlo = jax.jit(lambda *a: mok_jax.moe(*a)).lower(*_tiny_problem()).as_text()
    assert f"@{ext.MOE_FORWARD}" in hlo
    grad_hlo = jax.jit(jax.grad(lambda x, *a: mok_jax.moe(x, *a).sum())).lower(
        *_tiny_problem()).as_text()
    assert f"@{ext.MOE_BACKWARD}" in grad_hlo


def test_a_build_without_cuda_handlers_pins_the_tests_to_the_cpu():
    """conftest.py runs the session on the CPU when the installed mok_jax has no CUDA
    handlers (JAX's default backend may be a GPU, where such a build cannot run), and
    leaves the choice to JAX when it has them."""
    assert platforms_for_tests(cuda_kernels=False) == "cpu"
    assert platforms_for_tests(cuda_kernels=True) is None
    if mok_jax.build_info().cuda_kernels:
        assert conftest.PINNED_PLATFORMS is None
        assert "cuda" in ext.registered_platforms()
    else:
        assert conftest.PINNED_PLATFORMS == "cpu"
        assert jax.config.jax_platforms == "cpu" and os.environ["JAX_PLATFORMS"] == "cpu"
        assert {d.platform for d in jax.devices()} == {"cpu"}
        assert "cuda" not in ext.registered_platforms()


def test_the_compilation_cache_is_used_only_where_jax_runs_on_the_cpu_alone():
    assert compilation_cache_wanted("cpu", jax_gpu_plugin=True)
    assert compilation_cache_wanted("", jax_gpu_plugin=False)
    assert not compilation_cache_wanted("", jax_gpu_plugin=True)
    assert not compilation_cache_wanted("cuda", jax_gpu_plugin=True)
    wanted = compilation_cache_wanted(os.environ.get("JAX_PLATFORMS", ""),
                                      jax_cuda_plugin_installed())
    assert (conftest.JAX_CACHE_DIR is not None) == wanted
    # and XLA's CPU backend at optimization level 0 there, never on a GPU machine
    level = "--xla_backend_optimization_level"
    assert (level in os.environ.get("XLA_FLAGS", "")) == wanted


def test_scripts_get_this_mok_jax_first_and_every_xla_flag_but_the_host_device_count(
        monkeypatch):
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(mok_jax.__file__)))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    flags = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert script_env()["XLA_FLAGS"] == flags
    env = script_env(host_devices=False)
    assert env["XLA_FLAGS"] == "--xla_backend_optimization_level=0"
    assert env["PYTHONPATH"] == os.pathsep.join((package_root, "/elsewhere"))
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert "XLA_FLAGS" not in script_env(host_devices=False)


@pytest.mark.gpu
def test_gpu_call_runs_with_the_cuda_handlers():
    # A session on a GPU has them: without them conftest.py pins it to the CPU.
    problem = jax.device_put(_tiny_problem(), jax.devices("gpu")[0])
    y = mok_jax.moe(*problem)
    # Every gate and up value is 8, h = silu(8) * 8 on F = 3 columns, summed by an
    # all-ones w_down and weighted 0.5 twice: 3 * 64 * sigmoid(8) everywhere.
    np.testing.assert_allclose(np.asarray(y), 192 / (1 + np.exp(-8.0)), rtol=1e-5)


def test_lowering_for_a_gpu_says_how_to_rebuild_a_build_without_cuda_handlers():
    """What a GPU user of a CPU-only build meets, checked with no GPU: lowering
    mok_jax.moe for the cuda platform (JAX's cross-platform lowering) is a
    RuntimeError that says how to rebuild; a build with CUDA handlers lowers it to
    them."""
    def lowered():
        return jax.jit(lambda *a: mok_jax.moe(*a)).trace(*_tiny_problem()).lower(
            lowering_platforms=("cuda",))

    if "cuda" in ext.registered_platforms():
        assert f"@{ext.MOE_FORWARD}" in lowered().as_text()
    else:
        with pytest.raises(RuntimeError, match=r"built without its CUDA handlers.*"
                                               r"MOK_CUDA=13 pip install"):
            lowered()


def test_a_build_without_cuda_handlers_on_a_gpu_says_how_to_rebuild(tmp_path):
    """On a machine where JAX has a GPU, mok_jax.moe on that GPU from a build without
    CUDA handlers is a RuntimeError that says how to rebuild. This session runs on
    the CPU then (conftest.py), so the call runs in a fresh process where JAX picks
    the GPU."""
    if "cuda" in ext.registered_platforms():
        pytest.skip("this build has its CUDA handlers (test_gpu_call_runs_with_the_cuda_handlers)")
    if not jax_cuda_plugin_installed():
        pytest.skip("JAX has no CUDA plugin here")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    code = ("import jax, jax.numpy as jnp, mok_jax\n"
            "if jax.default_backend() != 'gpu':\n"
            "    print('no gpu'); raise SystemExit\n"
            "x = jnp.ones((4, 8)); ids = jnp.zeros((4, 2), jnp.int32)\n"
            "try:\n"
            "    jax.block_until_ready(mok_jax.moe(x, ids, jnp.ones((4, 2)), jnp.ones((2, 8, 6)),"
            " jnp.ones((2, 3, 8))))\n"
            "except RuntimeError as err:\n"
            "    print('RuntimeError:', err)\n"
            "else:\n"
            "    print('ran')\n")
    proc = _run_with_this_mok_jax(code, env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    if proc.stdout.strip() == "no gpu":
        pytest.skip("JAX found no GPU")
    assert "RuntimeError:" in proc.stdout and "MOK_ENABLE_CUDA=ON" in proc.stdout, proc.stdout


def _package_root():
    """The folder holding the mok_jax this process imported (installed, or a dev
    build's source tree), for PYTHONPATH: a script run from a scratch folder then
    imports the same one."""
    return os.path.dirname(os.path.dirname(os.path.abspath(mok_jax.__file__)))


def _run_with_this_mok_jax(code, env, cwd):
    """Runs `code` in a fresh Python with `env`, importing the mok_jax this process
    imported (PYTHONPATH gets its folder first)."""
    env = {**env, "PYTHONPATH": os.pathsep.join(
        p for p in (_package_root(), env.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=cwd, check=False)


@pytest.mark.slow
def test_import_and_a_cpu_call_never_load_the_nccl_transport(tmp_path):
    """mok_jax._mok_comm links libnccl; only backend="fused" under EP imports it.
    JAX's own CUDA plugin, where installed, may map a libnccl when JAX starts (even
    on the CPU platform): the check is that mok_jax maps none beyond those."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    code = ("import sys, jax.numpy as jnp\n"
            "def nccl():\n"
            "    return {l.split()[-1] for l in open('/proc/self/maps') if 'libnccl' in l}\n"
            "x = jnp.ones((4, 8)); ids = jnp.zeros((4, 2), jnp.int32)\n"
            "jax_own = nccl()\n"
            "import mok_jax\n"
            "mok_jax.moe(x, ids, jnp.ones((4, 2)), jnp.ones((2, 8, 6)), jnp.ones((2, 3, 8)),"
            " backend='xla').block_until_ready()\n"
            "assert 'mok_jax._mok_comm' not in sys.modules, 'transport loaded'\n"
            "assert nccl() == jax_own, f'libnccl mapped: {nccl() - jax_own}'\n"
            "print('ok')\n")
    proc = _run_with_this_mok_jax(code, env, tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
