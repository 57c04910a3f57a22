"""The CPU handlers split experts over threads; the bits must not depend on it."""


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
