"""Accuracy of `mok_jax.moe`'s recipes against the unquantized float64 math.

    python scripts/fp8_accuracy.py                      # the default shapes, --quick size
    python scripts/fp8_accuracy.py --full               # the default shapes, full (a GPU)
    python scripts/fp8_accuracy.py --shape mine=256,8,32,256,128

For each shape: the bench's bf16 inputs (mok_jax.bench.make_inputs) and cotangent,
the layer's y and its gradients (x, expert_weights, w_gate_up, w_down) in float64
from the formula written here (every token through its K experts, SwiGLU,
weighted sum; no rounding anywhere; one float64 matmul per expert), then each
recipe's y and gradients from `mok_jax.moe` on the default device, and the
relative Frobenius error of each against the float64 values.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import mok_jax  # noqa: E402
from mok_jax import bench  # noqa: E402

OUTPUTS = ("y", "dx", "d_expert_weights", "d_w_gate_up", "d_w_down")


def grouped_f64(expert_ids: np.ndarray):
    """y[t] = sum_k w[t, k] * FFN_e(x[t]) with e = expert_ids[t, k], in float64, as
    a function of (x, expert_ids, expert_weights, w_gate_up, w_down): the (token, k)
    pairs grouped by expert, one float64 matmul per expert (memory linear in T*K, so
    it runs at the bench's full shapes). `expert_ids` is concrete (host) so the
    groups are static slices."""
    ids = np.asarray(expert_ids)
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=int(flat.max()) + 1)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    tokens = jnp.asarray(order // k, jnp.int32)
    inverse = jnp.asarray(np.argsort(order, kind="stable"), jnp.int32)

    def fn(x, expert_ids_unused, expert_weights, w_gate_up, w_down):
        del expert_ids_unused
        x, w, wgu, wd = (a.astype(jnp.float64) for a in (x, expert_weights, w_gate_up, w_down))
        f = w_down.shape[1]
        rows = x[tokens]
        outs = []
        for e in range(len(counts)):
            lo, hi = int(bounds[e]), int(bounds[e + 1])
            if hi == lo:
                continue
            gu = rows[lo:hi] @ wgu[e]
            outs.append((jax.nn.silu(gu[:, :f]) * gu[:, f:]) @ wd[e])
        out = jnp.concatenate(outs)[inverse].reshape(t, k, -1)
        return jnp.einsum("tk,tkh->th", w, out)

    return fn


def outputs(fn, inputs, dtype=None):
    """y and the VJP of y with the bench's cotangent, w.r.t. x, weights, w_gate_up, w_down;
    with `dtype`, the inputs (exact bf16 values) are cast to it first, so the reference's
    gradients are not rounded to the inputs' dtype."""
    ids = inputs["expert_ids"]

    def layer(x, w, wgu, wd):
        return fn(x, ids, w, wgu, wd)

    args = [inputs[n] for n in ("x", "expert_weights", "w_gate_up", "w_down")]
    if dtype is not None:
        args = [a.astype(dtype) for a in args]
    y, vjp = jax.vjp(layer, *args)
    return (y,) + vjp(inputs["dy"].astype(y.dtype))


def rel_fro(got, want):
    got, want = got.astype(jnp.float64), want.astype(jnp.float64)
    return float(jnp.linalg.norm((got - want).ravel()) / jnp.linalg.norm(want.ravel()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", type=bench.custom_shape, default=[],
                        help="[NAME=]T,K,E,H,F (repeatable); default: the --quick shapes")
    parser.add_argument("--full", action="store_true",
                        help="the bench's default shapes at full size (a GPU)")
    parser.add_argument("--recipes", default="native,fp8")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    table = bench.FULL_SHAPES if args.full else bench.QUICK_SHAPES
    defaults = [table[name] for name in bench.DEFAULT_SHAPES]
    shapes = (defaults if args.full or not args.shape else []) + args.shape
    recipes = [r for r in args.recipes.split(",") if r]
    print(f"relative Frobenius error against float64, {jax.devices()[0].device_kind}, "
          f"bf16 inputs")
    print("| shape (T, K, E, H, F) | recipe | " + " | ".join(OUTPUTS) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in OUTPUTS) + " |")
    for shape in shapes:
        inputs = bench.make_inputs(shape, jnp.bfloat16, args.seed)
        reference = grouped_f64(np.asarray(inputs["expert_ids"]))
        want = jax.jit(functools.partial(outputs, reference, dtype=jnp.float64))(inputs)
        del reference
        for recipe in recipes:
            fn = functools.partial(mok_jax.moe, recipe=recipe)
            got = jax.jit(functools.partial(outputs, fn))(inputs)
            errs = " | ".join(f"{rel_fro(g, w):.2e}" for g, w in zip(got, want))
            dims = (shape.tokens, shape.top_k, shape.experts, shape.hidden, shape.ffn)
            print(f"| {shape.name} {dims} | {recipe} | {errs} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
