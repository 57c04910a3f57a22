"""mok_jax.build_info, the fused transport's refusal of an NCCL it was not built for, the
reuse of a build from a new pip build environment, and the sources every CUDA build
compiles assembling for a target before sm_80 (the SIMT build)."""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import warnings

import pytest

import mok_jax
from mok_jax import comm
from mok_jax._src import ep, ext


def test_build_info_says_what_this_build_holds():
    info = mok_jax.build_info()
    assert info.version == mok_jax.__version__
    assert info.cuda_kernels == ("cuda" in ext.registered_platforms())
    if info.cuda_kernels:
        assert info.cuda_architectures and info.cuda_version
        assert "CUDA kernels for sm_" in info.summary()
    else:
        assert info.cuda_architectures == () and "CPU handlers only" in info.summary()
    # The transport runs exactly when it was built, loads, and matches its NCCL.
    assert info.nvlink_transport == (comm.available() and not info.transport_problem)
    assert info.nvlink_transport or info.transport_problem


class _FakeTransport:
    """The transport's module as a build for NCCL 2.28.9 sees it with 2.32.3 loaded."""

    NCCL_HEADER_VERSION = 22809

    @staticmethod
    def nccl_runtime_version():
        return 23203


@pytest.fixture
def nccl_2_32_loaded(monkeypatch):
    monkeypatch.setattr(comm, "module", lambda: _FakeTransport)
    comm._auto_machine_ok.cache_clear()
    yield
    comm._auto_machine_ok.cache_clear()


def test_nccl_versions_read_as_release_numbers():
    assert comm.nccl_version_string(22809) == "2.28.9"
    assert comm.nccl_version_string(23203) == "2.32.3"


@pytest.mark.parametrize("raw", ["0", "-5", "nan", "inf", "1e300", "soon"])
def test_comm_timeout_refuses_what_is_not_a_finite_positive_number(monkeypatch, raw):
    """An infinite or out-of-range MOK_JAX_COMM_TIMEOUT_S is refused with the variable's
    name (the handlers count the timeout in 64-bit nanoseconds)."""
    monkeypatch.setenv(comm.ENV_TIMEOUT, raw)
    with pytest.raises(ValueError, match=comm.ENV_TIMEOUT):
        comm.timeout_s()


def test_comm_timeout_reads_seconds(monkeypatch):
    monkeypatch.delenv(comm.ENV_TIMEOUT, raising=False)
    assert comm.timeout_s() == 60.0
    monkeypatch.setenv(comm.ENV_TIMEOUT, "2.5")
    assert comm.timeout_s() == 2.5
    monkeypatch.setenv(comm.ENV_TIMEOUT, "86400000")  # 1000 days
    assert comm.timeout_s() == 86400000.0


def test_fused_backend_refuses_an_nccl_it_was_not_built_for(nccl_2_32_loaded):
    with pytest.raises(ValueError, match=r"built against NCCL 2\.28\.9, but NCCL 2\.32\.3 is "
                                         r"loaded.*nvidia-nccl-cu13==2\.28\.9"):
        ep.transport_for("fused", "gpu", row_bytes=64)
    info = mok_jax.build_info()
    assert (info.nccl_built, info.nccl_loaded) == ("2.28.9", "2.32.3")
    assert not info.nvlink_transport and "2.32.3" in info.transport_problem


def test_auto_backend_takes_xla_with_one_warning_on_an_nccl_mismatch(nccl_2_32_loaded):
    with pytest.warns(UserWarning, match=r"2\.32\.3.*backend='auto' uses XLA's collectives"):
        assert ep.transport_for("auto", "gpu", row_bytes=64) == "xla"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call is silent
        assert ep.transport_for("auto", "gpu", row_bytes=64) == "xla"


def _tool(name):
    """`name` beside this Python (a venv's cmake/ninja packages) or on PATH."""
    return shutil.which(name, path=os.pathsep.join(
        [os.path.dirname(sys.executable), os.environ.get("PATH", "")]))


@pytest.mark.slow
def test_a_build_from_a_new_pip_environment_recompiles_nothing(tmp_path):
    # pip builds each install in a new environment: the same dependency files at a
    # new path with new timestamps, and scikit-build-core then clears CMakeCache.txt
    # and the top-level CMakeFiles/. A CPU-only build of this tree under those
    # conditions must find nothing to recompile, and must recompile when a
    # dependency's content does change. One object of each target is built and
    # checked (every object of a target has its flags and include paths): the
    # two that include XLA's FFI headers, one of nanobind's copied sources and one
    # plain C++ file; the other objects and the link are left out.
    import jax.ffi
    import nanobind

    root = pathlib.Path(__file__).resolve().parents[1]
    cmake, ninja = _tool("cmake"), _tool("ninja")
    if cmake is None or ninja is None:
        pytest.fail("no cmake or ninja: both are in the test extra (pip install '.[test]')")
    build = tmp_path / "build"

    def environment(name):  # copies with new paths and new file times
        env_dir = tmp_path / name
        shutil.copytree(os.path.dirname(nanobind.__file__), env_dir / "nanobind",
                        copy_function=shutil.copy)
        shutil.copytree(jax.ffi.include_dir(), env_dir / "ffi_include",
                        copy_function=shutil.copy)
        return env_dir

    def configure(env_dir):
        (build / "CMakeCache.txt").unlink(missing_ok=True)
        shutil.rmtree(build / "CMakeFiles", ignore_errors=True)
        subprocess.run(
            [cmake, "-S", str(root), "-B", str(build), "-G", "Ninja",
             f"-DCMAKE_MAKE_PROGRAM={ninja}", "-DMOK_ENABLE_CUDA=OFF",
             f"-DPython_EXECUTABLE={sys.executable}",
             f"-DXLA_FFI_INCLUDE_DIR={env_dir / 'ffi_include'}"],
            check=True, capture_output=True, text=True,
            env=dict(os.environ, PYTHONPATH=str(env_dir)))

    objects = ["ffi/CMakeFiles/_mok.dir/bindings.cc.o",
               "ffi/CMakeFiles/_mok.dir/handlers/moe_cpu.cc.o",
               "ffi/CMakeFiles/nanobind-static.dir/__/deps/nanobind/src/implicit.cpp.o",
               "ffi/CMakeFiles/mok_cpu.dir/cpu/routing.cc.o"]

    def pending():
        out = subprocess.run([ninja, "-C", str(build), "-n", *objects], check=True,
                             capture_output=True, text=True).stdout
        return [line for line in out.splitlines() if "Building" in line]

    configure(environment("first"))
    assert len(pending()) == len(objects)  # the names are objects of this build
    subprocess.run([ninja, "-C", str(build), *objects], check=True, capture_output=True)
    assert pending() == []
    second = environment("second")
    configure(second)
    assert pending() == []
    # The control: a dependency whose content changed recompiles what includes it.
    with open(second / "ffi_include" / "xla" / "ffi" / "api" / "ffi.h", "a") as f:
        f.write("\n// changed\n")
    configure(second)
    assert any("handlers/moe_cpu.cc" in line for line in pending())


ROOT = pathlib.Path(__file__).resolve().parents[1]


def simt_sources():
    """The sources of ffi/CMakeLists.txt's mok_cuda library outside its 90a block:
    what a build without sm_90a compiles."""
    cmake = (ROOT / "ffi" / "CMakeLists.txt").read_text()
    block = re.search(r"add_library\(mok_cuda STATIC(.*?)\)", cmake, re.S)
    assert block, "no add_library(mok_cuda STATIC ...) in ffi/CMakeLists.txt"
    return block.group(1).split()


@pytest.mark.slow  # compiles with nvcc
def test_sources_of_every_cuda_build_assemble_for_sm_75(tmp_path):
    """ffi/CMakeLists.txt builds these for every architecture list (a list without 90a
    gets the SIMT GEMM path alone), so an instruction newer than the oldest target
    (cvt.rn.bf16.f32 needs sm_80) must sit behind a __CUDA_ARCH__ guard; ptxas, not
    the compiler's front end, is what refuses it."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc on PATH")
    sources = simt_sources()
    assert "kernels/moe_elementwise.cu" in sources
    for source in sources:
        done = subprocess.run(
            [nvcc, "-arch=sm_75", "-std=c++20", "--expt-relaxed-constexpr",
             "-diag-suppress=2908", "-I", str(ROOT / "ffi"), "-I", str(ROOT / "ffi" / "include"),
             "-cubin", str(ROOT / "ffi" / source), "-o", str(tmp_path / "out.cubin")],
            capture_output=True, text=True)
        assert done.returncode == 0, f"{source} for sm_75:\n{done.stderr}"
