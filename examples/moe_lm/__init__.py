"""The byte-level MoE language model that `train_moe_lm.py` trains, as a package the
other examples and the tests import: its configuration, data, model, training step,
checkpoints and report, one module each."""

from moe_lm.config import PRESETS, VOCAB, Config, describe, flops_per_token, param_counts
from moe_lm.data import EVAL_STREAM, Corpus, batch_at, check_seq, load_corpus, stdlib_root
from moe_lm.model import (Block, CausalSelfAttention, MoELM, abstract_model, add_norm,
                          attention_implementation, init_rngs, norm_implementation,
                          qkv_projection, reduce_barrier, rope)
from moe_lm.training import (EXPERT_STACKS, TrainState, aux_totals, batch_sharding,
                             cross_entropy, init_state, make_eval_step, make_mesh,
                             make_optimizer, make_train_step, shard_over_data, trace_only,
                             uses_weight_copies, weight_copies)
from moe_lm.checkpoints import (RESUMABLE_CHANGES, checkpoint_manager, identity_differences,
                                restore_checkpoint, run_identity, save_checkpoint,
                                start_or_resume)
from moe_lm.report import plot_losses, write_json

__all__ = [
    "PRESETS", "VOCAB", "Config", "describe", "flops_per_token", "param_counts",
    "EVAL_STREAM", "Corpus", "batch_at", "check_seq", "load_corpus", "stdlib_root", "Block",
    "CausalSelfAttention", "MoELM", "abstract_model", "add_norm",
    "attention_implementation", "init_rngs", "norm_implementation", "qkv_projection",
    "reduce_barrier", "rope", "EXPERT_STACKS", "TrainState", "aux_totals",
    "batch_sharding", "cross_entropy", "init_state", "make_eval_step", "make_mesh",
    "make_optimizer", "make_train_step", "shard_over_data", "trace_only",
    "uses_weight_copies", "weight_copies", "RESUMABLE_CHANGES", "checkpoint_manager",
    "identity_differences", "restore_checkpoint", "run_identity", "save_checkpoint",
    "start_or_resume", "plot_losses", "write_json",
]
