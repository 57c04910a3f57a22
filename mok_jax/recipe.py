"""The recipe of the expert FFN: how its GEMMs compute.

One value per numeric variant of the layer, carried unchanged from `mok_jax.moe`
(and `mok_jax.nn.MoE`) through the execution paths and primitives to one
attribute of every expert-FFN handler, which passes it to the kernels. The values
are the C++ enum ``mok::Recipe`` (ffi/include/mok/types.h), exported by the
bindings; nothing here restates them.

* ``Recipe.NATIVE`` (``recipe=None``): every expert GEMM in x.dtype (bf16 or f32)
  with f32 accumulation -- the numerics of docs/contract.md.
"""

from __future__ import annotations

import enum

from mok_jax import _ext

Recipe = enum.IntEnum(
    "Recipe", {name.upper(): value for name, value in _ext.recipes().items()},
    module=__name__)
Recipe.__doc__ = "How the expert GEMMs compute (values of the handlers' recipe attribute)."


def resolve(recipe, where: str = "mok_jax.moe") -> Recipe:
    """The `Recipe` of a user's ``recipe`` argument: None (the native recipe), a
    `Recipe`, or a recipe's name; a ValueError naming `where` otherwise."""
    if recipe is None:
        return Recipe.NATIVE
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, str) and recipe.upper() in Recipe.__members__:
        return Recipe[recipe.upper()]
    known = ", ".join(["None"] + [repr(m.name.lower()) for m in Recipe])
    raise ValueError(f"{where}: recipe must be one of {known} (or a mok_jax.Recipe); got "
                     f"{recipe!r}, which this version of mok_jax does not implement")
