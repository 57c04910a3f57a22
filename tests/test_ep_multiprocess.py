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

import mok_jax

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "ep_multiprocess.py")


def _run(*argv, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # not conftest's 8
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # this process may hold the GPUs too
    # The mok_jax this process imported (installed, or the source tree of a dev build)
    # comes first: PYTHONPATH precedes site-packages.
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(mok_jax.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)
    return proc.returncode, proc.stdout + proc.stderr


def _assert_all_equal(code, out, processes, ep):
    assert code == 0, out[-4000:]
    for pid in range(processes):
        for layer in ("shard_map", "plain jit"):
            line = f"[process {pid}] {layer}: EP={ep} over {processes} processes, bitwise equal"
            assert line in out, out[-4000:]
    assert "MISMATCH" not in out and "all processes bitwise equal to one device" in out


@pytest.mark.parametrize("dtype,capacity", [("bf16", None), ("f32", "0.75")])
def test_two_processes_of_two_host_devices_match_one_device(dtype, capacity):
    argv = ["--processes", "2", "--devices-per-process", "2", "--platform", "cpu",
            "--dtype", dtype, "--timeout", "400"]
    if capacity:
        argv += ["--capacity-factor", capacity]
    code, out = _run(*argv)
    _assert_all_equal(code, out, 2, ep=4)


@pytest.mark.parametrize("mesh_axes", ["explicit", "auto"])
def test_two_processes_on_both_mesh_axis_types(mesh_axes):
    """jax.make_mesh's Explicit axes and Auto axes: plain jit under jax.set_mesh
    traces the partitioned code inside that mesh's context (see sharding._per_device)."""
    code, out = _run("--processes", "2", "--devices-per-process", "2", "--platform", "cpu",
                     "--mesh-axes", mesh_axes, "--capacity-factor", "1.0", "--timeout", "400")
    _assert_all_equal(code, out, 2, ep=4)


@pytest.mark.multigpu
@pytest.mark.parametrize("dtype,capacity,mesh_axes", [
    ("bf16", None, "explicit"), ("f32", "0.75", "explicit"), ("bf16", "1.0", "explicit"),
    ("bf16", None, "auto")])
def test_one_process_per_gpu_matches_one_gpu(dtype, capacity, mesh_axes):
    """One process per GPU, shard_map and plain jit. Plain jit on an Explicit-axis
    mesh inside jax.set_mesh once aborted XLA's GPU compiler (a `Sharding` custom
    call left in a scatter combiner of the partitioned code)."""
    n = len(jax.devices("gpu"))
    argv = ["--processes", str(n), "--platform", "gpu", "--dtype", dtype,
            "--mesh-axes", mesh_axes, "--timeout", "400"]
    if capacity:
        argv += ["--capacity-factor", capacity]
    code, out = _run(*argv)
    _assert_all_equal(code, out, n, ep=n)


@pytest.mark.multigpu
def test_one_process_of_all_gpus_on_an_explicit_mesh_matches_one_gpu():
    """The same script with one process driving every GPU (jax.set_mesh, Explicit axes)."""
    n = len(jax.devices("gpu"))
    code, out = _run("--processes", "1", "--devices-per-process", str(n), "--platform", "gpu",
                     "--capacity-factor", "0.75", "--timeout", "400")
    _assert_all_equal(code, out, 1, ep=n)
