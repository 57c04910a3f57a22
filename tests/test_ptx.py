"""Kernels' stores in PTX: 16-byte vector stores must stay 16-byte stores.

nvcc has several times turned a vector store into smaller ones (gather_rows_kernel
for bf16 rows longer than 1024 and the backward's former dy gather for f32 rows
longer than 512, one store per element; the SwiGLU GEMM epilogue's uint4 stores,
four 4-byte stores each; three kinds of the persistent backward's stores): the
results stay right, so no numerical test sees it, and the kernels run slower (the
row kernels at a fifth of the memory's speed). These tests compile
ffi/kernels/moe_elementwise.cu, gemm_tc_rows_swiglu.cu and
moe_persistent_backward.cu to PTX with the nvcc on PATH (CI has one; skipped
without) and check every vectorised instantiation of the pure row-moving kernels,
the SwiGLU GEMM instance and the persistent backward's instances.
"""

import collections
import importlib.util
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "ffi", "kernels", "moe_elementwise.cu")

# Kernels whose every global store moves a whole vector of a row (templates
# <X, V> or <X, W, V>, V > 1): the row gather (x and dy) and the combine.
ROW_KERNELS = ("gather_rows_kernel", "combine_kernel")
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


def compile_ptx(source, out, includes=()):
    """PTX of `source` as the build compiles it for sm_90a (CMakeLists.txt's flags)."""
    cmd = [nvcc, "-O3", "-DNDEBUG", "-std=c++20", "-arch=sm_90a", "--expt-relaxed-constexpr",
           "-diag-suppress=2908", "-DMOK_HAVE_SM90A", "-I", os.path.join(ROOT, "ffi"),
           "-I", os.path.join(ROOT, "ffi", "include")]
    for path in includes:
        cmd += ["-isystem", path]
    done = subprocess.run(cmd + ["-ptx", source, "-o", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, f"nvcc failed:\n{done.stderr}"
    return out.read_text()


@pytest.fixture(scope="module")
def ptx(tmp_path_factory):
    if nvcc is None:
        pytest.skip("no nvcc on PATH")
    return compile_ptx(SOURCE, tmp_path_factory.mktemp("ptx") / "moe_elementwise.ptx")


@pytest.mark.slow  # compiles with nvcc
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


def cutlass_includes():
    """The CUTLASS/CuTe include folders of the nvidia-cutlass package (skips without
    nvcc; fails without the package, which the test extra installs)."""
    if nvcc is None:
        pytest.skip("no nvcc on PATH")
    spec = importlib.util.find_spec("cutlass_library")  # the nvidia-cutlass package
    if spec is None:
        pytest.fail("no CUTLASS headers: nvidia-cutlass is in the test extra "
                    "(pip install '.[test]')")
    pkg = spec.submodule_search_locations[0]
    return [os.path.join(pkg, "source", "include"),
            os.path.join(pkg, "source", "tools", "util", "include")]


@pytest.mark.slow  # compiles with nvcc
def test_swiglu_gemm_epilogue_stores_only_16_byte_vectors(tmp_path):
    """GEMM1's SwiGLU epilogue (ffi/kernels/swiglu_epilogue.cuh) writes h and the
    gate/up residual as 16-byte stores; the rest of those kernels (CUTLASS's TMA
    main loop) stores nothing to global memory itself."""
    source = os.path.join(ROOT, "ffi", "kernels", "gemm_tc_rows_swiglu.cu")
    text = compile_ptx(source, tmp_path / "swiglu.ptx", cutlass_includes())
    kernels = {name: collections.Counter(m.group(1) for m in STORE.finditer(body))
               for name, body in entries(text)
               if "device_kernel" in name and "SwigluEpilogue" in name}
    assert len(kernels) == 1, list(kernels)  # the one (cooperative) instance
    for name, stores in kernels.items():
        assert stores and all(VECTOR.search(k) and ".v4" in k for k in stores), (name, stores)


@pytest.mark.slow  # compiles with nvcc
def test_persistent_backward_stores_only_vectors_to_global_memory(tmp_path):
    """The persistent backward's global stores (its SwiGLU task's wh and d gate_up
    rows, dgrad2's f32 dh pairs, the combine's dx rows and the dy rows) are 8- and
    16-byte vector stores in every instance; nvcc had compiled the first three to
    2- and 4-byte stores. (dgrad1's dx rows and the d expert_weights go through
    generic pointers, the weight gradients through TMA.)"""
    source = os.path.join(ROOT, "ffi", "kernels", "moe_persistent_backward.cu")
    text = compile_ptx(source, tmp_path / "backward.ptx", cutlass_includes())
    kernels = {name: collections.Counter(m.group(1) for m in STORE.finditer(body))
               for name, body in entries(text) if "moe_backward_persistent" in name}
    assert len(kernels) == 4, list(kernels)  # bf16 and f32 weights, 64- and 128-row blocks
    for name, stores in kernels.items():
        assert sum(n for k, n in stores.items() if ".v2" in k) >= 32, (name, stores)
        scalar = {k: n for k, n in stores.items() if not VECTOR.search(k)}
        assert not scalar, (name, stores)
