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
MOE_BACKWARD = "mok_moe_bwd"

# jax.ffi platform name -> the platform key used by _mok.registrations().
_PLATFORM_KEYS = {"cpu": "cpu", "cuda": "CUDA"}


@functools.cache
def registered_platforms() -> frozenset[str]:
    """Registers every handler the extension holds; returns the platforms served.

    Platform names are jax's lowering platforms ("cpu", "cuda").
    """
    regs = _mok.registrations()
    served = set()
    for platform, key in _PLATFORM_KEYS.items():
        for name, capsule in regs.get(key, {}).items():
            jax.ffi.register_ffi_target(name, capsule, platform=key)
            served.add(platform)
    return frozenset(served)


def require_platform(platform: str) -> None:
    """Raises RuntimeError with a rebuild hint when `platform` has no handlers."""
    if platform in registered_platforms():
        return
    if platform == "cuda":
        raise RuntimeError(
            "mok_jax was built without its CUDA handlers, so mok_jax.moe cannot run on "
            "this GPU. Rebuild on a machine with nvcc (CUDA >= 12.8) and Hopper or "
            "newer: `pip install --force-reinstall --no-deps "
            "-C cmake.define.MOK_ENABLE_CUDA=ON .` from the mok_jax source tree.")
    raise RuntimeError(f"mok_jax has no handlers for platform {platform!r}.")
