"""The recipe of the expert FFN: how its GEMMs compute.

One value per numeric variant of the layer, carried unchanged from `mok_jax.moe`
(and `mok_jax.nn.MoE`) through the execution paths and primitives to one
attribute of every expert-FFN handler, which passes it to the kernels. The values
are the C++ enum ``mok::Recipe`` (ffi/include/mok/types.h), exported by the
bindings; nothing here restates them.

* ``Recipe.NATIVE`` (``recipe=None``): every expert GEMM in x.dtype (bf16 or f32)
  with f32 accumulation -- the numerics of docs/contract.md.
* ``Recipe.FP8`` (``recipe="fp8"``): every expert GEMM in float8_e4m3fn with f32
  block scales (1x128 along the reduction for activations, 128x128 for weights,
  128x1 along the expert's rows for the weight gradients) and f32 accumulation;
  x and the expert weights must be bfloat16 (docs/contract.md, "The fp8 recipe").
  `mok_jax.quantize_rows_fp8` is its quantizer.
"""

from __future__ import annotations

import enum

import jax.numpy as jnp
import numpy as np

from mok_jax._src import ext

Recipe = enum.IntEnum(
    "Recipe", {name.upper(): value for name, value in ext.recipes().items()},
    module=__name__)
Recipe.__doc__ = "How the expert GEMMs compute (values of the handlers' recipe attribute)."


def resolve(recipe, where: str = "mok_jax.moe") -> Recipe:
    """The `Recipe` of a user's ``recipe`` argument: None (the native recipe), a
    `Recipe`, or a recipe's name; a ValueError naming `where` otherwise."""
    if recipe is None:
        return Recipe.NATIVE
    if isinstance(recipe, Recipe):
        return recipe
    names = {m.name.lower(): m for m in Recipe}
    if isinstance(recipe, str) and recipe in names:
        return names[recipe]
    known = ", ".join(["None"] + [repr(name) for name in names])
    raise ValueError(f"{where}: recipe must be one of {known} (or a mok_jax.Recipe); got "
                     f"{recipe!r}, which this version of mok_jax does not implement")


def check_dtypes(recipe: Recipe, where: str, **arrays) -> None:
    """ValueError naming the first of `arrays` whose dtype `recipe` does not take:
    the fp8 recipe takes bfloat16 x and expert weights only. Arrays without a
    dtype are left to the caller's own checks."""
    if recipe != Recipe.FP8:
        return
    for name, a in arrays.items():
        dtype = getattr(a, "dtype", None)
        if dtype is not None and np.dtype(dtype) != np.dtype(jnp.bfloat16):
            raise ValueError(f"{where}: recipe 'fp8' needs bfloat16 {name}; got "
                             f"{np.dtype(dtype)}")
