"""The shared harness of the expert-parallel tests (host devices and GPUs).

Problem makers, bitwise asserts and the three runners -- one device, shard_map
with ``axis_name``, plain jit on sharded arrays -- all parametrized by `backend`,
so that a new EP backend gets the whole bitwise suite by joining `EP_BACKENDS`.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import mok_jax

SHAPE = (64, 3, 8, 16, 12)  # T, K, E, H, F

# The EP backends every bitwise EP test runs: on host devices XLA's exchange only
# (backend="fused" is a ValueError on CPU); on GPUs also mok_jax's NVLink transport.
EP_BACKENDS = ("xla",)
GPU_EP_BACKENDS = ("xla", "fused")


def problem(dtype, seed=0, device=None, shape=SHAPE):
    """A random routed problem with three invalid ids: (x, ids, w, wgu, wd)."""
    T, K, E, H, F = shape
    ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(ks[0], (T, H)).astype(dtype)
    w, ids = jax.lax.top_k(jax.nn.softmax(jax.random.normal(ks[1], (T, E))), K)
    ids = ids.astype(jnp.int32).at[3, 1].set(-1).at[5, 0].set(E + 7).at[40, 2].set(-9)
    wgu = (jax.random.normal(ks[2], (E, H, 2 * F)) * H**-0.5).astype(dtype)
    wd = (jax.random.normal(ks[3], (E, F, H)) * F**-0.5).astype(dtype)
    return jax.device_put((x, ids, w, wgu, wd), device or jax.devices("cpu")[0])


def cot(h):
    """A fixed cotangent direction for y (so that dy is not uniform)."""
    return jnp.cos(jnp.arange(h, dtype=jnp.float32))


def assert_same_bits(a, b, what=""):
    np.testing.assert_array_equal(np.atleast_1d(np.asarray(a)).view(np.uint8),
                                  np.atleast_1d(np.asarray(b)).view(np.uint8), err_msg=what)


def assert_same_results(got, want, names=("y", "dx", "d_expert_weights", "d_w_gate_up",
                                          "d_w_down")):
    """y and the four gradients, bit for bit."""
    for name, a, b in zip(names, got, want):
        assert_same_bits(a, b, name)


@functools.partial(jax.jit, static_argnames=("cf", "backend"))
def single_device(x, ids, w, wgu, wd, cf, backend="auto"):
    """(y, stats, grads) of one device (jitted: one compile per shape, not one per op)."""
    def loss(x, w, wgu, wd):
        y, s = mok_jax.moe(x, ids, w, wgu, wd, capacity_factor=cf, backend=backend,
                           return_stats=True)
        return jnp.sum(y.astype(jnp.float32) * cot(x.shape[1])), (y, s)
    (_, (y, s)), g = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, w, wgu, wd)
    return y, s, g


def shard_map_ep(mesh, token_spec, x, ids, w, wgu, wd, cf, axis="ep", backend="xla"):
    """(y, stats, grads) of the layer under shard_map with axis_name=axis."""
    other_axes = tuple(a for a in mesh.axis_names if a != axis)

    def local(x, ids, w, wgu, wd):
        y, stats = mok_jax.moe(x, ids, w, wgu, wd, axis_name=axis, capacity_factor=cf,
                               backend=backend, return_stats=True)
        # moe's statistics are global over the EP group; other groups add theirs.
        if other_axes:
            stats = jax.tree.map(lambda v: jax.lax.psum(v, other_axes), stats)
        return y, stats

    layer = jax.shard_map(local, mesh=mesh, in_specs=(token_spec,) * 3 + (P(axis),) * 2,
                          out_specs=(token_spec, P()), check_vma=True)
    tok = NamedSharding(mesh, token_spec)
    wts = NamedSharding(mesh, P(axis))
    x, ids, w = (jax.device_put(a, tok) for a in (x, ids, w))
    wgu, wd = (jax.device_put(a, wts) for a in (wgu, wd))

    def loss(x, w, wgu, wd):
        y, s = layer(x, ids, w, wgu, wd)
        return jnp.sum(y.astype(jnp.float32) * cot(x.shape[1])), (y, s)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    (_, (y, s)), g = step(x, w, wgu, wd)
    return y, s, g


def jit_on_mesh(mesh, token_spec, expert_spec, x, ids, w, wgu, wd, cf, backend="xla"):
    """(y, stats, grads, compiled HLO text) of plain jit on sharded arrays."""
    tok = NamedSharding(mesh, token_spec)
    wts = NamedSharding(mesh, expert_spec)
    args = [jax.device_put(a, s) for a, s in ((x, tok), (w, tok), (wgu, wts), (wd, wts))]
    ids = jax.device_put(ids, tok)

    def loss(x, w, wgu, wd, ids):
        y, s = mok_jax.moe(x, ids, w, wgu, wd, capacity_factor=cf, backend=backend,
                           return_stats=True)
        return jnp.sum(y.astype(jnp.float32) * cot(x.shape[1])), (y, s)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    (_, (y, s)), g = step(*args, ids)
    hlo = step.lower(*args, ids).compile().as_text()
    return y, s, g, hlo


def gathered_types(hlo):
    """Element types of every all-gather result in compiled HLO text."""
    return re.findall(r"= \(?(\w+)\[[^\]]*\][^=]*? all-gather(?:-start)?\(", hlo)
