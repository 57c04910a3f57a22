"""Times the training example's non-MoE parts, forward+backward, in candidate forms.

    python examples/bench_model_parts.py                 # the h200 preset's shapes, one layer
    python examples/bench_model_parts.py --small         # tiny shapes (a CPU check)

A profile of the h200 preset on 2026-11-30 (one H200, 46bb026) put 3.5 ms a
step in the router's three f32 dots and 4.3 ms in the glue around cuDNN
attention (the q/k/v split, RoPE, their transposes); docs/ledger.md, 2026-12-01,
has what came of both. Each candidate here computes the same function
as the example's code (`current`); the script prints one layer's forward+backward
median time per candidate next to `current`'s, measured in the same process, and
the largest relative error of its outputs and gradients against it.

Router candidates against `mok_jax.router.router_logits` (bf16 products of the
tokens with the kernel's exact three-term bf16 split): XLA's f32 dot with
`Precision.HIGHEST` (`highest`, the layer's form before d323f28) and
`jax.lax.DotAlgorithmPreset` algorithms (BF16_BF16_F32_X6 keeps f32 accuracy in
six bf16 passes; X3 is close to it). Attention candidates: q, k, v from slices
of the weight instead of slices of the projection (`sliced_weights`), RoPE
written as x * cos + rotate_half(x) * sin with the sign folded into sin
(`rotate_half`: the same products and sums, though the compiler may contract
them into different fused multiply-adds). Norm candidates, a residual add and
the RMSNorm after it: the example's `nnx.RMSNorm` (autodiff) against `rms_norm`,
the same function with a backward of its own (`custom_vjp`), and
`mok_jax.add_rms_norm`, the add and the norm in one CUDA kernel each way on a
GPU (`fused`, the example's `--norm fused`).

Times are the wall time of one jitted call each (dispatch included): a router
layer's forward+backward is ~0.3 ms on an H200, so read its differences against
that. On a CPU, XLA ignores the dot algorithms (those candidates run in f32).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_lm as lm  # noqa: E402
from cli_args import positive_int  # noqa: E402  (examples/)

import mok_jax  # noqa: E402
import mok_jax.nn as mnn  # noqa: E402
from mok_jax.bench.measure import error_string, rel_fro, time_step  # noqa: E402

ROUTER = {
    "current": None,  # mok_jax.router.router_logits, router_dot="auto"
    "highest": jax.lax.Precision.HIGHEST,
    "bf16x6": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6,
    "bf16x3": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
}


def router_logits(name: str):
    def f(tokens, kernel):  # tokens [T, H] compute dtype, kernel [H, E] f32
        if ROUTER[name] is None:
            return mnn.router_logits(tokens, kernel)
        return jnp.dot(tokens.astype(jnp.float32), kernel, precision=ROUTER[name])
    return f


def rope_rotate_half(x: jax.Array, base: float = 10000.0) -> jax.Array:
    """`lm.rope` as x * cos + rotate_half(x) * sin, sin's sign folded in: per
    element the same products and sum as `lm.rope` (the bits can differ where the
    compiler contracts a product and the sum into a fused multiply-add)."""
    _, seq, _, dim = x.shape
    inv_freq = base ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    cos2 = jnp.concatenate([cos, cos], axis=-1)[None, :, None, :]
    sin2 = jnp.concatenate([-sin, sin], axis=-1)[None, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    return (xf * cos2 + jnp.concatenate([x2, x1], axis=-1) * sin2).astype(x.dtype)


ATTENTION = ("current", "sliced_weights", "rotate_half")


def attention(name: str, heads: int, implementation: str, dtype):
    def f(x, w_qkv, w_out):  # x [B, S, d]; f32 parameters, cast like nnx.Linear
        batch, seq, d = x.shape
        w_qkv, w_out = w_qkv.astype(dtype), w_out.astype(dtype)
        if name == "sliced_weights":
            q, k, v = (x @ w_qkv[:, i * d:(i + 1) * d] for i in range(3))
        else:
            q, k, v = jnp.split(x @ w_qkv, 3, axis=-1)
        q, k, v = (a.reshape(batch, seq, heads, d // heads) for a in (q, k, v))
        rope = rope_rotate_half if name == "rotate_half" else lm.rope
        o = jax.nn.dot_product_attention(rope(q), rope(k), v, is_causal=True,
                                         implementation=implementation)
        return o.reshape(batch, seq, d) @ w_out
    return f


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x: jax.Array, scale: jax.Array, epsilon: float = 1e-6) -> jax.Array:
    """``nnx.RMSNorm(dtype=x.dtype)``'s function, with a backward of its own.

    Forward as flax computes it: the scale cast to x's dtype, the mean of squares
    in f32, ``y = round_x(f32(x) * (rsqrt(mean + eps) * f32(scale)))``. The
    backward keeps x as it came and one f32 value a row, and computes the
    gradients in f32 from them: dx = r g - x r^3 mean(g x) with g = dy scale and
    r = rsqrt(mean + eps), and the scale's gradient sum(dy x r) over the tokens,
    rounded to x's dtype first as autodiff rounds the cotangent of the cast
    scale. Slower on an H200 than autodiff of nnx.RMSNorm (docs/ledger.md,
    2026-12-01), so the example does not use it: its norms are
    `mok_jax.add_rms_norm` on a GPU and nnx.RMSNorm elsewhere."""
    return _rms_norm_fwd(x, scale, epsilon)[0]


def _rms_norm_fwd(x, scale, epsilon):
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + epsilon)
    s = scale.astype(x.dtype).astype(jnp.float32)
    return (xf * (r * s)).astype(x.dtype), (x, r, scale)


def _rms_norm_bwd(epsilon, residuals, dy):
    del epsilon
    x, r, scale = residuals
    xf, dyf = x.astype(jnp.float32), dy.astype(jnp.float32)
    g = dyf * scale.astype(x.dtype).astype(jnp.float32)
    c = jnp.mean(g * xf, axis=-1, keepdims=True)
    dx = (r * g - xf * (r * r * r * c)).astype(x.dtype)
    ds = jnp.sum((dyf * xf) * r, axis=tuple(range(x.ndim - 1)))
    return dx, ds.astype(x.dtype).astype(scale.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


NORM = ("current", "custom_vjp", "fused")


def norm_block(name: str, d: int, dtype):
    """A residual add and the RMSNorm after it, as in a block: ``(x + o, norm(x + o))``;
    `current` is the example's nnx.RMSNorm (autodiff), `custom_vjp` `rms_norm`,
    `fused` `mok_jax.add_rms_norm` (the scale in the norm's dtype, as nnx casts it)."""
    from flax import nnx  # pylint: disable=import-outside-toplevel
    graphdef, state = nnx.split(nnx.RMSNorm(d, dtype=dtype, rngs=nnx.Rngs(0)))

    def f(x, o, scale):
        if name == "fused":
            return mok_jax.add_rms_norm(x, o, scale.astype(dtype))
        h = x + o
        if name == "custom_vjp":
            return h, rms_norm(h, scale)
        return h, nnx.merge(graphdef, jax.tree.map(lambda _: scale, state))(h)
    return f


def fwd_bwd(f, random_cotangent: bool = False):
    """One jitted forward+backward of `f`, pulled back with ones, or (the norm's
    candidates, whose backward with a cotangent of ones would not show whether
    it reads dy at all) with a random cotangent passed in as the step's first
    argument (`random_cotangent_of`): a buffer in memory, as in training. Drawn
    inside the step, XLA likely fused the drawing into the backward of the
    candidates it could see through and never wrote the cotangent (docs/ledger.md,
    2026-12-01)."""
    def step(*args):
        cot, args = (args[0], args[1:]) if random_cotangent else (None, args)
        y, pullback = jax.vjp(f, *args)
        leaves, tree = jax.tree.flatten(y)
        if cot is None:
            cot = [jnp.ones_like(a) for a in leaves]
        return y, pullback(jax.tree.unflatten(tree, cot))
    return jax.jit(step)


def random_cotangent_of(f, args) -> list[jax.Array]:
    """A random cotangent for `f`'s outputs on `args` (normal, in their dtypes)."""
    avals = jax.tree.leaves(jax.eval_shape(f, *args))
    keys = jax.random.split(jax.random.key(42), len(avals))
    return [jax.random.normal(k, a.shape, jnp.float32).astype(a.dtype)
            for k, a in zip(keys, avals)]


def max_rel_diff(a, b) -> float:
    """The largest relative Frobenius error over the outputs (`mok_jax.bench`'s measure)."""
    return max(float(rel_fro(x, y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def run(small: bool = False, warmup: int = 3, repeats: int = 20,
        parts: tuple[str, ...] | None = None) -> list[dict]:
    cfg = lm.PRESETS["tiny" if small else "h200"]
    dtype = jnp.dtype(cfg.dtype)
    batch, seq, d, experts = cfg.batch, cfg.seq, cfg.d_model, cfg.n_experts
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (batch, seq, d), jnp.float32).astype(dtype)
    router_kernel = jax.random.normal(keys[1], (d, experts), jnp.float32) / np.sqrt(d)
    w_qkv = jax.random.normal(keys[2], (d, 3 * d), jnp.float32) / np.sqrt(d)
    w_out = jax.random.normal(keys[3], (d, d), jnp.float32) / np.sqrt(d)
    implementation = lm.attention_implementation("auto", dtype, d // cfg.n_heads)
    groups = {
        "router": ({name: router_logits(name) for name in ROUTER},
                   # bf16 tokens, as in the h200 preset (so --small runs the split too)
                   (x.reshape(-1, d).astype(jnp.bfloat16), router_kernel)),
        "attention": ({name: attention(name, cfg.n_heads, implementation, dtype)
                       for name in ATTENTION},
                      (x, w_qkv, w_out)),
        "norm": ({name: norm_block(name, d, dtype) for name in NORM},
                 (x, jax.random.normal(keys[4], x.shape, jnp.float32).astype(dtype),
                  1.0 + 0.1 * jax.random.normal(keys[5], (d,), jnp.float32))),
    }
    groups = {k: v for k, v in groups.items() if parts is None or k in parts}
    rows = []
    for part, (candidates, args) in groups.items():
        reference = None
        for name, f in candidates.items():
            try:  # a backend may not implement a candidate (a dot algorithm): say so, go on
                step_args = (random_cotangent_of(f, args), *args) if part == "norm" else args
                _, times, compiled = time_step(fwd_bwd(f, random_cotangent=part == "norm"),
                                               step_args, warmup=warmup, repeats=repeats)
                out = compiled(*step_args)
            except Exception as e:  # pylint: disable=broad-except
                if name == "current":
                    raise
                rows.append({"part": part, "candidate": name, "median_ms": None,
                             "max_rel_diff": None, "error": error_string(e)})
                continue
            reference = out if reference is None else reference
            rows.append({"part": part, "candidate": name, "median_ms": statistics.median(times),
                         "max_rel_diff": max_rel_diff(out, reference)})
    for part in groups:
        base = next(r for r in rows if r["part"] == part and r["candidate"] == "current")
        for r in rows:
            if r["part"] == part and r["median_ms"] is not None:
                r["vs_current"] = r["median_ms"] / base["median_ms"]
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="the tiny preset's shapes")
    parser.add_argument("--repeats", type=positive_int, default=20)
    parser.add_argument("--parts", nargs="+", choices=("router", "attention", "norm"),
                        help="the groups to time (default: all)")
    args = parser.parse_args(argv)
    rows = run(small=args.small, repeats=args.repeats,
               parts=tuple(args.parts) if args.parts else None)
    print(f"{'part':<10} {'candidate':<15} {'ms (fwd+bwd)':>12} {'vs current':>10} "
          f"{'max rel diff':>12}")
    for r in rows:
        if r["median_ms"] is None:
            print(f"{r['part']:<10} {r['candidate']:<15} not run: {r['error']}")
            continue
        print(f"{r['part']:<10} {r['candidate']:<15} {r['median_ms']:>12.3f} "
              f"{r['vs_current']:>10.3f} {r['max_rel_diff']:>12.2e}")
    return rows


if __name__ == "__main__":
    main()
