"""mok_jax: a fused, deterministic Mixture-of-Experts layer for JAX.

``mok_jax.moe`` runs the whole MoE layer (dispatch, SwiGLU expert GEMMs,
weighted combine) through XLA FFI handlers: C++ on CPU, CUDA kernels on GPU.
The contract (shapes, numerics, errors, transformations) is docs/contract.md.

Submodules reachable after ``import mok_jax``:

* ``mok_jax.reference``: ``moe_reference``, the pure-JAX oracle (imported
  eagerly; it costs about a millisecond).
* ``mok_jax.nn``: ``MoE``, the Flax NNX layer. Imported on first attribute
  access: importing flax roughly doubles the time of ``import mok_jax``
  (0.4-0.6 s on top of 0.4 s on a 2-core x86 machine), and
  users of the bare op need not pay it.

The modules of the package itself are its API (``moe``, ``nn``, ``router``,
``norm``, ``recipe``, ``fp8``, ``comm``, ``reference``, ``build``); ``mok_jax._src``
holds the internals (primitives, execution paths, expert parallelism,
partitioning), and ``mok_jax.bench`` the benchmark and its baselines.
"""

import importlib

from mok_jax import reference
from mok_jax._src import ext as _ext
from mok_jax.build import BuildInfo, build_info
from mok_jax.fp8 import quantize_rows_fp8
from mok_jax.moe import BACKENDS, MoEStats, capacity, moe
from mok_jax.norm import add_rms_norm
from mok_jax.recipe import Recipe

__version__ = "0.1.0"
__all__ = ["BACKENDS", "BuildInfo", "MoEStats", "Recipe", "add_rms_norm", "build_info",
           "capacity", "moe", "nn", "quantize_rows_fp8", "reference"]

_LAZY_SUBMODULES = ("nn",)


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))


_ext.registered_platforms()
