"""One differentiable layer over interchangeable execution paths.

A path is a hashable description of how one call runs, with two methods:

* ``forward(x, expert_ids, expert_weights, w_gate_up, w_down, *, save)`` ->
  ``(y, stats, residuals)``; ``save=False`` when no backward will follow;
* ``backward(residuals, dy)`` -> ``(dx, d_expert_weights, d_w_gate_up, d_w_down)``.

`run` wraps any path in the one custom VJP of the library. The paths:
`LocalPath` (one FFI call per pass on one device), `mok_jax._src.ep.ExchangePath` (the
EP layer over a transport, inside shard_map) and `mok_jax._src.sharding.PartitionedPath`
(plain jit on sharded arrays). `mok_jax.moe` chooses one.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from mok_jax._src import primitives
from mok_jax.recipe import Recipe


def forward_one_call(operands, *, capacity: int, recipe: Recipe, save: bool):
    """``(y, gate_up, x_rows, stats)``: the layer on one device in one FFI call
    (``mok_moe_fwd``); the residuals have ``T*K`` rows when `save`, else none."""
    y, gate_up, x_rows, *stats = primitives.moe_fwd_p.bind(
        *operands, capacity=capacity, recipe=int(recipe), save_gate_up=save)
    return y, gate_up, x_rows, tuple(stats)


def backward_one_call(operands, gate_up, x_rows, dy, *, capacity: int, recipe: Recipe):
    """The four gradients of the layer on one device in one FFI call (``mok_moe_bwd``)."""
    return tuple(primitives.moe_bwd_p.bind(*operands, gate_up, x_rows,
                                           dy.astype(operands[0].dtype), capacity=capacity,
                                           recipe=int(recipe)))


@dataclasses.dataclass(frozen=True)
class LocalPath:
    """The whole layer in one FFI call per pass (``mok_moe_fwd``, ``mok_moe_bwd``)."""

    capacity: int
    recipe: Recipe

    def forward(self, x, expert_ids, expert_weights, w_gate_up, w_down, *, save):
        operands = (x, expert_ids, expert_weights, w_gate_up, w_down)
        y, gate_up, x_rows, stats = forward_one_call(operands, capacity=self.capacity,
                                                     recipe=self.recipe, save=save)
        return y, stats, (operands, gate_up, x_rows)

    def backward(self, residuals, dy):
        operands, gate_up, x_rows = residuals
        return backward_one_call(operands, gate_up, x_rows, dy, capacity=self.capacity,
                                 recipe=self.recipe)


SECOND_ORDER = (
    "mok_jax.moe has no second-order derivatives (jax.grad of jax.grad, jax.hessian, "
    "jax.jvp of a gradient): it is a custom VJP whose forward and backward kernels "
    "have no derivative rules. Differentiate it once, in reverse mode")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def run(path, x, expert_ids, expert_weights, w_gate_up, w_down):
    """``(y, stats)`` of one MoE call along `path`; differentiable w.r.t. x,
    expert_weights, w_gate_up and w_down (expert_ids are integers)."""
    y, stats, _ = path.forward(x, expert_ids, expert_weights, w_gate_up, w_down, save=False)
    return y, stats


def _run_fwd(path, x, expert_ids, expert_weights, w_gate_up, w_down):
    forward = primitives.first_order_only(functools.partial(path.forward, save=True),
                                          SECOND_ORDER)
    y, stats, residuals = forward(x, expert_ids, expert_weights, w_gate_up, w_down)
    return (y, stats), (expert_ids, residuals)


def _run_bwd(path, saved, cotangents):
    expert_ids, residuals = saved
    dy, _ = cotangents  # the statistics are integers: no cotangent
    backward = primitives.first_order_only(path.backward, SECOND_ORDER)
    dx, d_weights, d_w_gate_up, d_w_down = backward(residuals, dy)
    d_ids = np.zeros(expert_ids.shape, dtype=jax.dtypes.float0)
    return dx, d_ids, d_weights, d_w_gate_up, d_w_down


run.defvjp(_run_fwd, _run_bwd)
