"""Train a byte-level MoE transformer on the Python standard library's source.

    python examples/train_moe_lm.py                     # tiny preset: CPU, ~1.5 min
    python examples/train_moe_lm.py --preset h200       # sized for one H200 (bf16)
    python examples/train_moe_lm.py --dp 4 --ep 2       # over 8 devices (tokens on all)
    python examples/train_moe_lm.py --host-devices 8 --dp 8    # 8 CPU devices
    python examples/train_moe_lm.py --resume            # continue from OUT/ckpt

The corpus is every ``*.py`` file of the running Python's standard library
(``sysconfig.get_paths()['stdlib']``, site-packages excluded), read as bytes in
sorted path order; about 5% of the files (chosen by a hash of their path) are
held out for evaluation. The model is a decoder-only transformer (RMSNorm,
causal self-attention with RoPE, a `mok_jax.nn.MoE` feed-forward in every
block), trained with AdamW, linear warm-up and cosine decay under one
``jax.jit`` step. Parameters are sharded by their logical axes: experts over
``ep``, everything else replicated; tokens over ``dp`` and ``ep``.

Writes to ``--out`` (default ``runs/<preset>``): ``log.json`` (config, every
step's losses, eval losses, tokens/s, MFU), ``loss.png`` and orbax checkpoints
under ``ckpt/``. A run continued with ``--resume`` is bitwise identical to an
uninterrupted one (batches depend only on the seed and the step); it must be the
same run (``ckpt/run.json``: model, data and schedule), or it is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
import sysconfig
import time
import zlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import mok_jax
from mok_jax import nn as mnn
from mok_jax.primitives import vary_alike

from cli_args import positive_int  # examples/, on sys.path when run as a script

VOCAB = 256  # bytes

# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """Model and training hyper-parameters (one preset = one Config)."""

    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_experts: int = 8
    top_k: int = 2
    expert_ffn: int = 256
    shared_ffn: int = 0
    score_fn: str = "softmax"
    capacity_factor: float | None = None
    dtype: str = "float32"           # computation dtype; parameters are float32
    attention: str = "auto"          # "auto": cuDNN flash attention on GPU (bf16), else XLA
    moe_backend: str = "auto"        # mok_jax.moe's backend ("fused": NVLink transport under EP)
    recipe: str = "native"           # the expert GEMMs' recipe ("fp8": needs dtype bfloat16)
    norm: str = "auto"               # "auto": mok_jax.add_rms_norm on GPU, else nnx.RMSNorm
    grad_reduce_lag: int = -1        # >= 0: see reduce_barrier (data-parallel overlap); -1 off
    weight_copies: bool = True       # keep the expert stacks in `dtype` between steps (TrainState)
    seq: int = 128
    batch: int = 16
    steps: int = 400
    lr: float = 3e-3
    warmup: int = 40
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    balance: str = "aux"             # "aux" (loss), "bias" (DeepSeek-V3) or "none"
    aux_coef: float = 1e-2
    z_coef: float = 1e-3
    bias_rate: float = 1e-3
    eval_every: int = 100
    eval_batches: int = 8
    log_every: int = 20
    ckpt_every: int = 200
    seed: int = 0


PRESETS: dict[str, Config] = {
    # 1.8M parameters (0.6M active per token), 2k tokens per step: ~1.5 minutes on 2 CPU cores.
    "tiny": Config(),
    # One H200: 1.26B parameters (0.2B active per token), 32k tokens per step.
    "h200": Config(d_model=1024, n_layers=12, n_heads=16, n_experts=32, top_k=4,
                   expert_ffn=1024, shared_ffn=0, dtype="bfloat16", seq=1024, batch=32,
                   steps=2000, lr=1e-3, warmup=200, eval_every=250, eval_batches=16,
                   log_every=25, ckpt_every=500),
    # OLMoE-1B-7B's MoE layer (d 2048, E 64, top-8, F 1024, 16 heads) at 4 of its 16
    # layers: 1.68B parameters (0.27B active), 16k tokens per step; one H200.
    "olmoe": Config(d_model=2048, n_layers=4, n_heads=16, n_experts=64, top_k=8,
                    expert_ffn=1024, shared_ffn=0, dtype="bfloat16", seq=1024, batch=16,
                    steps=1000, lr=6e-4, warmup=100, eval_every=250, eval_batches=8,
                    log_every=25, ckpt_every=500),
}


def param_counts(cfg: Config) -> dict[str, int]:
    """Parameter counts: total, and active per token (what one token multiplies)."""
    d, L = cfg.d_model, cfg.n_layers
    attention = 4 * d * d
    norms = 2 * d
    router = d * cfg.n_experts
    expert = 3 * d * cfg.expert_ffn
    shared = 3 * d * cfg.shared_ffn
    embed = VOCAB * d
    unembed = d * VOCAB
    total = L * (attention + norms + router + cfg.n_experts * expert + shared) + embed + d + unembed
    active = L * (attention + norms + router + cfg.top_k * expert + shared) + embed + d + unembed
    return {"total": total, "active": active}


def flops_per_token(cfg: Config) -> float:
    """Training FLOPs per token (forward + backward), PaLM appendix B convention:
    ``6 * N_matmul + 12 * L * d * S``, where N_matmul counts the weights a token
    multiplies (attention, router, K experts, shared expert, unembedding; not the
    embedding lookup or norms) and the second term is the attention scores and
    values over the full (uncausal) sequence."""
    d, L = cfg.d_model, cfg.n_layers
    per_layer = 4 * d * d + d * cfg.n_experts + cfg.top_k * 3 * d * cfg.expert_ffn \
        + 3 * d * cfg.shared_ffn
    n_matmul = L * per_layer + d * VOCAB
    return 6.0 * n_matmul + 12.0 * L * d * cfg.seq


# --------------------------------------------------------------------------------------
# Corpus: the standard library's Python sources, as bytes
# --------------------------------------------------------------------------------------


class Corpus(NamedTuple):
    train: np.ndarray   # [N] uint8
    eval: np.ndarray    # [M] uint8
    root: str
    train_files: int
    eval_files: int


EVAL_FRACTION_PERCENT = 5


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def load_corpus(root: str | None = None) -> Corpus:
    """Every ``*.py`` under ``root`` (default: the stdlib; site-packages and
    caches skipped), sorted by relative path. A file is held out for evaluation
    when ``crc32(relative path) % 100 < 5``: the split does not move when files
    are added elsewhere. Files are joined with a NUL byte."""
    root = os.path.abspath(root or stdlib_root())
    skip = {"site-packages", "dist-packages", "__pycache__"}
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
                paths.append(rel)
    paths.sort()
    train, held_out = [], []
    for rel in paths:
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        split = held_out if zlib.crc32(rel.encode()) % 100 < EVAL_FRACTION_PERCENT else train
        split.append(data)
    if not train or not held_out:
        raise SystemExit(f"corpus at {root} has too few .py files ({len(paths)}) to split")
    join = lambda parts: np.frombuffer(b"\0".join(parts), np.uint8)  # noqa: E731
    return Corpus(join(train), join(held_out), root, len(train), len(held_out))


def batch_at(data: np.ndarray, step: int, cfg: Config, *, stream: int = 0) -> np.ndarray:
    """The batch of ``step``: ``[batch, seq + 1]`` int32 windows at positions drawn
    from ``(seed, stream, step)`` alone, so that a resumed run sees the same data."""
    rng = np.random.default_rng([cfg.seed, stream, step])
    starts = rng.integers(0, len(data) - cfg.seq - 1, size=cfg.batch)
    return np.stack([data[s:s + cfg.seq + 1] for s in starts]).astype(np.int32)


EVAL_STREAM = 1


# --------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------


def _dense_init(axes, scale=1.0):
    init = nnx.initializers.variance_scaling(scale, "fan_in", "truncated_normal")
    return mnn.logical_partitioning(init, axes)


def rope(x: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotary position embedding over ``x`` ``[B, S, N, D]`` (positions 0..S-1):
    ``[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]`` over the two halves of
    each head, in f32. The halves' swap is a `flip` of an axis of two, not a
    split and a concatenation: the same products and sums, and a backward
    without concatenations, which XLA's GPU compiler then fuses with the
    concatenation of the q, k and v gradients into one faster kernel (146 ->
    111 us a layer, ~0.4 ms a step on the h200 preset; docs/ledger.md,
    2026-12-01)."""
    batch, seq, heads, dim = x.shape
    inv_freq = base ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)        # [D/2]
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # [S, D/2]
    cos, sin = jnp.cos(angles)[None, :, None, None, :], jnp.sin(angles)[None, :, None, None, :]
    halves = x.astype(jnp.float32).reshape(batch, seq, heads, 2, dim // 2)   # [x1, x2]
    rotated = jnp.flip(halves, axis=-2) * jnp.array([-1.0, 1.0], jnp.float32)[:, None]
    return (halves * cos + rotated * sin).reshape(x.shape).astype(x.dtype)


def attention_implementation(name: str, dtype, head_dim: int = 64) -> str:
    """`jax.nn.dot_product_attention`'s implementation for `name`: "auto" picks cuDNN's
    fused flash attention on a GPU in 16-bit with a head size it takes (a multiple
    of 8, at most 128; 1.6x the h200 preset's tokens/s over XLA's, docs/training.md)
    and XLA's everywhere else."""
    if name != "auto":
        return name
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    fits = head_dim % 8 == 0 and head_dim <= 128
    return "cudnn" if half and fits and jax.default_backend() == "gpu" else "xla"


def norm_implementation(name: str) -> str:
    """How the blocks add their branches and normalise: "fused" runs each residual
    add with the RMSNorm after it as `mok_jax.add_rms_norm` (one CUDA kernel each way
    on a GPU), "nnx" as an add and `nnx.RMSNorm`. "auto" picks fused on a GPU and
    nnx elsewhere (on a CPU both are XLA's ops; nnx keeps the CPU runs' bits)."""
    if name != "auto":
        return name
    return "fused" if jax.default_backend() == "gpu" else "nnx"


def add_norm(norm: nnx.RMSNorm, x: jax.Array, branch: jax.Array | None, fused: bool):
    """``(x + branch, norm(x + branch))`` (``branch`` None: nothing to add), with
    `norm`'s parameters and numerics (its scale cast to its dtype, as nnx does)."""
    if branch is None:
        with jax.named_scope("norm"):
            return x, norm(x)
    if not fused:
        with jax.named_scope("residual"):
            x = x + branch
        with jax.named_scope("norm"):
            return x, norm(x)
    with jax.named_scope("norm"):
        scale = norm.scale[...]
        return mok_jax.add_rms_norm(x, branch, scale.astype(norm.dtype or scale.dtype),
                                    epsilon=norm.epsilon)


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention with RoPE: ``[B, S, d] -> [B, S, d]``."""

    def __init__(self, *, d_model: int, n_heads: int, n_layers: int, dtype, implementation: str,
                 rngs: nnx.Rngs):
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not a multiple of n_heads={n_heads}")
        self.n_heads = n_heads
        self.implementation = attention_implementation(implementation, dtype,
                                                       d_model // n_heads)
        self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False, dtype=dtype,
                              kernel_init=_dense_init(("embed", "heads")), rngs=rngs)
        # Residual branches scaled down with depth (GPT-2).
        self.out = nnx.Linear(d_model, d_model, use_bias=False, dtype=dtype,
                              kernel_init=_dense_init(("heads", "embed"), 1.0 / (2 * n_layers)),
                              rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, seq, d_model = x.shape
        heads = self.n_heads
        # The qkv projection's forward as two GEMMs on slices of its one kernel,
        # [q k] and v, so that v is a GEMM's output where the attention kernel
        # wants it (a slice of one [B, S, 3d] output is a copy); its backward as
        # the one layer's (qkv_projection).
        x, kernel = self.qkv.promote_dtype((x, self.qkv.kernel[...]), dtype=self.qkv.dtype)
        # Inside shard_map (mesh_experiments.py), both operands vary over the same
        # axes, as autodiff would make them, so that the custom VJP's gradients
        # have their primals' types; the casts' transposes sum the kernel's
        # gradient over the axes it did not vary over.
        qk, v = qkv_projection(*vary_alike((x, kernel)))
        q, k = jnp.split(qk, 2, axis=-1)
        q, k, v = (a.reshape(batch, seq, heads, d_model // heads) for a in (q, k, v))
        o = jax.nn.dot_product_attention(rope(q), rope(k), v, is_causal=True,
                                         implementation=self.implementation)
        return self.out(o.reshape(batch, seq, d_model))


class Block(nnx.Module):
    """Pre-norm transformer block: attention, then a `mok_jax.nn.MoE` FFN."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs, moe_kwargs: dict | None = None):
        dtype = jnp.dtype(cfg.dtype)
        self.attn_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.attn = CausalSelfAttention(d_model=cfg.d_model, n_heads=cfg.n_heads,
                                        n_layers=cfg.n_layers, dtype=dtype,
                                        implementation=cfg.attention, rngs=rngs)
        self.ffn_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.fused_norm = norm_implementation(cfg.norm) == "fused"
        self.moe = mnn.MoE(hidden_size=cfg.d_model, ffn_size=cfg.expert_ffn,
                           num_experts=cfg.n_experts, top_k=cfg.top_k, score_fn=cfg.score_fn,
                           renormalize=cfg.top_k > 1, balance_bias=cfg.balance == "bias",
                           shared_ffn_size=cfg.shared_ffn, capacity_factor=cfg.capacity_factor,
                           backend=cfg.moe_backend, recipe=cfg.recipe, dtype=dtype, rngs=rngs,
                           **(moe_kwargs or {}))

    def __call__(self, x: jax.Array, pending: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array | None, mnn.MoEAux]:
        """``(x, pending, aux)``: the residual stream and the FFN output not yet added
        to it. With fused norms each branch is added by the norm after it (the next
        block's, or the final norm), so a block takes and returns one; otherwise
        ``pending`` is None."""
        # Named scopes label the profile's step-time breakdown (--profile).
        x, a = add_norm(self.attn_norm, x, pending, self.fused_norm)
        with jax.named_scope("attention"):
            o = self.attn(a)
        x, m = add_norm(self.ffn_norm, x, o, self.fused_norm)
        h, aux = self.moe(m)
        if self.fused_norm:
            return x, h, aux
        with jax.named_scope("residual"):
            return x + h, None, aux


def _project(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """``x [..., d] @ kernel [d, n]`` as `nnx.Linear` computes it with the
    settings the attention's qkv Linear has (no bias, the default precision
    and dot_general)."""
    return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


@jax.custom_vjp
def qkv_projection(x: jax.Array, kernel: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(x @ kernel[:, :2n], x @ kernel[:, 2n:])`` for a ``[d, 3n]`` kernel: the
    [q k] and v parts of a qkv projection, each a GEMM's own output.

    The backward is that of the one ``x @ kernel``: the cotangent of the [q k v]
    output, concatenated once behind an optimization barrier, then one GEMM for
    the input's gradient and one for the kernel's. Left to autodiff, the input's
    gradient is the sum of two GEMMs' outputs, which XLA added inside the
    RMSNorm backward's two passes (reading both each time); and with one
    ``[B, S, 3n]`` projection split in three, XLA's GPU compiler built the
    concatenation of the cotangents twice, once for each GEMM that reads it
    (docs/ledger.md, 2026-12-01)."""
    n = kernel.shape[-1] // 3
    return _project(x, kernel[:, :2 * n]), _project(x, kernel[:, 2 * n:])


def _qkv_projection_fwd(x, kernel):
    return qkv_projection(x, kernel), (x, kernel)


def _qkv_projection_bwd(residuals, cotangents):
    x, kernel = residuals
    d_qkv = jax.lax.optimization_barrier(jnp.concatenate(cotangents, axis=-1))
    batch = tuple(range(x.ndim - 1))
    dx = jax.lax.dot_general(d_qkv, kernel, (((x.ndim - 1,), (1,)), ((), ())))
    d_kernel = jax.lax.dot_general(x, d_qkv, ((batch, batch), ((), ())))
    return dx.astype(x.dtype), d_kernel.astype(kernel.dtype)


qkv_projection.defvjp(_qkv_projection_fwd, _qkv_projection_bwd)


@jax.custom_vjp
def reduce_barrier(x: jax.Array, tree):
    """The identity on ``(x, tree)``; in the backward pass an optimization barrier
    over the two cotangents, so that the gradient of ``tree`` (reduced over the
    data-parallel axis) is complete before the cotangent of ``x`` flows on.

    Left to itself, XLA's scheduler starts each all-reduce of data-parallel
    gradients only as early as covers its estimated latency, and the end of the
    step (norm reductions, the other collectives) offers that much work: on two
    H200s all 24 expert all-reduces ran after the backward pass, all but one
    synchronously, and with PGLE's measured costs all but one still ran
    after it (docs/ledger.md, 2026-11-30). Tying layer i's expert weights to the input of
    layer i - lag makes each all-reduce finish within the backward of the layers
    in between, where XLA overlaps it (with --pgle) with their kernels.

    It computes the same function: an identity forward, and a barrier (an
    identity too) on the backward's values. On a CPU, where XLA removes
    barriers before fusing, the step is bitwise the same; on a GPU XLA may fuse
    the ops around it differently, so the last bits of a step can differ (as
    they do between runs, through cuDNN's attention backward)."""
    return x, tree


def _reduce_barrier_fwd(x, tree):
    return (x, tree), None


def _reduce_barrier_bwd(_, cotangents):
    return jax.lax.optimization_barrier(cotangents)


reduce_barrier.defvjp(_reduce_barrier_fwd, _reduce_barrier_bwd)


class MoELM(nnx.Module):
    """Byte-level decoder: ``tokens [B, S] int32 -> (logits [B, S, 256] f32,
    [MoEAux] * n_layers)``.

    ``moe_kwargs`` go to every `mok_jax.nn.MoE` (e.g. ``axis_name`` and
    ``batch_axis_names`` to run the model inside ``jax.shard_map``)."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs, moe_kwargs: dict | None = None):
        dtype = jnp.dtype(cfg.dtype)
        self.embed = nnx.Embed(VOCAB, cfg.d_model, dtype=dtype, rngs=rngs,
                               embedding_init=mnn.logical_partitioning(
                                   nnx.initializers.normal(1.0), ("vocab", "embed")))
        self.blocks = nnx.List([Block(cfg, rngs=rngs, moe_kwargs=moe_kwargs)
                                for _ in range(cfg.n_layers)])
        self.final_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.unembed = nnx.Linear(cfg.d_model, VOCAB, use_bias=False, dtype=dtype,
                                  kernel_init=_dense_init(("embed", "vocab")), rngs=rngs)
        self.grad_reduce_lag = cfg.grad_reduce_lag

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, list[mnn.MoEAux]]:
        with jax.named_scope("embed_and_loss"):
            # A one-hot matmul rather than a gather: the same rows forward, and its
            # backward is a [256, B*S] x [B*S, d] GEMM where the gather's is a
            # scatter-add of B*S rows into 256 (24.7 ms of a 150 ms h200 step,
            # docs/training.md). Worth it for a byte vocabulary only.
            table = self.embed.embedding[...].astype(self.embed.dtype)
            x = jnp.matmul(jax.nn.one_hot(tokens, VOCAB, dtype=table.dtype), table,
                           precision=jax.lax.Precision.HIGHEST)  # f32 rows stay exact
        auxes = []
        pending = None  # the last block's FFN output, added by the next norm (fused norms)
        tied = {}  # block index -> its expert weights, passed through reduce_barrier
        for j, block in enumerate(self.blocks):
            i = j + self.grad_reduce_lag
            if self.grad_reduce_lag >= 0 and i < len(self.blocks):
                # The weights in the layer's compute dtype, as the layer would cast
                # them: the barrier then holds the gradients as the layer's backward
                # produced and reduced them.
                moe = self.blocks[i].moe
                cast = (lambda w: w) if moe.dtype is None else (lambda w: w.astype(moe.dtype))
                (x, pending), tied[i] = reduce_barrier(
                    (x, pending), (cast(moe.w_gate_up[...]), cast(moe.w_down[...])))
            if j in tied:  # a copy of the block runs them: the model itself is not changed
                # (so the block's forward must not update state of its own: none does)
                block = nnx.clone(block)
                block.moe.w_gate_up.set_value(tied[j][0])
                block.moe.w_down.set_value(tied[j][1])
            x, pending, aux = block(x, pending)
            auxes.append(aux)
        _, x = add_norm(self.final_norm, x, pending, pending is not None)
        with jax.named_scope("embed_and_loss"):
            return self.unembed(x).astype(jnp.float32), auxes


# --------------------------------------------------------------------------------------
# Training state, step, evaluation
# --------------------------------------------------------------------------------------


class TrainState(NamedTuple):
    step: jax.Array        # [] int32
    params: nnx.State      # nnx.Param leaves (float32: the master weights)
    bias: nnx.State        # mok_jax.nn.BalanceBias leaves (empty unless balance="bias")
    opt: Any               # optax state
    copies: nnx.State      # `weight_copies` of params (empty unless weight_copies and bf16)


EXPERT_STACKS = ("w_gate_up", "w_down")


def _is_expert_stack(path, _) -> bool:
    return bool(path) and path[-1] in EXPERT_STACKS


def uses_weight_copies(cfg: Config) -> bool:
    return cfg.weight_copies and jnp.dtype(cfg.dtype) != jnp.float32


def weight_copies(params: nnx.State, dtype) -> nnx.State:
    """The MoE layers' expert stacks (``w_gate_up``, ``w_down``) of ``params`` in
    ``dtype``: what each layer casts them to before `mok_jax.moe`.

    With ``Config.weight_copies`` (and a 16-bit ``dtype``) the train state keeps
    them: the step that updates the f32 masters writes them in the same pass over
    the parameters, and the next step's forward takes them instead of reading the
    f32 stacks to cast them (1.7 ms of 123 in an h200-preset step on an H200,
    docs/ledger.md, 2026-12-01). The model computes the same function with the same gradients:
    the layer's cast is then the identity, and the gradient of an f32 master is
    the f32 value of its copy's gradient, which is what the cast's transpose gave."""
    stacks, _ = nnx.split_state(params, _is_expert_stack, ...)
    return jax.tree.map(lambda a: a.astype(dtype), stacks)


def make_optimizer(cfg: Config):
    import optax

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, warmup_steps=cfg.warmup, decay_steps=max(cfg.steps, cfg.warmup + 1),
        end_value=cfg.lr * cfg.min_lr_ratio)
    # No weight decay on norms (vectors); matrices and expert stacks decay.
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay,
                                 mask=decay_mask))
    return tx, schedule


def make_mesh(dp: int, ep: int, devices=None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    if dp < 1 or ep < 1 or dp * ep > len(devices):
        raise SystemExit(f"--dp {dp} --ep {ep} needs {dp * ep} devices; {len(devices)} visible")
    grid = np.array(devices[:dp * ep], dtype=object).reshape(dp, ep)
    return Mesh(grid, ("dp", "ep"), axis_types=(AxisType.Auto, AxisType.Auto))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Tokens (the batch dimension) over every mesh axis."""
    return NamedSharding(mesh, P(("dp", "ep")))


def abstract_model(cfg: Config, **moe_kwargs) -> MoELM:
    return nnx.eval_shape(lambda: MoELM(cfg, rngs=nnx.Rngs(cfg.seed), moe_kwargs=moe_kwargs))


def init_state(cfg: Config, mesh: Mesh, tx, *,
               shard_optimizer: bool = False) -> tuple[nnx.GraphDef, TrainState, Any]:
    """Builds the model and optimizer state directly in their shardings.

    Returns ``(graphdef, state, state_shardings)``. Values do not depend on the
    mesh (random bits are sharding-invariant). ``shard_optimizer`` splits the
    optimizer state over ``dp`` as well (`shard_over_data`)."""

    def init():
        model = MoELM(cfg, rngs=nnx.Rngs(cfg.seed))
        _, params, bias = nnx.split(model, nnx.Param, mnn.BalanceBias)
        copies = weight_copies(params, cfg.dtype) if uses_weight_copies(cfg) else nnx.State({})
        return TrainState(jnp.zeros((), jnp.int32), params, bias, tx.init(params), copies)

    graphdef = nnx.split(abstract_model(cfg), nnx.Param, mnn.BalanceBias)[0]
    shapes = jax.eval_shape(init)
    shardings = mnn.named_shardings(shapes, mesh)
    if shard_optimizer:
        shardings = shardings._replace(opt=shard_over_data(shardings.opt, shapes.opt, mesh))
    state = jax.jit(init, out_shardings=shardings)()
    return graphdef, state, shardings


def _aux_totals(auxes: list[mnn.MoEAux]):
    aux_loss = sum(a.aux_loss for a in auxes) / len(auxes)
    z_loss = sum(a.z_loss for a in auxes) / len(auxes)
    tokens_per_expert = jnp.stack([a.tokens_per_expert for a in auxes])   # [L, E]
    dropped = sum(a.dropped for a in auxes)
    return aux_loss, z_loss, tokens_per_expert, dropped


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _grad_norm(grads) -> jax.Array:
    """The global norm exactly as optax.clip_by_global_norm computes it, so that XLA
    computes it once for the clipping and the log (a pass over every gradient)."""
    import optax

    tree = getattr(optax, "tree", None)
    return tree.norm(grads) if hasattr(tree, "norm") else optax.global_norm(grads)


def shard_over_data(shardings, shapes, mesh: Mesh, axis: str = "dp"):
    """``shardings`` with every array also split over the data-parallel ``axis``.

    Each array takes ``axis`` on its first dimension that is otherwise unsplit and
    divides by the axis size; arrays with no such dimension (scalars, vectors of
    odd length) keep their sharding. Used for the optimizer state and the
    update (ZeRO stage 1): each data-parallel replica keeps and updates 1/dp of
    the moments and parameters, the gradients are reduce-scattered and the new
    parameters all-gathered, instead of every replica updating all of them."""
    size = mesh.shape.get(axis, 1)

    def one(sharding, shape):
        if size == 1 or not isinstance(sharding, NamedSharding):
            return sharding
        spec = list(sharding.spec) + [None] * (len(shape.shape) - len(sharding.spec))
        used = {a for entry in spec if entry is not None
                for a in ((entry,) if isinstance(entry, str) else entry)}
        if axis in used:
            return sharding
        for dim, (entry, n) in enumerate(zip(spec, shape.shape)):
            if entry is None and n % size == 0:
                spec[dim] = axis
                return NamedSharding(mesh, P(*spec))
        return sharding

    return jax.tree.map(one, shardings, shapes)


def make_train_step(cfg: Config, graphdef, tx, schedule, *, update_shardings=None,
                    param_shardings=None):
    """``(state, batch [B, S+1] int32) -> (state, metrics)``, pure (jit it).

    ``update_shardings`` (a params-shaped tree of shardings, from
    `shard_over_data`) shards the gradients and the optimizer update over the
    data axis; ``param_shardings`` are then the parameters' own shardings, which
    the updated parameters are gathered back to."""
    import optax

    aux_coef = cfg.aux_coef if cfg.balance == "aux" else 0.0

    copies_on = uses_weight_copies(cfg)

    def loss_fn(params, copies, bias, batch):
        # params holds the rest of the parameters when copies holds the expert stacks
        model = nnx.merge(graphdef, params, copies, bias)
        logits, auxes = model(batch[:, :-1])
        with jax.named_scope("embed_and_loss"):
            ce = cross_entropy(logits, batch[:, 1:])
        with jax.named_scope("router"):
            aux_loss, z_loss, tokens_per_expert, dropped = _aux_totals(auxes)
        loss = ce + aux_coef * aux_loss + cfg.z_coef * z_loss
        return loss, (ce, aux_loss, z_loss, tokens_per_expert, dropped)

    def train_step(state: TrainState, batch: jax.Array):
        if copies_on != bool(jax.tree.leaves(state.copies)):
            raise ValueError(
                f"train_step: the state {'lacks' if copies_on else 'holds'} the expert stacks' "
                f"copies but the step was built with weight_copies={cfg.weight_copies} and "
                f"dtype={cfg.dtype}: build the state and the step from the same Config")
        params = state.params
        if copies_on:
            _, params = nnx.split_state(params, _is_expert_stack, ...)
        (loss, (ce, aux_loss, z_loss, tpe, dropped)), (grads, copy_grads) = jax.value_and_grad(
            loss_fn, argnums=(0, 1), has_aux=True)(params, state.copies, state.bias, batch)
        if copies_on:  # the f32 value of each copy's gradient: the cast's transpose
            grads = nnx.merge_state(grads, jax.tree.map(lambda g: g.astype(jnp.float32),
                                                        copy_grads))
        with jax.named_scope("optimizer"):
            params = state.params
            if update_shardings is not None:
                constrain = jax.lax.with_sharding_constraint
                grads, params = constrain(grads, update_shardings), constrain(
                    params, update_shardings)
            updates, opt = tx.update(grads, state.opt, params)
            params = optax.apply_updates(params, updates)
            if update_shardings is not None:
                params = jax.lax.with_sharding_constraint(params, param_shardings)
            copies = weight_copies(params, cfg.dtype) if copies_on else state.copies
        bias = state.bias
        if cfg.balance == "bias":
            model = nnx.merge(graphdef, params, state.bias)
            for (_, layer), counts in zip(mnn.moe_layers(model), tpe):
                layer.update_balance_bias(counts, cfg.bias_rate)
            bias = nnx.state(model, mnn.BalanceBias)
        counts = tpe.astype(jnp.float32)
        metrics = {
            "loss": loss, "ce": ce, "aux": aux_loss, "z": z_loss,
            "grad_norm": _grad_norm(grads), "lr": schedule(state.step),
            # Busiest expert over the mean, worst layer: 1.0 is perfect balance.
            "load_max": jnp.max(jnp.max(counts, axis=1) / jnp.mean(counts, axis=1)),
            "dropped": dropped,
        }
        return TrainState(state.step + 1, params, bias, opt, copies), metrics

    return train_step


def make_eval_step(graphdef):
    def eval_step(params, bias, batch):
        logits, _ = nnx.merge(graphdef, params, bias)(batch[:, :-1])
        return cross_entropy(logits, batch[:, 1:])

    return eval_step


# --------------------------------------------------------------------------------------
# Checkpoints, logs, plot
# --------------------------------------------------------------------------------------


# Config fields a resumed run may change: how it runs and reports, not what it
# computes (the attention implementations and MoE backends compute the same
# function; weight copies and the gradient-reduce lag give the same bits).
RESUMABLE_CHANGES = frozenset({"attention", "moe_backend", "grad_reduce_lag", "weight_copies",
                               "eval_every", "eval_batches", "log_every", "ckpt_every"})


def run_identity(cfg: Config, corpus: Corpus) -> dict:
    """What a run resuming a checkpoint must share with the run that wrote it: every
    Config field that changes the model, the data or the schedule, and the corpus.
    Written next to the checkpoints (``ckpt/run.json``) when a run starts."""
    return {"config": {k: v for k, v in dataclasses.asdict(cfg).items()
                       if k not in RESUMABLE_CHANGES},
            "corpus": {"root": corpus.root, "train_bytes": int(corpus.train.size),
                       "eval_bytes": int(corpus.eval.size)}}


def identity_differences(want: dict, got: dict) -> list[str]:
    """The fields where ``got`` (e.g. a log's config and corpus) differs from the
    identity ``want``, as "section.field: want -> got"."""
    out = []
    for section, fields in want.items():
        other = got.get(section) or {}
        for key, value in fields.items():
            if other.get(key, value) != value:
                out.append(f"{section}.{key}: {value!r} -> {other.get(key)!r}")
    return out


def checkpoint_manager(directory: str):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def save_checkpoint(manager, state: TrainState) -> None:
    """Saves everything but ``copies``, which `restore_checkpoint` derives."""
    import orbax.checkpoint as ocp

    saved = {k: v for k, v in state._asdict().items() if k != "copies"}
    manager.save(int(state.step), args=ocp.args.StandardSave(saved))


def restore_checkpoint(manager, step: int, like: TrainState, shardings: TrainState) -> TrainState:
    import orbax.checkpoint as ocp

    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          like._asdict(), shardings._asdict())
    del target["copies"]
    restored = manager.restore(step, args=ocp.args.StandardRestore(target))
    dtypes = {a.dtype for a in jax.tree.leaves(like.copies)}
    copies = like.copies
    if dtypes:  # derived from the restored masters, as the train step derives them
        copies = jax.jit(lambda p: weight_copies(p, dtypes.pop()),
                         out_shardings=shardings.copies)(restored["params"])
    return TrainState(**restored, copies=copies)


def write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def plot_losses(log: dict, path: str) -> None:
    """Train loss (per step and smoothed) and eval loss against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in log["train"]]
    ce = [r["ce"] for r in log["train"]]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    if steps:
        ax.plot(steps, ce, color="tab:blue", alpha=0.25, lw=0.8, label="train (per step)")
        smooth, ema = [], ce[0]
        for v in ce:
            ema = 0.95 * ema + 0.05 * v
            smooth.append(ema)
        ax.plot(steps, smooth, color="tab:blue", lw=1.6, label="train (EMA 0.95)")
    if log["eval"]:
        ax.plot([r["step"] for r in log["eval"]], [r["loss"] for r in log["eval"]], "o-",
                color="tab:orange", lw=1.6, label="eval (held-out files)")
    ax.axhline(math.log(VOCAB), color="gray", ls=":", lw=1, label="uniform (ln 256)")
    summary = log.get("summary", {})
    title = f"mok_jax MoE LM, preset {log['preset']}: {log['mesh_desc']}"
    if summary.get("tokens_per_s"):
        title += f", {summary['tokens_per_s']:,.0f} tokens/s"
    ax.set(xlabel="step", ylabel="cross-entropy (nats / byte)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------


def config_from_args(args) -> Config:
    cfg = PRESETS[args.preset]
    overrides = {name: getattr(args, name) for name in
                 ("steps", "batch", "seq", "lr", "seed", "balance", "eval_every", "ckpt_every",
                  "log_every", "eval_batches", "attention", "dtype", "moe_backend", "recipe",
                  "norm",
                  "grad_reduce_lag", "weight_copies")
                 if getattr(args, name, None) is not None}
    if overrides.get("steps") is not None:
        overrides.setdefault("warmup", min(cfg.warmup, max(1, overrides["steps"] // 10)))
    return dataclasses.replace(cfg, **overrides)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:8]))
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--steps", type=positive_int,
                        help="total optimizer steps (the schedule's length)")
    parser.add_argument("--batch", type=positive_int, help="sequences per step (global)")
    parser.add_argument("--seq", type=positive_int, help="bytes per sequence")
    parser.add_argument("--lr", type=float, help="peak learning rate")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--balance", choices=["aux", "bias", "none"],
                        help="load balancing: aux loss, DeepSeek-V3 bias, or none")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="computation dtype")
    parser.add_argument("--attention", choices=["auto", "xla", "cudnn"],
                        help="jax.nn.dot_product_attention implementation (default auto: "
                             "cudnn on a GPU in bfloat16, else xla)")
    parser.add_argument("--norm", choices=["auto", "fused", "nnx"],
                        help="residual adds and RMSNorms (default auto: fused, mok_jax.add_rms_norm, "
                             "on a GPU; nnx: an add and nnx.RMSNorm, on a CPU)")
    parser.add_argument("--moe-backend", choices=["auto", "fused", "xla"],
                        help="mok_jax.moe's backend (default auto: under --ep on GPUs of one "
                             "process, the fused NVLink transport; xla: XLA's all_to_all)")
    parser.add_argument("--recipe", choices=["native", "fp8"],
                        help="the expert GEMMs' numeric recipe (default native: in the "
                             "computation dtype; fp8: float8_e4m3fn with block scales, "
                             "needs --dtype bfloat16)")
    parser.add_argument("--grad-reduce-lag", type=int, metavar="N",
                        help="data parallelism: finish layer i's expert-gradient all-reduce "
                             "before the backward of layer i-N-1 starts (an optimization "
                             "barrier; default 1 when dp > 1 and ep = 1 without "
                             "--shard-optimizer, else -1: off, XLA places the all-reduces)")
    parser.add_argument("--no-weight-copies", dest="weight_copies", action="store_false",
                        default=None,
                        help="do not keep the expert stacks in the computation dtype between "
                             "steps (saves 2 bytes per expert parameter, 2.4 GB for the h200 "
                             "preset; each forward then casts the f32 masters)")
    parser.add_argument("--pgle", action="store_true",
                        help="profile-guided latency estimation: JAX profiles the first steps "
                             "and XLA recompiles the step with the measured costs (with "
                             "--grad-reduce-lag, how dp overlaps its gradient all-reduces)")
    parser.add_argument("--eval-every", type=positive_int)
    parser.add_argument("--eval-batches", type=positive_int)
    parser.add_argument("--log-every", type=positive_int)
    parser.add_argument("--ckpt-every", type=positive_int)
    parser.add_argument("--out", help="output directory (default runs/<preset>)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in OUT/ckpt")
    parser.add_argument("--overwrite", action="store_true",
                        help="delete OUT/ckpt's checkpoints and start from step 0")
    parser.add_argument("--no-checkpoint", action="store_true",
                        help="save no checkpoint (throughput runs; the h200 preset's state "
                             "is ~15 GB)")
    parser.add_argument("--stop-after", type=positive_int, metavar="N",
                        help="stop (with a checkpoint) after N steps of this invocation, as if "
                             "interrupted; the schedule still runs to --steps")
    parser.add_argument("--dp", type=positive_int,
                        help="data-parallel mesh axis (default: devices / ep)")
    parser.add_argument("--ep", type=positive_int, default=1, help="expert-parallel mesh axis")
    parser.add_argument("--shard-optimizer", action="store_true",
                        help="split the optimizer state and update over dp (ZeRO stage 1): "
                        "1/dp of the moments per GPU; slower on the h200 preset (the "
                        "parameters' all-gather is not overlapped, docs/training.md)")
    parser.add_argument("--host-devices", type=positive_int, metavar="N",
                        help="run on N CPU devices (sets jax_num_cpu_devices; CPU only)")
    parser.add_argument("--peak-tflops", type=float,
                        help="per-device peak for MFU (default 989 on GPU, H200 bf16 dense)")
    parser.add_argument("--data-dir", help="train on the *.py files under this directory "
                                           "instead of the standard library")
    parser.add_argument("--trace-only", action="store_true",
                        help="build the model and trace one train step (jax.eval_shape), "
                             "print sizes and FLOPs, exit; nothing runs")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    parser.add_argument("--profile", metavar="DIR",
                        help="trace --profile-steps steps (after 3 warm ones) with jax.profiler "
                             "into DIR and write the step-time breakdown by part of the model "
                             "to DIR/breakdown.json (GPU kernels; see examples/step_profile.py); "
                             "turns XLA's CUDA graphs off for the run")
    parser.add_argument("--profile-steps", type=positive_int, default=5, metavar="N")
    args = parser.parse_args(argv)
    if args.trace_only and (args.dp is not None or args.ep != 1 or args.host_devices):
        parser.error("--trace-only traces the one-device step (jax.eval_shape, no mesh): "
                     "--dp, --ep and --host-devices are not used there")
    if args.recipe == "fp8" and (args.dtype or PRESETS[args.preset].dtype) != "bfloat16":
        parser.error("--recipe fp8 runs the expert GEMMs from bfloat16 operands: add "
                     "--dtype bfloat16")
    if args.resume and args.overwrite:
        parser.error("--resume continues the run in --out and --overwrite starts it over: "
                     "give one")
    if args.no_checkpoint and (args.resume or args.stop_after):
        parser.error("--no-checkpoint cannot be combined with --resume or --stop-after")
    if args.profile and (args.pgle or jax.config.jax_enable_pgle):
        parser.error("--profile cannot be combined with PGLE (--pgle, JAX_ENABLE_PGLE): the "
                     "breakdown names kernels through a compile of the step without PGLE's "
                     "profile, which is not the program that ran")
    return args


def use_host_devices(n: int) -> None:
    """N CPU devices; must run before JAX initializes its backends."""
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def describe(cfg: Config) -> str:
    counts = param_counts(cfg)
    return (f"d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, "
            f"E={cfg.n_experts} top-{cfg.top_k} F={cfg.expert_ffn}"
            + (f" shared {cfg.shared_ffn}" if cfg.shared_ffn else "")
            + f", {counts['total'] / 1e6:.2f}M params ({counts['active'] / 1e6:.2f}M active), "
            f"{cfg.dtype}, batch {cfg.batch} x seq {cfg.seq}")


def trace_only(cfg: Config) -> dict:
    """Shapes of one train step, traced with jax.eval_shape (nothing is computed)."""
    tx, schedule = make_optimizer(cfg)
    model = abstract_model(cfg)
    graphdef, params, bias = nnx.split(model, nnx.Param, mnn.BalanceBias)
    copies = (jax.eval_shape(lambda p: weight_copies(p, cfg.dtype), params)
              if uses_weight_copies(cfg) else nnx.State({}))
    state = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, bias,
                       jax.eval_shape(tx.init, params), copies)
    batch = jax.ShapeDtypeStruct((cfg.batch, cfg.seq + 1), jnp.int32)
    new_state, metrics = jax.eval_shape(make_train_step(cfg, graphdef, tx, schedule), state, batch)
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(new_state.params))
    return {"params": n_params, "metrics": {k: (v.shape, str(v.dtype)) for k, v in metrics.items()},
            "flops_per_token": flops_per_token(cfg)}


def default_grad_reduce_lag(dp: int, ep: int, shard_optimizer: bool) -> int | None:
    """The reduce barrier's lag when --grad-reduce-lag is not given: 1 where it was
    measured to help (dp > 1, ep = 1, a replicated optimizer; docs/ledger.md,
    2026-11-30), else None (the preset's value, off)."""
    return 1 if dp > 1 and ep == 1 and not shard_optimizer else None


def train(args) -> dict:
    """Runs training as configured by ``args`` (from `parse_args`); returns the log."""
    if args.host_devices:
        use_host_devices(args.host_devices)
    if args.pgle:
        jax.config.update("jax_enable_pgle", True)
    if args.profile and "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
        # Kernels replayed from a CUDA graph carry the graph's HLO op, not their own:
        # the profiled run launches them one by one so that each is attributed (the
        # throughput it reports is then a little lower than without --profile).
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_gpu_enable_command_buffer=").strip()
    cfg = config_from_args(args)
    if args.trace_only:
        info = trace_only(cfg)
        print(f"preset {args.preset}: {describe(cfg)}")
        print(f"traced one step: {info['params']:,} parameters, "
              f"{info['flops_per_token'] / 1e9:.3f} GFLOP per token; metrics {info['metrics']}")
        return {"trace": info}

    out = args.out or os.path.join("runs", args.preset)
    os.makedirs(out, exist_ok=True)

    devices = jax.devices()
    ep = args.ep
    dp = args.dp if args.dp is not None else max(1, len(devices) // ep)
    mesh = make_mesh(dp, ep, devices)
    if cfg.batch % (dp * ep):
        raise SystemExit(f"--batch {cfg.batch} must be a multiple of dp*ep = {dp * ep}")
    if cfg.n_experts % ep:
        raise SystemExit(f"--ep {ep} must divide the preset's {cfg.n_experts} experts")
    lag = default_grad_reduce_lag(dp, ep, args.shard_optimizer)
    if args.grad_reduce_lag is None and lag is not None:
        cfg = dataclasses.replace(cfg, grad_reduce_lag=lag)
    platform = devices[0].platform
    peak = args.peak_tflops or (989.0 if platform == "gpu" else None)

    corpus = load_corpus(args.data_dir)
    # Everything traced from here on sees the mesh (so that mok_jax.moe partitions
    # itself over it) and the logical axis rules (so that Flax's eager sharding of
    # new variables agrees with the shardings computed by named_shardings).
    with jax.set_mesh(mesh), nnx.logical_axis_rules(mnn.logical_axis_rules(mesh.axis_names)):
        return _train_on_mesh(args, cfg, mesh, corpus, out, peak)


def profile_step(args, cfg: Config, train_step, state, batch, wall_s: float) -> dict:
    """The breakdown of the traced steps (examples/step_profile.py), printed and
    written to <profile dir>/breakdown.json."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import step_profile  # pylint: disable=import-outside-toplevel

    hlo = train_step.lower(state, batch).compile().as_text()
    result = step_profile.breakdown(args.profile, hlo, steps=args.profile_steps, wall_s=wall_s,
                                    n_layers=cfg.n_layers)
    write_json(os.path.join(args.profile, "breakdown.json"), result)
    print(step_profile.table(result), flush=True)
    print(step_profile.top_table(result), flush=True)
    print(step_profile.gap_table(result), flush=True)
    return result


def check_finite(log: dict, step: int) -> None:
    """Stops the run when the loss of the newest logged step is not finite: nothing
    after it (in particular no checkpoint) is worth keeping."""
    last = log["train"][-1] if log["train"] else None
    if last is not None and not math.isfinite(last["loss"]):
        raise SystemExit(f"step {step}: the train loss is {last['loss']} (step "
                         f"{last['step']}); stopping without saving a checkpoint")


def untimed_steps() -> int:
    """Steps at the start of a run that throughput leaves out: the first (it
    compiles) and, with PGLE on (`--pgle` or JAX_ENABLE_PGLE), the rest of JAX's
    profiled runs (the first is the compiling step) and the step that recompiles
    with their measurements."""
    runs = jax.config.jax_pgle_profiling_runs
    return 1 + (runs if jax.config.jax_enable_pgle and runs > 0 else 0)


def _train_on_mesh(args, cfg: Config, mesh: Mesh, corpus: Corpus, out: str, peak) -> dict:
    ckpt_dir = os.path.join(out, "ckpt")
    log_path = os.path.join(out, "log.json")
    dp, ep = mesh.shape["dp"], mesh.shape["ep"]
    platform = mesh.devices.flat[0].platform
    device_kind = mesh.devices.flat[0].device_kind
    tx, schedule = make_optimizer(cfg)
    graphdef, state, shardings = init_state(cfg, mesh, tx, shard_optimizer=args.shard_optimizer)
    # --no-checkpoint: no manager, so existing checkpoints are neither read nor removed.
    manager = None if args.no_checkpoint else checkpoint_manager(ckpt_dir)
    latest = None if manager is None else manager.latest_step()
    identity = run_identity(cfg, corpus)
    identity_path = os.path.join(ckpt_dir, "run.json")
    log = None
    if args.resume and latest is not None:
        if os.path.exists(log_path):
            with open(log_path) as f:
                log = json.load(f)
        # Checked before anything is restored: another model would fail deep inside
        # orbax, another schedule, batch or corpus would not fail at all.
        if os.path.exists(identity_path):
            with open(identity_path) as f:
                saved = json.load(f)
            diffs = identity_differences(saved, identity)
            if diffs:
                raise SystemExit(
                    f"--resume: this command line differs from the run that wrote "
                    f"{ckpt_dir} in {'; '.join(diffs)}. A resumed run continues that run "
                    "(same model, data and schedule): repeat its flags, or start a new run "
                    "in another --out")
            foreign = [] if log is None else identity_differences(saved, log)
            if foreign:
                raise SystemExit(
                    f"--resume: {log_path} is not the log of the run that wrote {ckpt_dir} "
                    f"({'; '.join(foreign)}); move it away to start a new log from the "
                    "checkpoint")
        else:
            print(f"warning: {identity_path} is missing (a checkpoint of an older version): "
                  "cannot check that this command line continues the same run")
        state = restore_checkpoint(manager, latest, state, shardings)
        if log is not None:
            for key in ("train", "eval", "throughput"):
                log[key] = [r for r in log[key] if r["step"] <= latest]
        print(f"resumed from {ckpt_dir} at step {latest}")
    elif latest is not None:
        if not args.overwrite:
            raise SystemExit(f"{ckpt_dir} holds checkpoints (latest step {latest}): pass --resume "
                             "to continue or --overwrite to start over")
        manager.close()
        shutil.rmtree(ckpt_dir)
        manager = checkpoint_manager(ckpt_dir)
    elif args.resume:
        print(f"no checkpoint in {ckpt_dir}: starting from step 0")
    if manager is not None and not (args.resume and latest is not None):
        write_json(identity_path, identity)

    mesh_desc = f"dp={dp} ep={ep} on {dp * ep} {platform} device(s)"
    if log is None:
        log = {"preset": args.preset, "train": [], "eval": [], "throughput": []}
    log.update({
        "config": dataclasses.asdict(cfg), "mesh": {"dp": dp, "ep": ep}, "mesh_desc": mesh_desc,
        "platform": platform, "device_kind": device_kind, "jax": jax.__version__,
        "corpus": {"root": corpus.root, "train_files": corpus.train_files,
                   "eval_files": corpus.eval_files, "train_bytes": int(corpus.train.size),
                   "eval_bytes": int(corpus.eval.size)},
        "param_counts": param_counts(cfg), "flops_per_token": flops_per_token(cfg),
    })
    print(f"preset {args.preset}: {describe(cfg)}")
    print(f"mesh {mesh_desc}; corpus {corpus.root}: {corpus.train_files} train files "
          f"({corpus.train.size / 1e6:.1f} MB), {corpus.eval_files} held out "
          f"({corpus.eval.size / 1e6:.1f} MB)")

    tokens_sharding = batch_sharding(mesh)
    metric_sharding = NamedSharding(mesh, P())
    update_shardings = None
    if args.shard_optimizer and dp > 1:
        update_shardings = shard_over_data(shardings.params, state.params, mesh)
    train_step = jax.jit(make_train_step(cfg, graphdef, tx, schedule,
                                         update_shardings=update_shardings,
                                         param_shardings=shardings.params),
                         in_shardings=(shardings, tokens_sharding),
                         out_shardings=(shardings, metric_sharding), donate_argnums=(0,))
    eval_step = jax.jit(make_eval_step(graphdef),
                        in_shardings=(shardings.params, shardings.bias, tokens_sharding),
                        out_shardings=metric_sharding)
    eval_set = [batch_at(corpus.eval, i, cfg, stream=EVAL_STREAM)
                for i in range(cfg.eval_batches)]

    def evaluate(state: TrainState) -> float:
        losses = [eval_step(state.params, state.bias, jax.device_put(b, tokens_sharding))
                  for b in eval_set]
        return float(np.mean([float(v) for v in losses]))

    start = int(state.step)
    stop = cfg.steps if args.stop_after is None else min(cfg.steps, start + args.stop_after)
    # The first eval: a fresh run's at step 0, or a resumed run's whose log is lost
    # (a resume at a step the schedule does not evaluate adds nothing a straight run
    # lacks).
    if not log["eval"]:
        log["eval"].append({"step": start, "loss": evaluate(state)})
        print(f"step {start}: eval loss {log['eval'][-1]['loss']:.4f}")

    progress = None
    if not args.no_progress:
        from tqdm.auto import tqdm

        progress = tqdm(total=cfg.steps, initial=start, unit="step", dynamic_ncols=True,
                        desc=args.preset)
    tokens_per_step = cfg.batch * cfg.seq
    pending: list[tuple[int, dict]] = []
    t_run = time.perf_counter()
    # Throughput is timed between completed steps: t_mark is when step mark_step was
    # known to be done (None: no mark yet), and an interval's rate is its steps over
    # the time between two such moments.
    t_mark, mark_step, compile_s = None, start, None

    def flush(upto=None):
        """Moves the metrics of steps <= upto (all when None) to the log; waits for them."""
        ready = [(s, m) for s, m in pending if upto is None or s <= upto]
        for step_done, metrics in jax.device_get(ready):
            log["train"].append({"step": step_done, **{k: float(v) for k, v in metrics.items()}})
        pending[:] = pending[len(ready):]

    def mark(step_done, when=None):
        nonlocal t_mark, mark_step
        t_mark, mark_step = time.perf_counter() if when is None else when, step_done

    untimed = untimed_steps()
    profile_from = start + untimed + 2 if args.profile else None
    profile_to = None if profile_from is None else profile_from + args.profile_steps
    if profile_to is not None and profile_to > stop:
        raise SystemExit(f"--profile needs {profile_to - start} steps to run, this run has "
                         f"{stop - start}")

    def log_interval(upto):
        """The log line of step `upto`: waits for it (only for it: a later step may
        already be queued, so the GPU does not idle while the host logs)."""
        flush(upto)
        now = time.perf_counter()
        profiled = profile_from is not None and mark_step < profile_to and upto > profile_from
        timed = t_mark is not None and upto > mark_step and not profiled
        if timed:
            dt = (now - t_mark) / (upto - mark_step)
            row = {"step": upto, "steps": upto - mark_step, "step_time_s": dt,
                   "tokens_per_s": tokens_per_step / dt}
            if peak:
                row["mfu"] = row["tokens_per_s"] * flops_per_token(cfg) / (peak * 1e12 * dp * ep)
            log["throughput"].append(row)
        check_finite(log, upto)
        last = log["train"][-1]
        tps = log["throughput"][-1]["tokens_per_s"] if log["throughput"] else float("nan")
        if progress is not None:
            progress.set_postfix(loss=f"{last['ce']:.3f}", tok_s=f"{tps:,.0f}", refresh=False)
        else:  # no bar: one line per log interval
            rate = f", {tps:,.0f} tokens/s" if timed else ""
            mfu = (f", MFU {100 * log['throughput'][-1]['mfu']:.1f}%"
                   if timed and "mfu" in log["throughput"][-1] else "")
            print(f"step {upto}: train loss {last['ce']:.4f}{rate}{mfu}", flush=True)
        if args.no_checkpoint:  # no checkpoint saves to carry the log: write it now
            write_json(log_path, log)
        # The next interval starts when this step was done (the host's logging above
        # ran while the next step was already on the GPU).
        mark(upto, now)

    deferred = None  # a log step whose line waits until the next step is dispatched
    for step in range(start, stop):
        batch = jax.device_put(batch_at(corpus.train, step, cfg), tokens_sharding)
        if step == profile_from:
            if deferred is not None:  # its interval must not time the tracer's start
                log_interval(deferred)
                deferred = None
            jax.block_until_ready(state)
            jax.profiler.start_trace(args.profile)
            t_profile = time.perf_counter()
        state, metrics = train_step(state, batch)
        done = step + 1
        pending.append((done, metrics))
        if deferred is not None:  # step `done` is queued: now wait for `deferred`
            log_interval(deferred)
            deferred = None
        if done == profile_to:
            jax.block_until_ready((state, metrics))
            profile_wall = time.perf_counter() - t_profile
            jax.profiler.stop_trace()
            log["profile"] = profile_step(args, cfg, train_step, state, batch, profile_wall)
            mark(done)  # profiling is not training
        if done - start <= untimed:  # compiling steps: time them apart
            jax.block_until_ready(metrics)
            if compile_s is None:
                compile_s = time.perf_counter() - t_run
            mark(done)
        evaluating = done % cfg.eval_every == 0 or done == cfg.steps
        saving = not args.no_checkpoint and (done % cfg.ckpt_every == 0 or done == stop)
        if done % cfg.log_every == 0 or done == stop:
            if done == stop or evaluating or saving:
                log_interval(done)  # waits anyway
            else:
                deferred = done
        if progress is not None:
            progress.update(1)
        if evaluating:
            flush()
            log["eval"].append({"step": done, "loss": evaluate(state)})
            msg = f"step {done}: eval loss {log['eval'][-1]['loss']:.4f}"
            (progress.write if progress is not None else print)(msg)
            mark(done)  # evaluating is not training
        if saving:
            flush()
            check_finite(log, done)  # a diverged state must not replace a good checkpoint
            save_checkpoint(manager, state)
            write_json(log_path, log)
            mark(done)  # nor is saving
    flush()
    if progress is not None:
        progress.close()
    if manager is not None:
        manager.wait_until_finished()
        manager.close()

    wall = time.perf_counter() - t_run
    rates = [r["tokens_per_s"] for r in log["throughput"]]
    summary = {"steps": int(state.step), "wall_s_this_run": wall, "compile_s": compile_s,
               "initial_eval_loss": log["eval"][0]["loss"],
               "final_eval_loss": log["eval"][-1]["loss"],
               "tokens_per_s": statistics.median(rates) if rates else None}
    if peak and rates:
        summary["model_tflops_per_s"] = summary["tokens_per_s"] * flops_per_token(cfg) / 1e12
        summary["mfu"] = summary["model_tflops_per_s"] / (peak * dp * ep)
        summary["peak_tflops_per_device"] = peak
    log["summary"] = summary
    write_json(log_path, log)
    plot_losses(log, os.path.join(out, "loss.png"))

    line = (f"done: step {summary['steps']}, eval loss {summary['initial_eval_loss']:.4f} -> "
            f"{summary['final_eval_loss']:.4f} ({summary['final_eval_loss'] / math.log(2):.3f} "
            f"bits/byte) in {wall:.1f} s")
    if summary["tokens_per_s"]:
        line += f", {summary['tokens_per_s']:,.0f} tokens/s"
    if "mfu" in summary:
        line += (f", {summary['model_tflops_per_s']:.1f} model TFLOP/s, "
                 f"MFU {100 * summary['mfu']:.1f}% of {peak:g} TFLOP/s x {dp * ep}")
    print(line)
    print(f"wrote {log_path}, {os.path.join(out, 'loss.png')}"
          + ("" if args.no_checkpoint else f", checkpoints in {ckpt_dir}"))
    return log


def main(argv=None) -> dict:
    return train(parse_args(argv))


if __name__ == "__main__":
    main()
