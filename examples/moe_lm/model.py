"""The byte-level decoder: attention with RoPE, pre-norm blocks with a
`mok_jax.nn.MoE` feed-forward, and the two custom VJPs the training step leans on
(`qkv_projection`, `reduce_barrier`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import mok_jax
from mok_jax import nn as mnn
from mok_jax._src.primitives import vary_alike
from mok_jax._src.seeds import seed_key

from moe_lm.config import VOCAB, Config


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


def abstract_model(cfg: Config, **moe_kwargs) -> MoELM:
    """The model with `jax.ShapeDtypeStruct` leaves (`nnx.eval_shape`): its structure
    and shapes, nothing allocated. ``moe_kwargs`` go to every MoE layer."""
    return nnx.eval_shape(lambda: MoELM(cfg, rngs=init_rngs(cfg), moe_kwargs=moe_kwargs))


def init_rngs(cfg: Config) -> nnx.Rngs:
    """The parameters' random stream: ``cfg.seed``'s 64-bit threefry key, so that
    every seed in [0, 2^63) starts from its own parameters (``nnx.Rngs(seed)`` keeps
    a seed's low 32 bits only); ValueError for a seed outside that range."""
    return nnx.Rngs(seed_key(cfg.seed))
