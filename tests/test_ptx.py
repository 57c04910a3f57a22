"""The row kernels' stores in PTX: copies of 16-byte vectors must stay 16-byte stores.

nvcc has twice turned a vector copy inside a loop into one store per element
(gather_rows_kernel for bf16 rows longer than 1024, gather_dy_kernel's copy of dy for
f32 rows longer than 512): the results stay right, so no numerical test sees it,
and the kernel runs at a fifth of the memory's speed. This test compiles
ffi/kernels/moe_elementwise.cu to PTX with the nvcc on PATH (CI has one; skipped
without) and checks every vectorised instantiation of the pure row-moving kernels.
"""

import collections
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "ffi", "kernels", "moe_elementwise.cu")

# Kernels whose every global store moves a whole vector of a row (templates
# <X, V> or <X, W, V>, V > 1): gathers, the dy gather and the combine.
ROW_KERNELS = ("gather_rows_kernel", "gather_dy_kernel", "combine_kernel")
# Itanium mangling of the vector width template argument: Li4E / Li8E.
VECTOR_WIDTH = re.compile(r"Li([248])E")
STORE = re.compile(r"\bst\.global((?:\.\w+)+)")
VECTOR = re.compile(r"\.(v[248]|b128)\b")  # a vector store, whatever other qualifiers

nvcc = shutil.which("nvcc")


def entries(ptx):
    """(mangled name, body) of every kernel in `ptx`."""
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"\.entry\s+(\S+)\(", ptx)]
    for i, (pos, name) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(ptx)
        yield name, ptx[pos:end]


@pytest.fixture(scope="module")
def ptx(tmp_path_factory):
    if nvcc is None:
        pytest.skip("no nvcc on PATH")
    out = tmp_path_factory.mktemp("ptx") / "moe_elementwise.ptx"
    cmd = [nvcc, "-O3", "-std=c++20", "-arch=sm_90a", "--expt-relaxed-constexpr",
           "-diag-suppress=2908", "-DMOK_HAVE_SM90A", "-I", os.path.join(ROOT, "ffi"),
           "-I", os.path.join(ROOT, "ffi", "include"), "-ptx", SOURCE, "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"nvcc failed:\n{done.stderr}"
    return out.read_text()


def test_vectorised_row_kernels_store_only_vectors(ptx):
    checked = collections.Counter()
    bad = {}
    for name, body in entries(ptx):
        kernel = next((k for k in ROW_KERNELS if k in name), None)
        if kernel is None:
            continue
        width = VECTOR_WIDTH.search(name.split(kernel, 1)[1])
        if width is None or width.group(1) == "1":
            continue  # the scalar fallback (rows not a multiple of a vector)
        stores = collections.Counter(m.group(1) for m in STORE.finditer(body))
        checked[kernel] += 1
        scalar = {k: n for k, n in stores.items() if not VECTOR.search(k)}
        if scalar or not stores:
            bad[name] = dict(stores)
    # bf16 and f32 rows, and for the weighted kernels both weight dtypes.
    assert checked["gather_rows_kernel"] >= 2, checked
    assert checked["gather_dy_kernel"] >= 3, checked
    assert checked["combine_kernel"] >= 4, checked
    assert not bad, f"element-wise global stores in vectorised row kernels: {bad}"


def test_the_check_sees_element_wise_stores():
    # The parser on a hand-made body: a scalar store next to a vector one is found.
    body = ".entry _Z18gather_rows_kernelIfLi4EEvv(\n st.global.v4.u32 [%rd1], {%r1};\n" \
           " st.global.f32 [%rd2], %f1;\n}\n"
    (name, text), = entries(body)
    stores = collections.Counter(m.group(1) for m in STORE.finditer(text))
    assert VECTOR_WIDTH.search(name).group(1) == "4"
    assert stores == {".v4.u32": 1, ".f32": 1}
    assert [bool(VECTOR.search(k)) for k in (".v4.u32", ".cs.v2.f32", ".f32", ".u16")] == [
        True, True, False, False]
