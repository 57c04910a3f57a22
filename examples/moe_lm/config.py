"""The model's and the run's hyper-parameters: `Config`, the presets, parameter
and FLOP counts."""

from __future__ import annotations

import dataclasses

VOCAB = 256  # bytes


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


def describe(cfg: Config) -> str:
    """One line for the log: the model's sizes, parameter counts, dtype and batch."""
    counts = param_counts(cfg)
    return (f"d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, "
            f"E={cfg.n_experts} top-{cfg.top_k} F={cfg.expert_ffn}"
            + (f" shared {cfg.shared_ffn}" if cfg.shared_ffn else "")
            + f", {counts['total'] / 1e6:.2f}M params ({counts['active'] / 1e6:.2f}M active), "
            f"{cfg.dtype}, batch {cfg.batch} x seq {cfg.seq}")
