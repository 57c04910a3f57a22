"""Loads the native extension ``mok_jax._mok`` and registers its FFI targets once."""

from __future__ import annotations

import functools

import jax

try:
    from mok_jax import _mok
except ImportError as err:  # e.g. importing the source tree instead of the installed package
    raise ImportError(
        "mok_jax's native extension mok_jax._mok is missing: install the package "
        "(`pip install .`), which compiles it, and import it from outside the source "
        "tree") from err

# Target names, shared with ffi/bindings.cc.
MOE_FORWARD = "mok_moe_fwd"
MOE_FORWARD_RANKS = "mok_moe_fwd_ranks"
MOE_BACKWARD = "mok_moe_bwd"
MOE_BACKWARD_RANKS = "mok_moe_bwd_ranks"
EXPERT_FFN_FORWARD = "mok_expert_ffn_fwd"
EXPERT_FFN_BACKWARD = "mok_expert_ffn_bwd"
COMBINE = "mok_combine"
QUANTIZE_ROWS_FP8 = "mok_quantize_rows_fp8"

# jax.ffi platform name -> the platform key used by _mok.registrations().
_PLATFORM_KEYS = {"cpu": "cpu", "cuda": "CUDA"}


@functools.cache
def registered_targets() -> dict[str, frozenset[str]]:
    """Registers every handler the extension holds, once.

    Returns the target names served per jax lowering platform ("cpu", "cuda").
    """
    regs = _mok.registrations()
    served = {}
    for platform, key in _PLATFORM_KEYS.items():
        names = regs.get(key, {})
        for name, capsule in names.items():
            jax.ffi.register_ffi_target(name, capsule, platform=key)
        if names:
            served[platform] = frozenset(names)
    return served


def recipes() -> dict[str, int]:
    """The expert FFN's recipes: {name: the handlers' recipe attribute value}."""
    return dict(_mok.recipes())


def registered_platforms() -> frozenset[str]:
    """The jax lowering platforms that have mok_jax handlers."""
    return frozenset(registered_targets())


def require_target(platform: str, target: str) -> None:
    """Raises RuntimeError when `target` has no handler on `platform`."""
    require_platform(platform)
    if target not in registered_targets()[platform]:
        raise RuntimeError(
            f"mok_jax has no {platform} handler for {target!r} yet (the operation is "
            f"implemented for: {sorted(p for p, t in registered_targets().items() if target in t)})")


def require_platform(platform: str) -> None:
    """Raises RuntimeError with a rebuild hint when `platform` has no handlers."""
    if platform in registered_platforms():
        return
    if platform == "cuda":
        raise RuntimeError(
            "mok_jax was built without its CUDA handlers, so mok_jax.moe cannot run on "
            "this GPU. Rebuild with CUDA 13 from PyPI: `MOK_CUDA=13 pip install "
            "--force-reinstall --no-deps .` from the mok_jax source tree (or with "
            "-C cmake.define.MOK_ENABLE_CUDA=ON and nvcc on PATH). This build: mok_jax "
            "with CPU handlers only.")
    raise RuntimeError(f"mok_jax has no handlers for platform {platform!r}.")
