"""Accuracy of `mok_jax.moe`'s recipes against the unquantized float64 math.

    python scripts/fp8_accuracy.py                      # the bench's --quick shapes
    python scripts/fp8_accuracy.py --shape mine=256,8,32,256,128

For each shape: the bench's bf16 inputs (mok_jax.bench.make_inputs) and cotangent,
the layer's y and its gradients (x, expert_weights, w_gate_up, w_down) in float64
from the dense formula written here (every token through its K experts, SwiGLU,
weighted sum; no rounding anywhere), then each recipe's y and gradients from
`mok_jax.moe` on the default device, and the relative Frobenius error of each
against the float64 values.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402

import mok_jax  # noqa: E402
from mok_jax import bench  # noqa: E402

OUTPUTS = ("y", "dx", "d_expert_weights", "d_w_gate_up", "d_w_down")


def dense_f64(x, expert_ids, expert_weights, w_gate_up, w_down):
    """y[t] = sum_k w[t, k] * FFN_e(x[t]) with e = expert_ids[t, k], in float64."""
    x, w, wgu, wd = (a.astype(jnp.float64) for a in (x, expert_weights, w_gate_up, w_down))
    f = w_down.shape[1]
    gu = jnp.einsum("th,tkhj->tkj", x, wgu[expert_ids])
    h = jax.nn.silu(gu[..., :f]) * gu[..., f:]
    out = jnp.einsum("tkf,tkfh->tkh", h, wd[expert_ids])
    return jnp.einsum("tk,tkh->th", w, out)


def outputs(fn, inputs):
    """y and the VJP of y with the bench's cotangent, w.r.t. x, weights, w_gate_up, w_down."""
    ids = inputs["expert_ids"]

    def layer(x, w, wgu, wd):
        return fn(x, ids, w, wgu, wd)

    y, vjp = jax.vjp(layer, inputs["x"], inputs["expert_weights"], inputs["w_gate_up"],
                     inputs["w_down"])
    return (y,) + vjp(inputs["dy"].astype(y.dtype))


def rel_fro(got, want):
    got, want = got.astype(jnp.float64), want.astype(jnp.float64)
    return float(jnp.linalg.norm((got - want).ravel()) / jnp.linalg.norm(want.ravel()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", type=bench.custom_shape, default=[],
                        help="[NAME=]T,K,E,H,F (repeatable); default: the --quick shapes")
    parser.add_argument("--recipes", default="native,fp8")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shapes = args.shape or list(bench.QUICK_SHAPES.values())
    recipes = [r for r in args.recipes.split(",") if r]
    print(f"relative Frobenius error against float64, {jax.devices()[0].device_kind}, "
          f"bf16 inputs")
    print("| shape (T, K, E, H, F) | recipe | " + " | ".join(OUTPUTS) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in OUTPUTS) + " |")
    for shape in shapes:
        inputs = bench.make_inputs(shape, jnp.bfloat16, args.seed)
        want = jax.jit(functools.partial(outputs, dense_f64))(inputs)
        for recipe in recipes:
            fn = functools.partial(mok_jax.moe, recipe=recipe)
            got = jax.jit(functools.partial(outputs, fn))(inputs)
            errs = " | ".join(f"{rel_fro(g, w):.2e}" for g, w in zip(got, want))
            dims = (shape.tokens, shape.top_k, shape.experts, shape.hidden, shape.ffn)
            print(f"| {shape.name} {dims} | {recipe} | {errs} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
