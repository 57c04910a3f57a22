"""What this build of mok_jax holds: `build_info()`."""

from __future__ import annotations

from typing import NamedTuple

from mok_jax import _mok


class BuildInfo(NamedTuple):
    """What the installed extension was built with, and what runs next to it.

    Attributes:
      version: mok_jax's version.
      cuda_kernels: whether the CUDA handlers were built (else CPU only).
      cuda_architectures: the GPU architectures they were compiled for ("90a").
      cuda_version: the version of the nvcc that compiled them.
      tensor_core_kernels: whether the Hopper (sm_90a) tensor-core GEMMs are in.
      nvlink_transport: whether the fused NVLink transport (``backend="fused"``) can
        run here: built, its NCCL loadable, and the NCCL it was built against.
      nccl_built: the NCCL version the transport was compiled against, or None.
      nccl_loaded: the NCCL version loaded now, or None.
      transport_problem: why the transport cannot run ('' when it can).
    """

    version: str
    cuda_kernels: bool
    cuda_architectures: tuple[str, ...]
    cuda_version: str
    tensor_core_kernels: bool
    nvlink_transport: bool
    nccl_built: str | None
    nccl_loaded: str | None
    transport_problem: str

    def summary(self) -> str:
        """One line, for error messages."""
        if not self.cuda_kernels:
            return f"mok_jax {self.version}: CPU handlers only (built without CUDA)"
        transport = (f"NVLink transport for NCCL {self.nccl_built}" if self.nvlink_transport
                     else "no NVLink transport")
        return (f"mok_jax {self.version}: CUDA kernels for sm_{', sm_'.join(self.cuda_architectures)}"
                f" (nvcc {self.cuda_version}), {transport}")


def build_info() -> BuildInfo:
    """What this build holds: CUDA kernels (for which architectures, by which nvcc),
    and the fused NVLink transport with the NCCL it was built against and the one
    loaded now. Loads the transport's module (and so libnccl) when it was built.

    Example:
      >>> import mok_jax
      >>> print(mok_jax.build_info().summary())  # doctest: +SKIP
      mok_jax 0.1.0: CUDA kernels for sm_90a (nvcc 13.0.88), NVLink transport for NCCL 2.28.9
    """
    from mok_jax import __version__, comm

    built = loaded = None
    problem = ""
    try:
        built, loaded = comm.nccl_versions()
        problem = comm.nccl_mismatch()
    except comm.Missing as err:
        problem = str(err)
    except Exception as err:  # a loaded module whose NCCL cannot answer  # noqa: BLE001
        problem = f"{type(err).__name__}: {err}"
    archs = tuple(a for a in str(_mok.CUDA_ARCHITECTURES).split(",") if a)
    return BuildInfo(version=__version__, cuda_kernels=bool(_mok.CUDA_KERNELS),
                     cuda_architectures=archs, cuda_version=str(_mok.CUDA_VERSION),
                     tensor_core_kernels=bool(_mok.HAS_SM90A_KERNELS),
                     nvlink_transport=built is not None and not problem,
                     nccl_built=built, nccl_loaded=loaded, transport_problem=problem)
