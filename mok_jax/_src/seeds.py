"""Keys from integer seeds of up to 63 bits, whatever `jax_enable_x64` says."""

from __future__ import annotations

import operator

import jax
import numpy as np

SEED_LIMIT = 2**63  # seeds are integers in [0, SEED_LIMIT): numpy's and JAX's int64


def seed_key(seed: int) -> jax.Array:
    """The threefry key of ``seed``, an integer in [0, 2^63): its high and low 32 bits,
    the key ``jax.random.key(seed)`` makes with 64-bit integers on. Without them
    (JAX's default) ``jax.random.key`` keeps the low 32 bits alone, so seeds 2^32
    apart would draw the same numbers; below 2^32 the two keys are the same.

    Raises ValueError for a seed outside [0, 2^63) and TypeError for a non-integer."""
    seed = operator.index(seed)
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be an integer in [0, 2^63), got {seed}")
    return jax.random.wrap_key_data(np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32),
                                    impl="threefry2x32")
