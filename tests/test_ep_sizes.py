"""Expert parallelism at the sizes users run (scripts/ep_sizes.py): EP 16 and 72 (one
NVL72 rack) and a dp=2 x ep=36 mesh on CPU host devices, through shard_map and
through plain jit inside jax.set_mesh, with capacity and invalid ids. (The script
also takes ep32 and ep64; the compile time grows with the device count, so the
suite runs the smallest, the rack and the two-axis mesh.) bf16 with capacity runs
all three; f32 without capacity runs EP 16 only (the dtype and the capacity act
on each device's tokens; the rack-scale exchange is the bf16 case's).

Each case runs in its own process with as many host devices as its largest mesh
(the rest of the suite runs with conftest's 8).
"""

import os
import subprocess
import sys

import pytest

from conftest import script_env

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "ep_sizes.py")
MESHES = ("ep16", "ep72", "dp2ep36")


def _run(meshes, *argv):
    env = script_env()
    proc = subprocess.run([sys.executable, SCRIPT, "--meshes", ",".join(meshes), *argv],
                          capture_output=True, text=True, timeout=900, env=env, check=False)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("dtype,capacity,meshes", [("bf16", "1.0", MESHES),
                                                   ("f32", None, ("ep16",))])
def test_rack_scale_meshes_are_bitwise_equal_to_one_device(dtype, capacity, meshes):
    argv = ["--dtype", dtype] + (["--capacity-factor", capacity] if capacity else [])
    code, out = _run(meshes, *argv)
    assert code == 0, out[-4000:]
    for mesh in meshes:
        for layer in ("shard_map", "plain jit"):
            assert f"{mesh} {layer}: bitwise equal" in out, out[-4000:]
    assert "MISMATCH" not in out
    if capacity:  # the capacity really drops pairs, and invalid ids are counted
        assert "dropped=0 " not in out and "invalid=3," in out, out[-4000:]
