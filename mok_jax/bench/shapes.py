"""The bench's problems: the named shapes (full, and scaled for a 2-core CPU), the
custom ones of `--shape`, and their random inputs and routing (made outside every
timed function)."""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mok_jax._src.seeds import seed_key


@dataclasses.dataclass(frozen=True)
class Shape:
    """One MoE layer problem: T tokens, top-K of E experts, hidden H, expert FFN F."""

    name: str
    tokens: int      # T (per GPU)
    top_k: int       # K
    experts: int     # E (global; all local in a single-device run)
    hidden: int      # H
    ffn: int         # F

    def gemm_flops(self, pass_name: str) -> int:
        """GEMM FLOPs of one pass: fwd 6*T*K*H*F, fwdbwd 18*T*K*H*F."""
        per_pair = 6 * self.tokens * self.top_k * self.hidden * self.ffn
        return {"fwd": per_pair, "fwdbwd": 3 * per_pair}[pass_name]


# The bench shapes (T is per device). `ep` is one device's work in the EP problem
# (128 experts, 4096 tokens per device) with all 128 experts local.
FULL_SHAPES = {
    s.name: s for s in (
        Shape("small-experts", 16384, 8, 128, 2048, 768),
        Shape("deepseek-slice", 8192, 8, 64, 7168, 2048),
        Shape("mixtral-like", 16384, 2, 8, 4096, 14336),
        Shape("ep", 4096, 8, 128, 7168, 2048),
        Shape("olmoe-like", 16384, 8, 64, 2048, 1024),
        Shape("gpt-oss-like", 16384, 4, 128, 2880, 2880),
        Shape("qwen3-like", 16384, 8, 128, 4096, 1536),
        Shape("few-tokens", 256, 8, 128, 2048, 768),
        Shape("preset", 32768, 4, 32, 1024, 1024),
    )
}

# What a run times without --shapes or --shape; the other named shapes run when
# --shapes names them.
DEFAULT_SHAPES = ("small-experts", "deepseek-slice", "mixtral-like", "ep")

# The same problems scaled for a 2-core CPU (the default ones, every impl, both
# passes in a few minutes): T / 16-128, H and F / 16, K kept, E at most 32: 4 to 64
# rows per expert (T*K/E), few-tokens the fewest as in the full shapes.
QUICK_SHAPES = {
    s.name: s for s in (
        Shape("small-experts", 256, 8, 32, 128, 48),
        Shape("deepseek-slice", 128, 8, 16, 448, 128),
        Shape("mixtral-like", 128, 2, 8, 256, 896),
        Shape("ep", 64, 8, 32, 448, 128),
        Shape("olmoe-like", 256, 8, 32, 128, 64),
        Shape("gpt-oss-like", 256, 4, 32, 184, 180),
        Shape("qwen3-like", 256, 8, 32, 256, 96),
        Shape("few-tokens", 16, 8, 32, 128, 48),
        Shape("preset", 256, 4, 32, 64, 64),
    )
}

# What each bench shape stands for (its dimensions are printed from the Shape).
SHAPE_ABOUT = {
    "small-experts": "many small experts",
    "deepseek-slice": "DeepSeek-V3-sized experts, a slice of the expert set",
    "mixtral-like": "few large experts, top-2 (Mixtral-like)",
    "ep": "one device's share of the EP problem, all experts local "
          "(the default --ep shape)",
    "olmoe-like": "OLMoE-1B-7B's experts",
    "gpt-oss-like": "gpt-oss-120b's experts (H and F not multiples of 128)",
    "qwen3-like": "Qwen3-235B-A22B's experts",
    "few-tokens": "small-experts with 256 tokens (eval, small batches, a rank's "
                  "share at high EP): reading the weights dominates",
    "preset": "the MoE layer of examples/train_moe_lm.py's h200 preset (4096 rows "
              "per expert)",
}


def _input_keys(seed: int) -> jax.Array:
    # seed_key: every seed of [0, 2^63) its own inputs (jax.random.key keeps the
    # low 32 bits of a seed when jax_enable_x64 is off).
    return jax.random.split(seed_key(seed), 6)


def make_routing(shape: Shape, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """(expert_ids [T, K] int32, expert_weights [T, K] f32): the routing of
    make_inputs(shape, ..., seed), made alone (no weights)."""
    logits = jax.random.normal(_input_keys(seed)[0], (shape.tokens, shape.experts),
                               jnp.float32)
    top_logits, expert_ids = jax.lax.top_k(logits, shape.top_k)
    return expert_ids.astype(jnp.int32), jax.nn.softmax(top_logits, axis=-1)


def skewed_expert_ids(shape: Shape, load_max: float, seed: int = 0,
                      hot: int = 0) -> np.ndarray:
    """expert_ids [T, K] int32 routed like an unbalanced router: K distinct experts a
    token, expert `hot` (default 0) picked by a share load_max * K / E of the tokens
    (load_max times the mean load; at most E/K, every token), the other experts
    about even. Which expert is the busy one matters to a grouped GEMM that deals
    its groups' tiles in expert order."""
    t, k, e = shape.tokens, shape.top_k, shape.experts
    share = load_max * k / e
    if not 0.0 <= share <= 1.0 or k >= e:
        raise ValueError(f"load_max {load_max}: between 0 and E/K = {e / k:g} (and K < E)")
    if not 0 <= hot < e:
        raise ValueError(f"hot expert {hot}: between 0 and E - 1 = {e - 1}")
    rng = np.random.default_rng(seed)
    others = 1 + np.argsort(rng.random((t, e - 1)), axis=1)[:, :k]  # K distinct of 1..E-1
    picks = rng.random(t) < share
    with_zero = np.concatenate([np.zeros((t, 1), others.dtype), others[:, :k - 1]], axis=1)
    ids = np.where(picks[:, None], with_zero, others)
    swap = np.arange(e)  # experts 0 and `hot` trade places
    swap[[0, hot]] = swap[[hot, 0]]
    return swap[ids].astype(np.int32)


def make_tokens(shape: Shape, dtype, seed: int = 0) -> jax.Array:
    """x [T, H]: the tokens of make_inputs(shape, dtype, seed), made alone."""
    return jax.random.normal(_input_keys(seed)[1], (shape.tokens, shape.hidden),
                             jnp.float32).astype(dtype)


def make_inputs(shape: Shape, dtype, seed: int = 0) -> dict[str, jax.Array]:
    """Random layer inputs and routing (made here, outside every timed function).

    Routing: top-K of [T, E] normal logits; weights are the softmax of the K chosen
    logits. dy is a fixed [T, H] cotangent for the backward pass.
    """
    t, e, h, f = shape.tokens, shape.experts, shape.hidden, shape.ffn
    keys = _input_keys(seed)
    expert_ids, expert_weights = make_routing(shape, seed)
    inputs = {
        "x": make_tokens(shape, dtype, seed),
        "expert_ids": expert_ids,
        "expert_weights": expert_weights,
        "w_gate_up": (jax.random.normal(keys[2], (e, h, 2 * f), jnp.float32)
                      * h ** -0.5).astype(dtype),
        "w_down": (jax.random.normal(keys[3], (e, f, h), jnp.float32)
                   * f ** -0.5).astype(dtype),
        "dy": jax.random.normal(keys[4], (t, h), jnp.float32).astype(dtype),
    }
    return jax.block_until_ready(inputs)


SHAPE_DIMS = ("T", "K", "E", "H", "F")


def custom_shape(text: str) -> Shape:
    """A `--shape` argument, `[NAME=]T,K,E,H,F`: five positive integers with K <= E.

    The default name spells the dimensions, e.g. T4096-K8-E64-H2048-F1024.
    """
    name, sep, dims = text.rpartition("=")
    name = name.strip()
    parts = [part.strip() for part in dims.split(",")]
    if len(parts) != len(SHAPE_DIMS):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not T,K,E,H,F: give five comma-separated positive integers "
            "(tokens, top-K, experts, hidden, expert FFN), optionally as NAME=T,K,E,H,F")
    try:
        values = [int(part) for part in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: T,K,E,H,F must be integers") from None
    bad = [f"{d}={v}" for d, v in zip(SHAPE_DIMS, values) if v < 1]
    if bad:
        raise argparse.ArgumentTypeError(
            f"{text!r}: every dimension must be >= 1 ({', '.join(bad)})")
    tokens, top_k, experts, hidden, ffn = values
    if top_k > experts:
        raise argparse.ArgumentTypeError(
            f"{text!r}: top-K K={top_k} exceeds the number of experts E={experts} "
            "(each token picks K distinct experts, so K <= E)")
    if sep and not name:
        raise argparse.ArgumentTypeError(f"{text!r}: empty NAME before '='")
    name = name or f"T{tokens}-K{top_k}-E{experts}-H{hidden}-F{ffn}"
    if any(c in name for c in ",/= \t"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: a shape name may not contain ',', '/', '=' or spaces")
    if name in FULL_SHAPES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: {name!r} is a bench shape's name; pick another (--shapes "
            f"{name} times the bench shape)")
    return Shape(name, tokens, top_k, experts, hidden, ffn)
