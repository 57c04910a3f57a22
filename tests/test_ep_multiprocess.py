"""Expert parallelism across processes through jax.distributed (scripts/ep_multiprocess.py).

Each process checks its shards of y and of every gradient against the
single-device bits, for shard_map and plain jit. On CPU: 2 processes of 2 host
devices each (EP=4, collectives through gloo). On a GPU machine: one process
per GPU.
"""

import os
import subprocess
import sys

import jax
import pytest

from conftest import script_env

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "ep_multiprocess.py")


def _run(*argv, timeout=600):
    env = script_env(host_devices=False)  # each process sets its own device count
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # this process may hold the GPUs too
    proc = subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)
    return proc.returncode, proc.stdout + proc.stderr


def _assert_all_equal(code, out, processes, ep, backend="auto"):
    assert code == 0, out[-4000:]
    for pid in range(processes):
        for layer in ("shard_map", "plain jit"):
            line = (f"[process {pid}] {layer} ({backend}): EP={ep} over {processes} "
                    "processes, bitwise equal")
            assert line in out, out[-4000:]
    assert "MISMATCH" not in out and "all processes bitwise equal to one device" in out


@pytest.mark.slow
@pytest.mark.parametrize("dtype,capacity", [("bf16", None), ("f32", "0.75")])
def test_two_processes_of_two_host_devices_match_one_device(dtype, capacity):
    argv = ["--processes", "2", "--devices-per-process", "2", "--platform", "cpu",
            "--dtype", dtype, "--timeout", "400"]
    if capacity:
        argv += ["--capacity-factor", capacity]
    code, out = _run(*argv)
    _assert_all_equal(code, out, 2, ep=4)


@pytest.mark.slow
def test_two_processes_on_an_auto_axis_mesh():
    """Auto mesh axes: plain jit under jax.set_mesh traces the partitioned code inside
    that mesh's context (see sharding.per_device). Explicit axes, jax.make_mesh's
    default and the script's, are the cases of the test above."""
    code, out = _run("--processes", "2", "--devices-per-process", "2", "--platform", "cpu",
                     "--mesh-axes", "auto", "--capacity-factor", "1.0", "--timeout", "400")
    _assert_all_equal(code, out, 2, ep=4)


@pytest.mark.multigpu
@pytest.mark.parametrize("dtype,capacity,mesh_axes,backend", [
    ("bf16", None, "explicit", "auto"), ("f32", "0.75", "explicit", "auto"),
    ("bf16", "1.0", "explicit", "auto"), ("bf16", None, "auto", "auto"),
    ("bf16", None, "explicit", "fused"), ("f32", "0.75", "auto", "fused")])
def test_one_process_per_gpu_matches_one_gpu(dtype, capacity, mesh_axes, backend):
    """One process per GPU, shard_map and plain jit. Plain jit on an Explicit-axis
    mesh inside jax.set_mesh once aborted XLA's GPU compiler (a `Sharding` custom
    call left in a scatter combiner of the partitioned code). "auto" is XLA's
    exchange across processes; "fused" bootstraps its NCCL communicator through
    the jax.distributed key-value store."""
    n = len(jax.devices("gpu"))
    argv = ["--processes", str(n), "--platform", "gpu", "--dtype", dtype,
            "--mesh-axes", mesh_axes, "--backend", backend, "--timeout", "400"]
    if capacity:
        argv += ["--capacity-factor", capacity]
    code, out = _run(*argv)
    _assert_all_equal(code, out, n, ep=n, backend=backend)


@pytest.mark.multigpu
def test_fused_transport_a_peer_that_exits_ends_the_wait_with_an_error_naming_it():
    """Process 1 compiles (the communicator exists) and exits before the call:
    process 0's barrier gives up after MOK_JAX_COMM_TIMEOUT_S=5 s with an error
    naming the rank it waited for and the phase; nothing hangs."""
    code, out = _run("--processes", "2", "--platform", "gpu", "--scenario", "peer-exits",
                     "--timeout", "120")
    assert code == 0, out[-4000:]  # the launcher saw every process end
    assert "[process 1] exiting before the call" in out, out[-4000:]
    assert "[process 0] call failed after" in out, out[-4000:]
    assert "rank 0 (CUDA device 0), phase dispatch (waiting for every rank's token rows): " \
        "rank 1 did not arrive" in out, out[-4000:]
    assert "[process 0] exit status 3" in out, out[-4000:]


@pytest.mark.multigpu
def test_fused_transport_ranks_with_different_shapes_fail_before_moving_rows():
    """Process 1 traces half the tokens of process 0: both meet in the first barrier,
    see different signatures and stop with an error, before any row moves."""
    code, out = _run("--processes", "2", "--platform", "gpu", "--scenario", "shapes-differ",
                     "--timeout", "120")
    assert code == 0, out[-4000:]
    for pid in (0, 1):
        assert f"[process {pid}] call failed after" in out, out[-4000:]
        assert f"[process {pid}] exit status 3" in out, out[-4000:]
    assert "the ranks traced different shapes" in out, out[-4000:]


@pytest.mark.multigpu
def test_one_process_of_all_gpus_on_an_explicit_mesh_matches_one_gpu():
    """The same script with one process driving every GPU (jax.set_mesh, Explicit axes)."""
    n = len(jax.devices("gpu"))
    code, out = _run("--processes", "1", "--devices-per-process", str(n), "--platform", "gpu",
                     "--capacity-factor", "0.75", "--timeout", "400")
    _assert_all_equal(code, out, 1, ep=n)
