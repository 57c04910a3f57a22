"""The extension's registrations and the platform guard of mok_jax.moe."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax
from mok_jax import _ext, _mok


def _tiny_problem():
    x = jnp.ones((4, 8), jnp.float32)
    ids = jnp.array([[0, 1]] * 4, jnp.int32)
    w = jnp.full((4, 2), 0.5, jnp.float32)
    return x, ids, w, jnp.ones((2, 8, 6), jnp.float32), jnp.ones((2, 3, 8), jnp.float32)


def test_cpu_handlers_are_registered():
    regs = _mok.registrations()
    assert set(regs["cpu"]) == {_ext.MOE_FORWARD, _ext.MOE_BACKWARD, _ext.EXPERT_FFN_FORWARD,
                                _ext.EXPERT_FFN_BACKWARD, _ext.COMBINE,
                                _ext.QUANTIZE_ROWS_FP8}
    assert "cpu" in _ext.registered_platforms()


def test_dtype_enum_is_exported():
    assert int(_mok.DType.F32) == 0 and int(_mok.DType.BF16) == 1
    assert _mok.NO_CAPACITY == mok_jax.primitives.NO_CAPACITY


def test_lowering_names_the_ffi_targets():
    hlo = jax.jit(lambda *a: mok_jax.moe(*a)).lower(*_tiny_problem()).as_text()
    assert f"@{_ext.MOE_FORWARD}" in hlo
    grad_hlo = jax.jit(jax.grad(lambda x, *a: mok_jax.moe(x, *a).sum())).lower(
        *_tiny_problem()).as_text()
    assert f"@{_ext.MOE_BACKWARD}" in grad_hlo


@pytest.mark.gpu
def test_gpu_without_cuda_handlers_says_how_to_rebuild():
    problem = jax.device_put(_tiny_problem(), jax.devices("gpu")[0])
    if "cuda" in _ext.registered_platforms():
        y = mok_jax.moe(*problem)
        assert np.isfinite(np.asarray(y)).all()
    else:
        with pytest.raises(RuntimeError, match="MOK_ENABLE_CUDA=ON"):
            jax.block_until_ready(mok_jax.moe(*problem))


@pytest.mark.slow
def test_import_and_a_cpu_call_never_load_the_nccl_transport(tmp_path):
    """mok_jax._mok_comm links libnccl; only backend="fused" under EP imports it."""
    import os
    import subprocess
    import sys
    # The mok_jax this process imported (installed, or a dev build's source tree),
    # from a folder where no source tree shadows it.
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(mok_jax.__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(p for p in (package_root,
                                                     os.environ.get("PYTHONPATH")) if p)}
    code = ("import sys, jax.numpy as jnp, mok_jax\n"
            "x = jnp.ones((4, 8)); ids = jnp.zeros((4, 2), jnp.int32)\n"
            "mok_jax.moe(x, ids, jnp.ones((4, 2)), jnp.ones((2, 8, 6)), jnp.ones((2, 3, 8)),"
            " backend='xla').block_until_ready()\n"
            "assert 'mok_jax._mok_comm' not in sys.modules, 'transport loaded'\n"
            "assert not any('libnccl' in l for l in open('/proc/self/maps')), 'libnccl mapped'\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=tmp_path, check=False)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
