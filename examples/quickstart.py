"""Quickstart: one mok_jax.moe call on random data, checked against the reference.

    python examples/quickstart.py [--tokens 256] [--dtype bfloat16]

Prints the output shape, the routing statistics, and the largest difference
from the pure-JAX reference (mok_jax.reference) for the output and for every
gradient.
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import mok_jax
from mok_jax.reference import moe_reference

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_args import positive_float, positive_int  # noqa: E402  (examples/)


def main(argv=None) -> dict:
    """Runs the check; returns the relative errors by name ("y", "dx", ...)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=positive_int, default=256)
    parser.add_argument("--top-k", type=positive_int, default=2)
    parser.add_argument("--experts", type=positive_int, default=8)
    parser.add_argument("--hidden", type=positive_int, default=128)
    parser.add_argument("--ffn", type=positive_int, default=256)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--capacity-factor", type=positive_float, default=None)
    args = parser.parse_args(argv)
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} exceeds --experts {args.experts}")

    T, K, E, H, F = args.tokens, args.top_k, args.experts, args.hidden, args.ffn
    dtype = jnp.dtype(args.dtype)
    k_x, k_r, k_gu, k_d = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k_x, (T, H)).astype(dtype)
    # Router: softmax over experts, top-k, renormalised.
    logits = jax.random.normal(k_r, (T, E))
    weights, expert_ids = jax.lax.top_k(jax.nn.softmax(logits), K)
    weights = weights / weights.sum(axis=1, keepdims=True)
    expert_ids = expert_ids.astype(jnp.int32)
    w_gate_up = (jax.random.normal(k_gu, (E, H, 2 * F)) * H**-0.5).astype(dtype)
    w_down = (jax.random.normal(k_d, (E, F, H)) * F**-0.5).astype(dtype)

    operands = (x, expert_ids, weights, w_gate_up, w_down)
    y, stats = jax.jit(lambda *a: mok_jax.moe(*a, capacity_factor=args.capacity_factor,
                                              return_stats=True))(*operands)
    y_ref = moe_reference(*operands, capacity_factor=args.capacity_factor)

    def loss(fn):
        return lambda x, w, gu, d: jnp.sum(
            fn(x, expert_ids, w, gu, d, capacity_factor=args.capacity_factor)
            .astype(jnp.float32) ** 2)

    grads = jax.jit(jax.grad(loss(mok_jax.moe), argnums=(0, 1, 2, 3)))(
        x, weights, w_gate_up, w_down)
    grads_ref = jax.grad(loss(moe_reference), argnums=(0, 1, 2, 3))(
        x, weights, w_gate_up, w_down)

    def max_err(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))

    print(f"mok_jax {mok_jax.__version__} on {jax.default_backend()}: "
          f"T={T} K={K} E={E} H={H} F={F} {dtype.name}")
    print(f"y {y.shape} {y.dtype}; tokens per expert {np.asarray(stats.tokens_per_expert)}, "
          f"dropped {int(stats.dropped)}, invalid {int(stats.invalid)}")
    errors = {"y": max_err(y, y_ref)}
    print(f"max |y - reference| / max |reference|: {errors['y']:.3e}")
    for name, g, g_ref in zip(("x", "expert_weights", "w_gate_up", "w_down"), grads, grads_ref):
        errors[f"d{name}"] = max_err(g, g_ref)
        print(f"max |d{name} - reference| / max |reference|: {errors[f'd{name}']:.3e}")
    return errors


if __name__ == "__main__":
    main()
