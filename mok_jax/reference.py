"""Pure-JAX oracle of `mok_jax.moe` with the contract's numerics.

A test oracle only: it runs every expert on every token (E/K times the FLOPs)
so that it stays short and obviously right, and it is differentiable with
plain ``jax.grad``. `mok_jax.moe` never calls it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mok_jax.fp8 import expert_outputs_fp8
from mok_jax.moe import MoEStats, _check_top_k, _validate, capacity
from mok_jax.recipe import Recipe, check_dtypes
from mok_jax.recipe import resolve as resolve_recipe


def routing_masks(expert_ids: jax.Array, num_experts: int, capacity_factor: float | None):
    """Which pairs are valid and which are kept, and the routing statistics.

    Args:
      expert_ids: ``[T, K]`` int32.
    Returns:
      ``(valid [T, K] bool, kept [T, K] bool, MoEStats)``. A valid pair is kept
      when fewer than ``cap`` earlier pairs (token index, then k) chose its expert.
    """
    tokens, top_k = expert_ids.shape
    valid = (expert_ids >= 0) & (expert_ids < num_experts)
    flat = expert_ids.reshape(-1)
    onehot = (flat[:, None] == jnp.arange(num_experts)[None, :]) & valid.reshape(-1, 1)
    onehot = onehot.astype(jnp.int32)                               # [T*K, E]
    earlier = jnp.cumsum(onehot, axis=0) - onehot                   # pairs before, same expert
    position = jnp.sum(earlier * onehot, axis=1).reshape(tokens, top_k)
    cap = capacity(capacity_factor, tokens, top_k, num_experts)
    kept = valid if cap is None else valid & (position < cap)
    routed = jnp.sum(onehot, axis=0).astype(jnp.int32)
    stats = MoEStats(
        tokens_per_expert=routed,
        dropped=jnp.sum(valid & ~kept).astype(jnp.int32),
        invalid=jnp.sum(~valid).astype(jnp.int32),
    )
    return valid, kept, stats


def moe_reference(x, expert_ids, expert_weights, w_gate_up, w_down, *,
                  capacity_factor=None, recipe=None, return_stats=False):
    """Same contract as `mok_jax.moe` for one device (no ``axis_name``); `recipe`
    as `mok_jax.moe`'s.

    With ``recipe="fp8"`` (bfloat16 x and weights) the experts follow the fp8
    recipe's forward (`mok_jax.fp8.expert_outputs_fp8`: the same blocks, scales,
    e4m3 values and f32 accumulation per block; the sums inside a block may be
    added in another order than the kernels'). Its ``jax.grad`` differentiates
    that jnp code with each quantized value ``q8(v, s) * s`` taken as ``v`` (a
    straight-through estimator, the scales held constant), which is not the
    recipe's backward: compare gradients with an emulation of the backward."""
    recipe = resolve_recipe(recipe, "moe_reference")
    check_dtypes(recipe, "moe_reference", x=x, w_gate_up=w_gate_up, w_down=w_down)
    # mok_jax.moe's checks of the arrays, before jax.jit sees them: a ValueError
    # naming the argument, not a result from mismatched shapes (JAX's indexing
    # clamps) or dtypes.
    num_experts, _ = _validate(x, expert_ids, expert_weights, w_gate_up, w_down,
                               axis_name=None, capacity_factor=capacity_factor,
                               backend="auto", where="moe_reference")
    _check_top_k(expert_ids, w_gate_up, num_experts, where="moe_reference")
    return _moe_reference(x, expert_ids, expert_weights, w_gate_up, w_down,
                          capacity_factor=capacity_factor, recipe=recipe,
                          return_stats=return_stats)


# Jitted: one XLA program per shape instead of an op-by-op run (which compiles
# every operation for each new shape: seconds per call on a CPU).
@functools.partial(jax.jit, static_argnames=("capacity_factor", "recipe", "return_stats"))
def _moe_reference(x, expert_ids, expert_weights, w_gate_up, w_down, *,
                   capacity_factor, recipe, return_stats):
    num_experts = w_gate_up.shape[0]
    ffn = w_down.shape[1]
    _, kept, stats = routing_masks(expert_ids, num_experts, capacity_factor)
    safe_ids = jnp.where(kept, expert_ids, 0)

    # Which tokens each expert takes (a kept pair), and which experts take any. The
    # weights of an expert no pair reaches are zeros here and so are the x rows an
    # expert does not take, selected by `where`: a NaN or inf in them must not
    # reach y or the gradients (0 * NaN), as in `mok_jax.moe`, which never reads
    # them. Zero rows leave the fp8 recipe's other rows alone (no block spans two
    # rows).
    takes = jnp.any(kept[:, :, None] & (safe_ids[:, :, None] == jnp.arange(num_experts)),
                    axis=1).T                                        # [E, T]
    used = jnp.any(takes, axis=1)[:, None, None]                     # [E, 1, 1]
    w_gate_up = jnp.where(used, w_gate_up, 0)
    w_down = jnp.where(used, w_down, 0)
    # Every expert on every token (the rows it does not take as zeros). x_e is f32
    # so that dx sums the experts' parts before its one rounding.
    x_e = jnp.where(takes[:, :, None], x.astype(jnp.float32)[None], 0.0)  # [E, T, H]

    if recipe == Recipe.FP8:
        o = expert_outputs_fp8(x_e, w_gate_up, w_down)              # [E, T, H]
    else:
        # [E, T, 2F] in f32
        gate_up = jnp.einsum("eth,ehf->etf", x_e, w_gate_up, preferred_element_type=jnp.float32)
        g, u = gate_up[..., :ffn], gate_up[..., ffn:]
        h = (g * jax.nn.sigmoid(g) * u).astype(x.dtype)
        o = jnp.einsum("etf,efh->eth", h, w_down, preferred_element_type=jnp.float32)
        o = o.astype(x.dtype).astype(jnp.float32)                    # [E, T, H]

    tokens = jnp.arange(x.shape[0])
    weights = expert_weights.astype(jnp.float32)
    acc = jnp.zeros(x.shape, jnp.float32)
    for k in range(expert_ids.shape[1]):                             # ascending k
        o_k = o[safe_ids[:, k], tokens]                              # [T, H]
        # Mask the weight too: a NaN weight on a dropped pair must not reach
        # the gradients through the unselected branch of `where`.
        w_k = jnp.where(kept[:, k], weights[:, k], 0.0)[:, None]
        acc = acc + jnp.where(kept[:, k, None], w_k * o_k, 0.0)
    y = acc.astype(x.dtype)
    return (y, stats) if return_stats else y
