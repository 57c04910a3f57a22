"""The CPU handlers split experts over threads; the bits must not depend on it.

The count: what ``mok_jax._mok.set_cpu_threads`` set, else MOK_CPU_THREADS as the
process has it at its first CPU call (read once), else the hardware's threads.
"""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax
from mok_jax import _mok

from conftest import cpu_threads, script_env


def _bits(a):
    return np.atleast_1d(np.asarray(a)).view(np.uint8)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_thread_count_does_not_change_bits(dtype):
    T, K, E, H, F = 97, 3, 11, 40, 24
    ks = jax.random.split(jax.random.key(7), 4)
    x = jax.random.normal(ks[0], (T, H)).astype(dtype)
    w, ids = jax.lax.top_k(jax.nn.softmax(jax.random.normal(ks[1], (T, E))), K)
    wgu = (jax.random.normal(ks[2], (E, H, 2 * F)) * H**-0.5).astype(dtype)
    wd = (jax.random.normal(ks[3], (E, F, H)) * F**-0.5).astype(dtype)
    ids = ids.astype(jnp.int32)
    cot = jnp.cos(jnp.arange(H, dtype=jnp.float32))

    def loss(x, w, a, b):
        y = mok_jax.moe(x, ids, w, a, b, capacity_factor=1.2)
        return jnp.sum(y.astype(jnp.float32) * cot)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    results = []
    for threads in (1, 2, 5):
        with cpu_threads(threads):  # the step runs to its end inside
            results.append(jax.block_until_ready(jax.tree.leaves(step(x, w, wgu, wd))))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(_bits(a), _bits(b))


def test_set_cpu_threads_returns_the_previous_setting():
    before = _mok.cpu_threads()
    previous = _mok.set_cpu_threads(3)
    try:
        assert _mok.cpu_threads() == 3
        assert _mok.set_cpu_threads(4) == 3
        assert _mok.cpu_threads() == 4
        with pytest.raises(ValueError, match=">= 0"):
            _mok.set_cpu_threads(-1)
        assert _mok.cpu_threads() == 4  # a refused count changes nothing
        assert _mok.set_cpu_threads(0) == 4
        assert _mok.cpu_threads() >= 1  # the default
    finally:
        _mok.set_cpu_threads(previous)
    assert _mok.cpu_threads() == before


def _run_script(script, tmp_path, **env):
    # From outside the source tree: `python -c` puts its working directory first on
    # sys.path, where a checkout's mok_jax (without its compiled extension) would
    # shadow the package under test.
    proc = subprocess.run([sys.executable, "-c", script],
                          env=dict(script_env(), JAX_PLATFORMS="cpu", **env), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


# Runs in a process started with MOK_CPU_THREADS=13.
_FROM_THE_ENVIRONMENT = """
import os
import jax, jax.numpy as jnp
import mok_jax
from mok_jax import _mok
x = jnp.sin(jnp.arange(4 * 256, dtype=jnp.float32)).reshape(4, 256)
jax.block_until_ready(mok_jax.quantize_rows_fp8(x))  # a first CPU call
assert _mok.cpu_threads() == 13, _mok.cpu_threads()
os.environ["MOK_CPU_THREADS"] = "2"  # read once: a later change is not seen
assert _mok.cpu_threads() == 13, _mok.cpu_threads()
assert _mok.set_cpu_threads(2) == 0 and _mok.cpu_threads() == 2
assert _mok.set_cpu_threads(0) == 2 and _mok.cpu_threads() == 13
print("threads as set")
"""


def test_the_environment_variable_sets_the_default(tmp_path):
    """MOK_CPU_THREADS as the process starts is the default count; set_cpu_threads
    overrides it and 0 brings it back."""
    assert "threads as set" in _run_script(_FROM_THE_ENVIRONMENT, tmp_path,
                                           MOK_CPU_THREADS="13")


# Runs in a process of its own, started with MOK_CPU_THREADS=128: quantizes rows
# with 128 threads wanted while the address space has room for only a few thread
# stacks.
_THREADS_THAT_CANNOT_START = """
import resource
import jax, jax.numpy as jnp, numpy as np
import mok_jax
from mok_jax import _mok
assert _mok.cpu_threads() == 128, _mok.cpu_threads()
x = jnp.sin(jnp.arange(128 * 256, dtype=jnp.float32)).reshape(128, 256)
run = jax.jit(mok_jax.quantize_rows_fp8).lower(x).compile()
want = [np.asarray(a) for a in run(x)]
with open("/proc/self/status") as status:
    kib = int(next(l for l in status if l.startswith("VmSize")).split()[1])
limit = kib * 1024 + (96 << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
got = [np.asarray(a) for a in run(x)]
for a, b in zip(want, got):
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
print("same bits")
"""


def test_threads_that_cannot_start_leave_the_work_to_the_others(tmp_path):
    """A worker thread that cannot start (no room for its stack) is not a crash:
    the started threads take its items and the bits are the same."""
    assert "same bits" in _run_script(_THREADS_THAT_CANNOT_START, tmp_path,
                                      MOK_CPU_THREADS="128")
