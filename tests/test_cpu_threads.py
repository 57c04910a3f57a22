"""The CPU handlers split experts over threads; the bits must not depend on it."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax


def _bits(a):
    return np.atleast_1d(np.asarray(a)).view(np.uint8)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_thread_count_does_not_change_bits(dtype, monkeypatch):
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
    for threads in ("1", "2", "5"):
        monkeypatch.setenv("MOK_CPU_THREADS", threads)
        results.append(jax.tree.leaves(step(x, w, wgu, wd)))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(_bits(a), _bits(b))


# Runs in a process of its own: quantizes rows with 128 threads wanted while the
# address space has room for only a few thread stacks.
_THREADS_THAT_CANNOT_START = """
import os, resource
os.environ["MOK_CPU_THREADS"] = "128"
import jax, jax.numpy as jnp, numpy as np
import mok_jax
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
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(mok_jax.__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
        [package_parent] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    # From outside the source tree: `python -c` puts its working directory first on
    # sys.path, where a checkout's mok_jax (without its compiled extension) would
    # shadow the package under test.
    proc = subprocess.run([sys.executable, "-c", _THREADS_THAT_CANNOT_START], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "same bits" in proc.stdout
