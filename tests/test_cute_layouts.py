"""Layout facts the persistent kernels' hand-written epilogues rely on, checked on
the host with CuTe (nvcc and CUTLASS's headers; skipped without them).

`stmatrix_slice` (ffi/kernels/moe_persistent_backward.cu) and the forward's
`staged_pass` hand a quad's packed pairs to stmatrix on the strength of where
wgmma leaves each accumulator, and `stage_part` writes the weight-gradient store
parts at swizzled addresses it computes itself; tests/wgmma_c_layout.cu asks CuTe
for every thread's coordinates and for the parts' layout, and compares.
"""

import importlib.util
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
nvcc = shutil.which("nvcc")


@pytest.mark.slow  # compiles with nvcc
def test_wgmma_accumulator_layout_of_the_persistent_epilogues(tmp_path):
    if nvcc is None:
        pytest.skip("no nvcc on PATH")
    spec = importlib.util.find_spec("cutlass_library")  # the nvidia-cutlass package
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("no CUTLASS headers: nvidia-cutlass is in the test extra "
                    "(pip install '.[test]')")
    include = os.path.join(list(spec.submodule_search_locations)[0], "source", "include")
    exe = tmp_path / "wgmma_c_layout"
    built = subprocess.run(
        [nvcc, "-std=c++20", "-O1", "--expt-relaxed-constexpr", "-isystem", include,
         os.path.join(ROOT, "tests", "wgmma_c_layout.cu"), "-o", str(exe)],
        capture_output=True, text=True)
    assert built.returncode == 0, f"nvcc failed:\n{built.stderr}"
    ran = subprocess.run([str(exe)], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout.strip() == "0 mismatches"
