"""mok_jax.build_info, and the fused transport's refusal of an NCCL it was not built for."""

import warnings

import pytest

import mok_jax
from mok_jax import _ext, comm, ep


def test_build_info_says_what_this_build_holds():
    info = mok_jax.build_info()
    assert info.version == mok_jax.__version__
    assert info.cuda_kernels == ("cuda" in _ext.registered_platforms())
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
