"""The persistent backward's task list, checked on the host (a C++ compiler; skipped
without one).

`moe_backward_persistent` runs one CTA per SM, each claiming numbered tasks in
order and waiting on device counters for what a task reads; it cannot deadlock as
long as every task waits only for tasks numbered before it. The list lives in
ffi/kernels/moe_persistent_backward_tasks.h (host and device code);
tests/persistent_task_order.cc runs it over 304 routings (empty experts, one
expert with every row, sizes off the tiles) and checks that every task appears
once, waits for what its data needs, and that the tasks before it meet the wait,
also with the SwiGLU tasks at several lags among the dgrad2 tasks and the weight
gradients' N tiles in chunks of several sizes, and that each weight gradient's
tiles come with the loop over its smaller side inside; then over 153 routings split in P = 2, 4, 8 EP ranks on one launch (each rank its
own list, the combine waiting for every rank's dgrad1 tasks), run in turn, that
every task belongs to its rank and the lists end without a deadlock. Over the same
routings (some with experts of up to 40 row blocks, five bands), the forward's GEMM
task order (ffi/kernels/band_order.h) gives every (column tile, row block) of each
rank's experts once, each expert's tasks within the expert's numbers.
"""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def test_backward_tasks_wait_only_for_earlier_tasks(tmp_path):
    if cxx is None:
        pytest.skip("no C++ compiler (c++, g++ or $CXX)")
    exe = tmp_path / "persistent_task_order"
    built = subprocess.run(
        [cxx, "-std=c++20", "-O1", "-I", os.path.join(ROOT, "ffi", "kernels"),
         "-I", os.path.join(ROOT, "ffi", "include"),
         os.path.join(ROOT, "tests", "persistent_task_order.cc"), "-o", str(exe)],
        capture_output=True, text=True)
    assert built.returncode == 0, f"{cxx} failed:\n{built.stderr}"
    ran = subprocess.run([str(exe)], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout.strip() == "457 cases, 0 errors", ran.stdout  # 304 + 153 routings
