"""mok_jax: a fused, deterministic Mixture-of-Experts layer for JAX.

``mok_jax.moe`` runs the whole MoE layer (dispatch, SwiGLU expert GEMMs,
weighted combine) through XLA FFI handlers: C++ on CPU, CUDA kernels on GPU.
"""

from mok_jax import _ext
from mok_jax.moe import BACKENDS, MoEStats, capacity, moe

__version__ = "0.1.0"
__all__ = ["BACKENDS", "MoEStats", "capacity", "moe"]

_ext.registered_platforms()
