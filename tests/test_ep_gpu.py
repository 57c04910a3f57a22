"""Expert parallelism across the GPUs of one process (scripts/gpu_ci.sh on 2+ GPUs).

The same contract as tests/test_ep.py on host devices: every EP size gives the
bits of one GPU, for y and every gradient, through shard_map and through plain
jit on sharded arrays. Shapes are multiples of 8, so the tensor-core grouped
GEMMs run.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import mok_jax

from ep_harness import (EP_BACKENDS, assert_same_bits, jit_on_mesh, problem, shard_map_ep,
                        single_device)

pytestmark = pytest.mark.multigpu

SHAPE = (256, 4, 8, 128, 64)  # T, K, E, H, F


def _gpus():
    return jax.devices("gpu")


@pytest.mark.parametrize("backend", EP_BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_shard_map_ep_on_gpus_is_bitwise_equal_to_one_gpu(dtype, capacity_factor, backend):
    gpus = _gpus()
    x, ids, w, wgu, wd = problem(dtype, seed=5, device=gpus[0], shape=SHAPE)
    y1, s1, g1 = single_device(x, ids, w, wgu, wd, capacity_factor)
    mesh = jax.make_mesh((len(gpus),), ("ep",), devices=gpus)
    y, s, g = shard_map_ep(mesh, P("ep"), x, ids, w, wgu, wd, capacity_factor,
                           backend=backend)
    assert_same_bits(y, y1, "y")
    for name, a, b in zip(("dx", "d_expert_weights", "d_w_gate_up", "d_w_down"), g, g1):
        assert_same_bits(a, b, name)
    assert int(s.dropped) == int(s1.dropped)


@pytest.mark.parametrize("backend", EP_BACKENDS)
def test_plain_jit_on_gpus_is_bitwise_equal_to_one_gpu(backend):
    gpus = _gpus()
    x, ids, w, wgu, wd = problem(jnp.bfloat16, seed=6, device=gpus[0], shape=SHAPE)
    y1, _, g1 = single_device(x, ids, w, wgu, wd, None)
    mesh = jax.make_mesh((len(gpus),), ("ep",), devices=gpus)
    y, _, g, hlo = jit_on_mesh(mesh, P("ep"), P("ep"), x, ids, w, wgu, wd, None,
                               backend=backend)
    assert_same_bits(y, y1, "y")
    for name, a, b in zip(("dx", "d_expert_weights", "d_w_gate_up", "d_w_down"), g, g1):
        assert_same_bits(a, b, name)
    assert "all-to-all" in hlo


@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_fused_backend_with_split_experts_is_an_error_not_a_silent_xla_run(axis_type):
    """backend='fused' has no EP transport yet: with Explicit axes moe sees the split
    at trace time; with Auto axes only the partitioner does (at compile time)."""
    gpus = _gpus()
    x, ids, w, wgu, wd = problem(jnp.bfloat16, seed=8, device=gpus[0], shape=SHAPE)
    types = {"explicit": jax.sharding.AxisType.Explicit, "auto": jax.sharding.AxisType.Auto}
    mesh = jax.make_mesh((len(gpus),), ("ep",), devices=gpus, axis_types=(types[axis_type],))
    put = lambda a: jax.device_put(a, jax.sharding.NamedSharding(mesh, P("ep")))  # noqa: E731
    args = [put(a) for a in (x, ids, w, wgu, wd)]
    with jax.set_mesh(mesh), pytest.raises(Exception, match="backend='fused'.* not implemented"):
        jax.block_until_ready(jax.jit(lambda *a: mok_jax.moe(*a, backend="fused"))(*args))
