"""`python -m mok_jax.bench`: `mok_jax.moe` side by side with pure-JAX baselines.

Method: each pipeline runs the whole MoE layer (dispatch and combine included,
routing excluded: expert ids and weights are made outside the timed function) on
the bench shapes below (or a custom `--shape T,K,E,H,F`), in bf16 by default. Each
pass is jitted and compiled, run `--warmup` times untimed (default 3), then timed
`--repeats` times (default 20), each run blocked on; a record reports the median
(and min and mean) of those runs. `--queue N` also times `--repeats` batches of N
calls dispatched back to back and blocked once (`queued ms`, per call): the
device-bound time, the regime of a training loop, which a blocked call exceeds by
its round trip to the host (~0.1 ms for a jitted call on a GPU). TFLOP/s count
GEMM FLOPs only: forward 6*T*K*H*F, forward+backward 18*T*K*H*F, credited alike
to every pipeline (so the dense one-hot baseline's E/K times larger GEMMs count
as waste). Every baseline is measured in the same process as `moe` (the PyTorch
ones, `--torch`, in a subprocess run just before). `mok speedup` is baseline median / `moe` median of
the same shape and pass (> 1: `moe` is faster).

EP (`--ep N`): `moe` on a mesh of N devices, experts and tokens sharded, T tokens
per device (weak scaling), once per exchange backend: `moe_epN_xla` (XLA's
all_to_all) and `moe_epN_fused` (mok_jax's NVLink transport; GPU only, recorded as
skipped on CPU and as unavailable on a GPU build without it). Their reference is
`moe_compute_epN`, measured in the same run: `moe` on ONE device with shape
(T, K, E/N, H, F), exactly one EP rank's expert work (the same T*K rows and GEMM
FLOPs per device, E/N experts, no communication; where K > E/N, T*K/(E/N) tokens
of E/N picks keep the rows). EP rows are reported as the time
ratio EP=N / compute-only (`ep_time_ratio`; lower is better, 1.00x is perfect
weak scaling), never as a speedup; the ratio to the single-device `moe` record with
all E experts is kept beside it (`ep_time_ratio_all_experts`). `--exchange` adds the
dispatch exchange alone: XLA's all_to_all variants on balanced synthetic rows, and
the fused transport's dispatch (`nvlink_pull`, with and without its route
computation) on the bench inputs' real routing, each with the bytes it moves per
device and GB/s.

GPU-only baselines (tokamax's Pallas kernels, the torch `_grouped_mm` ones,
ragged_all_to_all in `--exchange`) are not attempted on CPU: they are recorded as
skipped with the reason, and a note says so.

`--help` lists every shape with its dimensions and every pipeline, pass and
exchange with what it is. Combinations of flags that would time nothing, or not
what they name, are refused before anything runs.

Examples::

    python -m mok_jax.bench                                # default shapes, all impls, passes
    python -m mok_jax.bench --quick --repeats 5            # scaled-down shapes (CPU)
    python -m mok_jax.bench --shapes ep --impls moe,tokamax --passes fwd --json out.json
    python -m mok_jax.bench --shape 4096,8,64,2048,1024    # one custom problem only
    python -m mok_jax.bench --check                        # + errors vs the reference
    python -m mok_jax.bench --impls moe,ragged_dot --recipe native,fp8  # both recipes
    python -m mok_jax.bench --shapes ep --impls moe --ep 2  # + EP=2 (xla, fused) and
                                                           #   its compute-only reference

--check also compares every pipeline's y and gradients with the dense reference
(relative Frobenius error per output), so that a fast but wrong pipeline shows.

`--recipe native,fp8` runs `moe` (and its EP records) with each recipe named (fp8:
bf16 only); the fp8 rows' speedup column is the native moe's median over theirs;
the baselines and the --check reference keep computing in --dtype, so `moe`'s
errors there include the recipe's own (a few percent). Records carry `recipe`
(None for the JAX baselines, "fp8" for torch's FP8 grouped GEMM, which is compared
with `moe [fp8]`) and the table marks `moe [fp8]`.

On CPU the full shapes take very long; without --full-on-cpu a CPU run uses the
--quick shapes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time
import traceback
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mok_jax import baselines
from mok_jax.recipe import Recipe


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

IMPLS = ("moe", "ragged_dot", "dense_onehot", "tokamax")
# Selectable, not run by default: mok_jax.moe forced onto its XLA-exchange path,
# and on one GPU with its forward always the kernel chain, or always the persistent
# kernel where that can run (moe picks between them by shape).
EXTRA_IMPLS = ("moe_xla", "moe_chain", "moe_persistent", "moe_vranks2", "moe_vranks4",
               "moe_vranks8")
# The EP role of the persistent kernels on P virtual ranks of one GPU.
VIRTUAL_RANKS = {"moe_vranks2": 2, "moe_vranks4": 4, "moe_vranks8": 8}
PASSES = ("fwd", "fwdbwd")

IMPL_ABOUT = {
    "moe": "mok_jax.moe, the layer under test (its C++/CUDA kernels through XLA FFI)",
    "ragged_dot": "pure JAX: sort the pairs by expert, jax.lax.ragged_dot for both "
                  "GEMMs, unsort, weighted sum",
    "dense_onehot": "pure JAX: every expert on every token (E/K times the GEMM work), "
                    "then pick and weight the K chosen",
    "tokamax": "the ragged_dot pipeline with tokamax.ragged_dot (Pallas Mosaic GPU "
               "kernels); needs a CUDA GPU",
    "moe_xla": "mok_jax.moe(backend='xla'): moe on its XLA-exchange path "
               "(not in the default list)",
    "moe_chain": "mok_jax.moe with both passes always the kernel chains (gathers, "
                 "grouped GEMMs, combines as separate kernels; not in the default list)",
    "moe_persistent": "mok_jax.moe with both passes always the persistent kernels where "
                      "they can run (one launch per pass after the routing plan; moe "
                      "picks the forward's for few rows per expert only and the chain's "
                      "backward; same bits; not in the default list)",
    **{name: f"mok_jax.ep.moe_on_virtual_ranks(ranks={p}): the persistent kernels as "
             f"{p} EP ranks in one launch per pass on one GPU, each with its own windows "
             "(T and E divisible by the ranks; the same bits as moe; compare with "
             "moe_persistent; not in the default list)"
       for name, p in VIRTUAL_RANKS.items()},
}
PASS_ABOUT = {
    "fwd": "y = layer(x, ids, weights, w_gate_up, w_down); GEMM FLOPs 6*T*K*H*F",
    "fwdbwd": "y and its VJP w.r.t. x, weights, w_gate_up, w_down; GEMM FLOPs "
              "18*T*K*H*F",
}
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
MOK = "moe"

# Measurements that need a CUDA GPU: on a CPU backend they are recorded as skipped
# with this reason (and a note is printed) instead of being attempted.
GPU_ONLY = {
    "moe_chain": "needs a CUDA GPU: the persistent kernels it switches off are CUDA "
                 "kernels (on CPU moe_chain would time moe again)",
    "moe_persistent": "needs a CUDA GPU: the persistent kernels are CUDA kernels (on CPU "
                      "moe_persistent would time moe again)",
    **{name: "needs a CUDA GPU: the persistent forward is a CUDA kernel"
       for name in VIRTUAL_RANKS},
    "tokamax": "needs a CUDA GPU: tokamax's Pallas Mosaic kernels run on GPUs only "
               "(on CPU tokamax.ragged_dot falls back to XLA's ragged_dot, which the "
               "ragged_dot row already times)",
    "torch_pipeline": "needs a CUDA GPU: torch._grouped_mm runs on CUDA only (and the "
                      "JAX pipelines here run on the CPU, so a GPU time would not compare)",
    "torch_grouped_mm": "needs a CUDA GPU: torch._grouped_mm runs on CUDA only (and the "
                        "JAX pipelines here run on the CPU, so a GPU time would not "
                        "compare)",
    "torch_scaled_grouped_mm": "needs a CUDA GPU: torch._scaled_grouped_mm runs on "
                               "CUDA only (and the JAX pipelines here run on the CPU, so "
                               "a GPU time would not compare)",
    "ragged_all_to_all": "needs a GPU: XLA has no CPU lowering of ragged_all_to_all",
    "moe_epN_fused": "needs a CUDA GPU: backend='fused' moves the EP rows with mok_jax's "
                     "NVLink kernels, which run on GPUs only (on CPU mok_jax.moe raises "
                     "ValueError)",
    "nvlink_pull": "needs a CUDA GPU: the fused EP transport's dispatch (ep_dispatch_p) "
                   "pulls rows over NVLink and has no CPU lowering",
    "nvlink_pull_prerouted": "needs a CUDA GPU: the fused EP transport's dispatch "
                             "(ep_dispatch_p) pulls rows over NVLink and has no CPU "
                             "lowering",
}

# The EP exchange backends timed by --ep (mok_jax.moe's `backend` under EP), and the
# GPU_ONLY name of the fused one.
EP_BACKENDS = ("xla", "fused")
FUSED_EP = "moe_epN_fused"


def platform_skip(name: str, backend: str) -> str | None:
    """Why the pipeline, torch baseline, exchange or EP backend (FUSED_EP) `name` is
    not attempted on `backend` (a GPU-only one on CPU), or None."""
    if backend == "cpu" and name in GPU_ONLY:
        return GPU_ONLY[name]
    return None


MoEFn = Callable[..., jax.Array]


RECIPES = ("native", "fp8")
MOK_IMPLS = ("moe", "moe_xla", "moe_chain", "moe_persistent")
PERSISTENT_MODES = {"moe_chain": "OFF", "moe_persistent": "ALWAYS"}


def _recipes(text: str) -> tuple[str, ...]:
    """--recipe's value: recipe names, comma-separated, each known, none twice."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in RECIPES]
    if not names or unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"--recipe takes distinct names of {', '.join(RECIPES)}, comma-separated; "
            f"got {text!r}")
    return names


def resolve_impl(name: str) -> tuple[MoEFn | None, str | None]:
    """The pipeline called `name`, or (None, why it is unavailable)."""
    if name in MOK_IMPLS:
        try:
            import mok_jax  # pylint: disable=import-outside-toplevel
            moe = mok_jax.moe
        except Exception as err:  # pylint: disable=broad-except
            return None, f"mok_jax.moe not importable: {type(err).__name__}: {err}"
        return (functools.partial(moe, backend="xla") if name == "moe_xla" else moe), None
    if name in VIRTUAL_RANKS:
        from mok_jax import ep  # pylint: disable=import-outside-toplevel
        return functools.partial(ep.moe_on_virtual_ranks, ranks=VIRTUAL_RANKS[name]), None
    if name == "ragged_dot":
        return baselines.ragged_dot_moe, None
    if name == "dense_onehot":
        return baselines.dense_onehot_moe, None
    if name == "tokamax":
        ok, why = baselines.tokamax_available()
        if not ok:
            return None, why
        # On GPU the Pallas Mosaic kernel only: tokamax's silent XLA fallback would
        # time ragged_dot again under tokamax's name. (tokamax 0.0.17 has no
        # "triton" ragged_dot; naming it raises.)
        impl = None if jax.default_backend() == "cpu" else "mosaic"
        return functools.partial(baselines.tokamax_moe, implementation=impl), None
    raise ValueError(f"unknown impl {name!r}; choose from {IMPLS + EXTRA_IMPLS}")


def with_recipe(fn: MoEFn, impl: str, recipe: str) -> MoEFn:
    """mok_jax's pipelines with `recipe` (their `recipe=`); the baselines as they are."""
    if impl in MOK_IMPLS and recipe != "native":
        return functools.partial(fn, recipe=recipe)
    return fn


def _input_keys(seed: int) -> jax.Array:
    return jax.random.split(jax.random.key(seed), 6)


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


def build_step(fn: MoEFn, pass_name: str) -> tuple[Callable, tuple[str, ...]]:
    """A jitted step for one pass and the names of the inputs it takes.

    fwd: y = fn(x, ids, weights, w_gate_up, w_down).
    fwdbwd: y and the VJP of y with the fixed cotangent dy w.r.t. x, weights,
    w_gate_up and w_down (ids and dy are arguments, not baked-in constants).
    """
    if pass_name == "fwd":
        names = ("x", "expert_ids", "expert_weights", "w_gate_up", "w_down")
        return jax.jit(fn), names

    def fwd_bwd(x, expert_ids, expert_weights, w_gate_up, w_down, dy):
        def layer(x, expert_weights, w_gate_up, w_down):
            return fn(x, expert_ids, expert_weights, w_gate_up, w_down)

        y, pullback = jax.vjp(layer, x, expert_weights, w_gate_up, w_down)
        return y, pullback(dy)

    names = ("x", "expert_ids", "expert_weights", "w_gate_up", "w_down", "dy")
    return jax.jit(fwd_bwd), names


def time_step(step: Callable, args: Sequence[jax.Array], *, warmup: int,
              repeats: int) -> tuple[float, list[float], Callable]:
    """(compile seconds, per-run milliseconds, the compiled step).

    The milliseconds are of `repeats` runs, each blocked on, after `warmup` runs.
    """
    start = time.perf_counter()
    compiled = step.lower(*args).compile()
    compile_s = time.perf_counter() - start
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    times_ms = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = compiled(*args)
        jax.block_until_ready(out)
        times_ms.append((time.perf_counter() - start) * 1e3)
        del out
    return compile_s, times_ms, compiled


def time_queued(compiled: Callable, args: Sequence[jax.Array], *, queue: int,
                repeats: int) -> list[float]:
    """Per-call milliseconds of `repeats` batches: each batch dispatches `queue`
    calls back to back and blocks once on the last, and its time is divided by
    `queue`. The host's dispatch of one call overlaps the device's run of the one
    before, as in a training loop, so this is the device-bound time per call; the
    blocked runs of time_step also pay each call's round trip to the host."""
    times_ms = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = [compiled(*args) for _ in range(queue)]
        jax.block_until_ready(outs[-1])
        times_ms.append((time.perf_counter() - start) * 1e3 / queue)
        del outs
    return times_ms


OUTPUT_NAMES = {"fwd": ("y",),
                "fwdbwd": ("y", "dx", "dexpert_weights", "dw_gate_up", "dw_down")}


def reference_outputs(pass_name: str, inputs: dict
                      ) -> tuple[str, list[jax.Array] | None, str | None]:
    """(oracle name, its flat outputs for `pass_name`, error) for --check.

    The oracle is mok_jax.reference.moe_reference when importable, else the dense
    one-hot baseline (both run every expert on every token).
    """
    try:
        from mok_jax import reference  # pylint: disable=import-outside-toplevel
        name, fn = "mok_jax.reference.moe_reference", reference.moe_reference
    except Exception:  # pylint: disable=broad-except
        name, fn = "baselines.dense_onehot_moe", baselines.dense_onehot_moe
    try:
        step, names = build_step(fn, pass_name)
        out = jax.block_until_ready(step(*[inputs[n] for n in names]))
    except Exception as err:  # pylint: disable=broad-except
        return name, None, error_string(err)
    return name, jax.tree_util.tree_leaves(out), None


@jax.jit
def rel_fro(got: jax.Array, want: jax.Array) -> jax.Array:
    got = got.astype(jnp.float32)
    want = want.astype(jnp.float32)
    return jnp.linalg.norm((got - want).ravel()) / jnp.linalg.norm(want.ravel())


def relative_errors(pass_name: str, got: list[jax.Array],
                    want: list[jax.Array]) -> dict[str, float]:
    """Relative Frobenius error of each output (y, then the gradients) vs the oracle."""
    return {name: float(rel_fro(g, w))
            for name, g, w in zip(OUTPUT_NAMES[pass_name], got, want)}


def error_string(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}"
    return text if len(text) <= 2000 else text[:2000] + " ...[truncated]"


def new_record(shape: Shape, impl: str, pass_name: str, *, dtype_name: str, warmup: int,
               repeats: int) -> dict:
    """A measurement record with no result yet (status "ok" until told otherwise)."""
    return {
        "shape": shape.name, "T": shape.tokens, "K": shape.top_k, "E": shape.experts,
        "H": shape.hidden, "F": shape.ffn, "dtype": dtype_name, "impl": impl,
        "pass": pass_name, "gemm_flops": shape.gemm_flops(pass_name),
        "warmup": warmup, "repeats": repeats, "status": "ok", "error": None,
        "compile_s": None, "median_ms": None, "min_ms": None, "mean_ms": None,
        "tflops": None, "times_ms": None, "rel_err": None, "check_error": None,
        "recipe": None, "queue": 0, "queued_ms": None, "queued_times_ms": None,
    }


def finish_record(record: dict, times_ms: list[float], compile_s: float | None,
                  queued_times_ms: list[float] | None = None) -> dict:
    """Fills the timing fields: median, min, mean and TFLOP/s at the median; with
    `queued_times_ms` (time_queued's) also their median, `queued_ms`."""
    median_ms = statistics.median(times_ms)
    record.update(
        compile_s=compile_s, median_ms=median_ms, min_ms=min(times_ms),
        mean_ms=statistics.fmean(times_ms), times_ms=times_ms,
        tflops=record["gemm_flops"] / (median_ms * 1e-3) / 1e12)
    if queued_times_ms:
        record.update(queued_times_ms=queued_times_ms,
                      queued_ms=statistics.median(queued_times_ms))
    return record


def bench_one(shape: Shape, impl: str, pass_name: str, inputs: dict, *,
              dtype_name: str, warmup: int, repeats: int,
              reference: list[jax.Array] | None = None,
              verbose: bool = False, recipe: str = "native", queue: int = 0) -> dict:
    """One record: timings of `impl` on `shape` for `pass_name`, or its error.

    With `queue` > 0 also `repeats` queued batches of `queue` calls (time_queued):
    `queued_ms`. With `reference` (the oracle's flat outputs), one more untimed run
    is compared with it and the record gets `rel_err` per output (or `check_error`).
    `verbose` prints the traceback of a failure to stderr. `recipe`: mok_jax.moe's
    (recorded on its records; the baselines have none).
    """
    record = new_record(shape, impl, pass_name, dtype_name=dtype_name, warmup=warmup,
                        repeats=repeats)
    if impl in MOK_IMPLS:
        record["recipe"] = recipe
    why = platform_skip(impl, jax.default_backend())
    if why:
        record.update(status="skipped", error=why)
        return record
    fn, why = resolve_impl(impl)
    if fn is None:
        record.update(status="unavailable", error=why)
        return record
    fn = with_recipe(fn, impl, recipe)
    if impl == "tokamax":
        record["note"] = baselines.tokamax_available()[1] or None
    with persistent_kernels(PERSISTENT_MODES.get(impl, "AUTO")):
        try:
            step, names = build_step(fn, pass_name)
            args = [inputs[n] for n in names]
            compile_s, times_ms, compiled = time_step(step, args, warmup=warmup,
                                                      repeats=repeats)
            queued_ms = (time_queued(compiled, args, queue=queue, repeats=repeats)
                         if queue else None)
        except Exception as err:  # pylint: disable=broad-except
            # An OOM or an unsupported shape in one pipeline must not end the run.
            record.update(status="error", error=error_string(err))
            if verbose:
                traceback.print_exc()
            return record
        if reference is not None:
            try:
                got = jax.tree_util.tree_leaves(compiled(*args))
                record["rel_err"] = relative_errors(pass_name, got, reference)
                del got
            except Exception as err:  # pylint: disable=broad-except
                record["check_error"] = error_string(err)
                if verbose:
                    traceback.print_exc()
    record["queue"] = queue
    return finish_record(record, times_ms, compile_s, queued_ms)


@contextlib.contextmanager
def persistent_kernels(mode: str):
    """The persistent kernels of mok_jax's CUDA handlers in `mode` ("OFF", "AUTO",
    their default, or "ALWAYS") while the block runs; nothing where the build has
    none."""
    try:
        from mok_jax import _mok  # pylint: disable=import-outside-toplevel
    except ImportError:
        _mok = None
    setter = getattr(_mok, "set_persistent_kernels", None)
    if setter is None:
        yield
        return
    previous = setter(getattr(_mok.PersistentMode, mode))
    try:
        yield
    finally:
        setter(previous)


def ep_mesh(ep_size: int):
    """(a 1-D mesh "ep" over the first ep_size devices, None) or (None, why not)."""
    if len(jax.devices()) < ep_size:
        return None, f"needs {ep_size} devices, found {len(jax.devices())}"
    return jax.make_mesh((ep_size,), ("ep",), devices=jax.devices()[:ep_size]), None


def compute_only_shape(shape: Shape, ep_size: int) -> Shape:
    """One EP rank's expert work as a single-device problem: T tokens, top-K of
    E/ep_size experts, H, F (the same T*K rows, hence the same GEMM FLOPs, over the
    rank's E/P experts). Where K > E/P (K distinct picks do not fit), K' = E/P picks
    of T*K/K' tokens keep the rows; ValueError if T*K does not split so."""
    if shape.experts % ep_size:
        raise ValueError(f"E={shape.experts} experts do not split over {ep_size} devices")
    e_local = shape.experts // ep_size
    if shape.top_k <= e_local:
        return dataclasses.replace(shape, experts=e_local)
    rows = shape.tokens * shape.top_k
    if rows % e_local:
        raise ValueError(f"K={shape.top_k} > E/P={e_local} experts per device, and the "
                         f"T*K={rows} rows do not split into tokens of {e_local} picks")
    return dataclasses.replace(shape, tokens=rows // e_local, top_k=e_local,
                               experts=e_local)


def compute_only_impl(ep_size: int) -> str:
    return f"moe_compute_ep{ep_size}"


def ep_impl(ep_size: int, backend: str) -> str:
    return f"moe_ep{ep_size}_{backend}"


def bench_compute_only(shape: Shape, ep_size: int, pass_name: str, *, dtype,
                       dtype_name: str, seed: int, warmup: int, repeats: int,
                       verbose: bool = False, recipe: str = "native") -> dict:
    """`moe` on one device with compute_only_shape(shape, ep_size): the compute-only
    time of one EP rank (its rows and its E/P experts, no communication), the
    reference of the EP records' `ep_time_ratio`. Record impl `moe_compute_epN`; its
    T, K, E fields are the single-device problem's (E = E/N), `experts_global` and
    `compute_only_for_ep` say which EP problem it stands for."""
    impl = compute_only_impl(ep_size)
    try:
        local = compute_only_shape(shape, ep_size)
    except ValueError as err:
        record = new_record(dataclasses.replace(shape, experts=shape.experts // ep_size),
                            impl, pass_name, dtype_name=dtype_name, warmup=warmup,
                            repeats=repeats)
        record.update(status="unavailable", error=str(err))
    else:
        try:
            inputs = make_inputs(local, dtype, seed)
        except Exception as err:  # pylint: disable=broad-except
            record = new_record(local, impl, pass_name, dtype_name=dtype_name,
                                warmup=warmup, repeats=repeats)
            record.update(status="error", error=error_string(err))
        else:
            record = bench_one(local, MOK, pass_name, inputs, dtype_name=dtype_name,
                               warmup=warmup, repeats=repeats, verbose=verbose,
                               recipe=recipe)
            del inputs
        record["impl"] = impl
    record.update(compute_only_for_ep=ep_size, experts_global=shape.experts,
                  backend="auto", recipe=recipe)
    if record["T"] != shape.tokens:
        record["note"] = (f"K={shape.top_k} > E/P={shape.experts // ep_size}: "
                          f"{record['T']} tokens x {record['K']} picks keep the "
                          f"{shape.tokens * shape.top_k} rows of one rank")
    return record


def fused_unavailable() -> str | None:
    """Why this build cannot run the fused EP transport (mok_jax._mok_comm missing,
    comm.Missing's message), or None. Call on GPU only (it loads libnccl)."""
    try:
        from mok_jax import comm  # pylint: disable=import-outside-toplevel
        comm.module()
    except Exception as err:  # pylint: disable=broad-except  (comm.Missing, import errors)
        return error_string(err)
    return None


def fused_skip(backend: str) -> tuple[str, str] | None:
    """(status, why) when the fused EP transport is not attempted here: "skipped" on
    a backend it cannot run on (platform_skip), "unavailable" on a GPU build without
    it; None when it can run."""
    why = platform_skip(FUSED_EP, backend)
    if why:
        return "skipped", why
    why = fused_unavailable()
    return ("unavailable", why) if why else None


def bench_ep(shape: Shape, ep_size: int, pass_name: str, *, dtype, dtype_name: str,
             seed: int, warmup: int, repeats: int, backend: str = "xla",
             verbose: bool = False, recipe: str = "native") -> dict:
    """`mok_jax.moe(..., backend=backend)` under jit on a mesh of `ep_size` devices
    (experts sharded; "xla": XLA's all_to_all, "fused": the NVLink transport), with
    `shape.tokens` tokens per device: the per-device work of the compute-only record
    (bench_compute_only), so the two times compare. Record impl `moe_epN_<backend>`."""
    from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel
    impl = ep_impl(ep_size, backend)
    record = new_record(shape, impl, pass_name, dtype_name=dtype_name, warmup=warmup,
                        repeats=repeats)
    record.update(ep_size=ep_size, backend=backend,
                  experts_per_device=shape.experts // ep_size, recipe=recipe)
    if backend == "fused":
        skip = fused_skip(jax.default_backend())
        if skip:
            record.update(status=skip[0], error=skip[1])
            return record
    mesh, why = ep_mesh(ep_size)
    if mesh is None:
        record.update(status="unavailable", error=why)
        return record
    try:
        fn, why = resolve_impl(MOK)
        if fn is None:
            record.update(status="unavailable", error=why)
            return record
        fn = with_recipe(fn, MOK, recipe)
        fn = functools.partial(fn, backend=backend)
        global_shape = dataclasses.replace(shape, tokens=shape.tokens * ep_size)
        inputs = make_inputs(global_shape, dtype, seed)
        # Tokens, routing, dy and the experts dim of both weights: all split on dim 0.
        sharded = NamedSharding(mesh, PartitionSpec("ep"))
        inputs = {k: jax.device_put(v, sharded) for k, v in inputs.items()}
        step, names = build_step(fn, pass_name)
        # Under the mesh, as the fused transport's plain-jit tests run it: its
        # lowering finds the EP group's devices there (primitives.lowering_mesh).
        with jax.set_mesh(mesh):
            compile_s, times_ms, _ = time_step(step, [inputs[n] for n in names],
                                               warmup=warmup, repeats=repeats)
    except Exception as err:  # pylint: disable=broad-except
        record.update(status="error", error=error_string(err))
        if verbose:
            traceback.print_exc()
        return record
    return finish_record(record, times_ms, compile_s)


XLA_EXCHANGES = ("all_to_all_slots", "all_to_all_exact", "ragged_all_to_all")
NVLINK_EXCHANGES = ("nvlink_pull", "nvlink_pull_prerouted")
EXCHANGES = XLA_EXCHANGES + NVLINK_EXCHANGES
EXCHANGE_ABOUT = {
    "all_to_all_slots": "all_to_all with ep.py's layout: a fixed slot of T*K rows per "
                        "peer (any routing fits; P times the rows travel: P x T*K "
                        "rows x H x itemsize per device in slots, (P-1)/P of them leave "
                        "it)",
    "all_to_all_exact": "all_to_all with slots of exactly T*K/P rows (what a balanced "
                        "routing needs)",
    "ragged_all_to_all": "the T*K/P rows per peer named by offsets and sizes (only the "
                         "real rows travel); needs a GPU",
    "nvlink_pull": "the fused transport's dispatch on the bench inputs' routing: plan, "
                   "NvlinkTransport.route and dispatch_tokens (ep_dispatch_p), all timed; "
                   "one row per (token, other destination rank) travels; needs a GPU",
    "nvlink_pull_prerouted": "nvlink_pull with the plan and route made before, outside "
                             "the timed function: the ep_dispatch_p primitive alone; "
                             "needs a GPU",
}


def exchange_fn(kind: str, ep_size: int, rows: int, hidden: int) -> Callable:
    """One EP dispatch exchange over axis "ep", as the local function of a shard_map.

    Each device holds the rows it sends, `rows` = T*K of them, split evenly over
    the peers (rows // ep_size each, the balanced case):
    - all_to_all_slots: ep.py's layout, a fixed slot of `rows` rows per peer
      ([P * rows, H] in and out: any routing fits, P times the rows travel);
    - all_to_all_exact: slots of exactly rows // P (what a balanced routing needs);
    - ragged_all_to_all: the rows // P rows per peer named by offsets and sizes
      (any routing fits, only the real rows travel).
    (The nvlink exchanges are nvlink_fns'.)
    """
    per_peer = rows // ep_size

    if kind == "all_to_all_slots" or kind == "all_to_all_exact":
        slots = rows if kind == "all_to_all_slots" else per_peer

        def a2a(buf):
            blocks = buf.reshape(ep_size, slots, hidden)
            return jax.lax.all_to_all(blocks, "ep", 0, 0).reshape(ep_size * slots, hidden)
        return a2a
    if kind == "ragged_all_to_all":
        def ragged(buf, out):
            me = jax.lax.axis_index("ep").astype(jnp.int32)
            peers = jnp.arange(ep_size, dtype=jnp.int32)
            sizes = jnp.full((ep_size,), per_peer, jnp.int32)
            return jax.lax.ragged_all_to_all(
                buf, out, peers * per_peer, sizes,
                jnp.full((ep_size,), me * per_peer, jnp.int32), sizes, axis_name="ep")
        return ragged
    raise ValueError(f"unknown exchange {kind!r}; choose from {XLA_EXCHANGES}")


def nvlink_fns(ep_size: int, experts: int) -> dict[str, Callable]:
    """The fused transport's dispatch over axis "ep", as local functions of a
    shard_map (each rank: x [T, H], expert_ids [T, K] global ids, no capacity):

    - "route": expert_ids -> NvlinkRoute (ep.plan, then NvlinkTransport.route);
    - "nvlink_pull": (x, expert_ids) -> expert-grouped rows [P*T*K, H]: route and
      dispatch_tokens (ep_dispatch_p), what moe's EP forward does before its experts;
    - "nvlink_pull_prerouted": (x, entries, pull_dest, push_dest) -> the same rows
      from a route made before: the ep_dispatch_p primitive alone.
    """
    from mok_jax import ep, primitives, transport  # pylint: disable=import-outside-toplevel
    e_local = experts // ep_size
    cfg = ep.Config("ep", ep_size, primitives.NO_CAPACITY, ("ep",), Recipe.NATIVE)
    tr = transport.NvlinkTransport()

    def route(expert_ids):
        tokens, top_k = expert_ids.shape
        return tr.route(ep.plan(expert_ids, cfg, e_local), cfg, top_k, e_local,
                        ep_size * tokens * top_k)

    def pull(x, expert_ids):
        return tr.dispatch_tokens(x, route(expert_ids), cfg)[0]

    def pull_prerouted(x, entries, pull_dest, push_dest):
        return tr.dispatch_tokens(x, transport.NvlinkRoute(entries, pull_dest, push_dest),
                                  cfg)[0]

    return {"route": route, "nvlink_pull": pull, "nvlink_pull_prerouted": pull_prerouted}


def nvlink_pull_rows(expert_ids, ep_size: int, experts: int) -> np.ndarray:
    """Token rows each rank pulls from other ranks in one fused dispatch, [P] by
    receiving rank: the distinct (token, destination rank) pairs of the global
    routing `expert_ids` [P*T, K] (rank r holds tokens [r*T, (r+1)*T), expert e is
    on rank e // (E/P)) whose destination is not the token's own rank (that copy
    stays on the device). Ids outside [0, E) move nothing. numpy, no devices."""
    ids = np.asarray(expert_ids)
    n_tokens = ids.shape[0]
    if n_tokens % ep_size or experts % ep_size:
        raise ValueError(f"{n_tokens} tokens / {experts} experts do not split over "
                         f"{ep_size} ranks")
    e_local = experts // ep_size
    valid = (ids >= 0) & (ids < experts)
    token = np.broadcast_to(np.arange(n_tokens)[:, None], ids.shape)[valid]
    need = np.zeros((n_tokens, ep_size), bool)
    need[token, ids[valid] // e_local] = True           # one row per (token, rank)
    need[np.arange(n_tokens), np.arange(n_tokens) // (n_tokens // ep_size)] = False
    return need.sum(axis=0)


def nvlink_pull_bytes(expert_ids, ep_size: int, experts: int, hidden: int,
                      itemsize: int) -> np.ndarray:
    """Bytes each rank pulls from other ranks in one fused dispatch, [P] by
    receiving rank: nvlink_pull_rows x H x itemsize."""
    return nvlink_pull_rows(expert_ids, ep_size, experts) * hidden * itemsize


def exchange_bytes(kind: str, shape: Shape, ep_size: int, itemsize: int) -> dict:
    """The byte fields of an XLA exchange record (per device, T*K rows sent, balanced):
    `buffer_bytes_per_device` (the buffer exchanged), `bytes_moved_per_device` (what
    leaves the device), `bytes_per_device` (what GB/s counts: the rows that must leave,
    (P-1)/P of the T*K) and `bytes_basis`."""
    rows, row_bytes = shape.tokens * shape.top_k, shape.hidden * itemsize
    useful = rows * (ep_size - 1) // ep_size * row_bytes
    if kind == "all_to_all_slots":
        return {"buffer_bytes_per_device": ep_size * rows * row_bytes,
                "bytes_moved_per_device": (ep_size - 1) * rows * row_bytes,
                "bytes_per_device": useful,
                "bytes_basis": "slots: P x T*K rows x H x itemsize per device, of which "
                               "(P-1)/P leave it (bytes_moved_per_device); GB/s counts "
                               "only the rows that must leave, (P-1)/P of the T*K "
                               "(bytes_per_device)"}
    return {"buffer_bytes_per_device": rows // ep_size * ep_size * row_bytes,
            "bytes_moved_per_device": rows // ep_size * (ep_size - 1) * row_bytes,
            "bytes_per_device": useful,
            "bytes_basis": "T*K/P rows to each peer; GB/s counts the (P-1)/P of the "
                           "T*K rows x H x itemsize that leave the device"}


def bench_exchange(shape: Shape, ep_size: int, kind: str, *, dtype, warmup: int,
                   repeats: int, seed: int = 0) -> dict:
    """Time of one dispatch exchange of `shape` (T tokens, T*K rows per device) over
    `ep_size` devices. Every record has `bytes_per_device` and `gb_per_s` =
    bytes_per_device / median: for the XLA kinds the rows that must leave each device
    under balanced routing ((P-1)/P of T*K, exchange_bytes); for the nvlink kinds the
    mean over devices of the token rows pulled from other ranks on the bench inputs'
    real routing (seed `seed`, as bench_ep's; nvlink_pull_bytes; the max is
    `bytes_per_device_max`)."""
    from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel
    rows, hidden = shape.tokens * shape.top_k, shape.hidden
    itemsize = jnp.dtype(dtype).itemsize
    record = {"shape": shape.name, "exchange": kind, "ep_size": ep_size, "rows": rows,
              "hidden": hidden, "dtype": jnp.dtype(dtype).name, "status": "ok",
              "error": None, "median_ms": None, "min_ms": None, "gb_per_s": None}
    nvlink = kind in NVLINK_EXCHANGES
    global_shape = dataclasses.replace(shape, tokens=shape.tokens * ep_size)
    if nvlink:
        try:
            ids_global = make_routing(global_shape, seed)[0]
            ids_np = np.asarray(jax.device_get(ids_global))
            pulled = nvlink_pull_rows(ids_np, ep_size, shape.experts)
            per_device = [int(b) for b in nvlink_pull_bytes(ids_np, ep_size, shape.experts,
                                                            hidden, itemsize)]
        except Exception as err:  # pylint: disable=broad-except
            record.update(status="error", error=error_string(err))
            return record
        record.update(
            pulled_rows_per_device=[int(n) for n in pulled],
            bytes_per_device=sum(per_device) / ep_size,
            bytes_per_device_max=max(per_device),
            bytes_moved_per_device=sum(per_device) / ep_size,
            bytes_basis="token rows pulled from other ranks: distinct (token, "
                        "destination rank) pairs of the bench routing whose "
                        "destination is not the token's rank, x H x itemsize; "
                        "bytes_per_device (and gb_per_s) is the mean over receiving "
                        "devices, bytes_per_device_max (gb_per_s_max) the largest")
    else:
        record.update(exchange_bytes(kind, shape, ep_size, itemsize))
    why = platform_skip(kind, jax.default_backend())
    if why:
        record.update(status="skipped", error=why)
        return record
    why = fused_unavailable() if nvlink else None
    if why:
        record.update(status="unavailable", error=why)
        return record
    mesh, why = ep_mesh(ep_size)
    if mesh is None:
        record.update(status="unavailable", error=why)
        return record
    try:
        spec = PartitionSpec("ep")
        sharded = NamedSharding(mesh, spec)
        if nvlink:
            fns = nvlink_fns(ep_size, shape.experts)
            x = jax.jit(lambda: make_tokens(global_shape, dtype, seed),
                        out_shardings=sharded)()
            ids = jax.device_put(ids_global, sharded)
            if kind == "nvlink_pull":
                args, specs = [x, ids], (spec, spec)
            else:  # the route made here, outside the timed function
                route = jax.jit(jax.shard_map(fns["route"], mesh=mesh, in_specs=(spec,),
                                              out_specs=spec))(ids)
                args, specs = [x, *jax.block_until_ready(route)], (spec,) * 4
            local_fn = fns[kind]
        else:
            local_rows = rows * ep_size if kind == "all_to_all_slots" else rows

            def filled(n_rows, value):  # made in place, shard by shard (not on one device)
                return jax.jit(lambda: jnp.full((ep_size * n_rows, hidden), value, dtype),
                               out_shardings=sharded)()
            args = [filled(local_rows, 1)]
            specs = (spec,)
            if kind == "ragged_all_to_all":
                args.append(filled(rows, 0))
                specs += (spec,)
            local_fn = exchange_fn(kind, ep_size, rows, hidden)
        step = jax.jit(jax.shard_map(local_fn, mesh=mesh, in_specs=specs, out_specs=spec))
        compile_s, times_ms, _ = time_step(step, args, warmup=warmup, repeats=repeats)
    except Exception as err:  # pylint: disable=broad-except
        record.update(status="error", error=error_string(err))
        return record
    median = statistics.median(times_ms)
    record.update(median_ms=median, min_ms=min(times_ms), compile_s=compile_s,
                  times_ms=times_ms,
                  gb_per_s=record["bytes_per_device"] / (median * 1e-3) / 1e9)
    if nvlink:
        record["gb_per_s_max"] = record["bytes_per_device_max"] / (median * 1e-3) / 1e9
    return record


TORCH_IMPLS = ("torch_pipeline", "torch_grouped_mm", "torch_scaled_grouped_mm")
# The recipe a baseline computes in: moe of that recipe is what it is compared with.
BASELINE_RECIPE = {"torch_scaled_grouped_mm": "fp8"}
TORCH_ABOUT = {
    "torch_pipeline": "the eager PyTorch layer a user writes with torch._grouped_mm "
                      "(gather, grouped GEMMs, SwiGLU, index_add_ combine)",
    "torch_grouped_mm": "torch._grouped_mm's two grouped GEMMs alone on pre-permuted "
                        "rows: the GEMM time the whole layer is compared with",
    "torch_scaled_grouped_mm": "the same two GEMMs in FP8 with torch._scaled_grouped_mm "
                               "(rowwise f32 scales, operands quantized beforehand): the "
                               "FP8 GEMM time moe [fp8] is compared with; forward only",
}


def torch_records(shapes: Sequence[Shape], passes: Sequence[str], *, warmup: int,
                  repeats: int, timeout_s: float = 1800,
                  backend: str | None = None, skip: Sequence[str] = (),
                  queue: int = 0) -> list[dict]:
    """PyTorch baselines (mok_jax/_torch_moe.py) timed in a subprocess; the
    measurements `skip` names (--skip entries) are recorded as skipped, not run.

    Call this before JAX touches the GPU: JAX reserves most of its memory.
    Returns bench records (status "unavailable" when torch or CUDA is missing).
    With `backend` "cpu" (the backend the JAX pipelines run on) nothing is run:
    every record is "skipped" with the reason (GPU_ONLY).
    """
    if backend is not None and any(platform_skip(i, backend) for i in TORCH_IMPLS):
        records = []
        for shape in shapes:
            for pass_name in passes:
                for impl in TORCH_IMPLS:
                    record = new_record(shape, impl, pass_name, dtype_name="bf16",
                                        warmup=warmup, repeats=repeats)
                    record.update(status="skipped", error=platform_skip(impl, backend))
                    records.append(record)
        return records
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_torch_moe.py")
    cmd = [sys.executable, script, "--passes", ",".join(passes), "--warmup", str(warmup),
           "--repeats", str(repeats), "--queue", str(queue)]
    for shape in shapes:
        dims = ",".join(str(v) for v in (shape.tokens, shape.top_k, shape.experts,
                                         shape.hidden, shape.ffn))
        cmd += ["--shape", dims]
        cmd += [arg for impl in TORCH_IMPLS for pass_name in passes
                if skipped(skip, impl, pass_name, shape.name)
                for arg in ("--skip", f"{impl}/{pass_name}/{dims}")]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              check=False)
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except Exception as err:  # pylint: disable=broad-except
        result = {"records": [], "error": error_string(err)}
    by_key = {(tuple(r["shape"]), r["impl"], r["pass"]): r for r in result["records"]}
    records = []
    for shape in shapes:
        key_shape = (shape.tokens, shape.top_k, shape.experts, shape.hidden, shape.ffn)
        for pass_name in passes:
            for impl in TORCH_IMPLS:
                got = by_key.get((key_shape, impl, pass_name), {})
                record = new_record(shape, impl, pass_name, dtype_name="bf16",
                                    warmup=warmup, repeats=repeats)
                record["recipe"] = BASELINE_RECIPE.get(impl)
                record["torch_version"] = result.get("torch_version")
                if skipped(skip, impl, pass_name, shape.name):
                    record.update(status="skipped", error="named in --skip")
                elif got.get("times_ms"):
                    record["queue"] = queue
                    finish_record(record, got["times_ms"], None, got.get("queued_times_ms"))
                else:
                    record.update(status=got.get("status", "unavailable"),
                                  error=got.get("error", result.get("error")))
                records.append(record)
    return records


def is_ep_record(record: dict) -> bool:
    """Whether `record` is `moe` on an EP mesh of >= 2 devices (bench_ep)."""
    return (record.get("ep_size") or 1) > 1


def is_compute_only_record(record: dict) -> bool:
    """Whether `record` is one EP rank's work on one device (bench_compute_only)."""
    return bool(record.get("compute_only_for_ep"))


# What the derived fields mean; written into the JSON (its "legend").
LEGEND = {
    "median_ms": "median of the timed runs (milliseconds), after compilation and "
                 "the warm-up runs",
    "tflops": "GEMM FLOPs only (fwd 6*T*K*H*F, fwdbwd 18*T*K*H*F) / median time; "
              "per device for EP records",
    "mok_speedup": "baseline median / moe median, same shape, pass and process "
                   "(> 1: moe is faster), moe of the baseline's recipe (native unless "
                   "the record's recipe says; torch_scaled_grouped_mm: fp8); "
                   "single-device baselines only, absent from EP records and None on "
                   "compute-only records",
    "queued_ms": "with --queue N: the median over --repeats batches of (time of N calls "
                 "dispatched back to back, blocked once at the end) / N: the "
                 "device-bound time per call, without each blocked call's round trip to "
                 "the host; None without --queue and on EP records",
    "mok_speedup_queued": "as mok_speedup, from queued_ms",
    "recipe_speedup": "on moe records of a recipe other than native: the native moe "
                      "median / this median, same shape, pass and process (the table's "
                      "speedup column shows it for those rows)",
    "compute_only_for_ep": "on moe_compute_epN records: N. moe on one device with T "
                           "tokens, K picks of E/N experts (its E field; experts_global "
                           "is the EP problem's E): exactly one EP rank's expert work, "
                           "no communication",
    "ep_time_ratio": "EP records (moe_epN_xla, moe_epN_fused) only: EP=N median / the "
                     "compute-only median (moe_compute_epN, ep_reference_ms) of the "
                     "same shape and pass (same T*K rows and GEMM FLOPs per device, "
                     "E/N experts, no communication). A time ratio, lower is better; "
                     "1.0 is perfect weak scaling; not a speedup",
    "ep_time_ratio_all_experts": "EP records only: EP=N median / the single-device moe "
                                 "median with all E experts (one_device_ms) of the same "
                                 "shape and pass, when that record was measured",
    "bytes_per_device": "exchange records: the bytes per device that gb_per_s counts "
                        "(bytes_basis says which; bytes_moved_per_device: what leaves a "
                        "device)",
    "gb_per_s": "exchange records: bytes_per_device / median time, 1e9 bytes per GB",
    "status": "ok; error (attempted and failed: see error); unavailable (not "
              "importable or not built, or too few devices); skipped (not attempted: "
              "--skip, auto-skip or needs a GPU; error says why)",
}


def add_speedups(records: list[dict]) -> None:
    """Sets `mok_speedup` = baseline median / moe median on each measured
    single-device baseline (None on compute-only records); on each EP record (no
    `mok_speedup` there) `ep_time_ratio` = EP median / the compute-only median of
    the same shape, pass and EP size (that median: `ep_reference_ms`, its impl:
    `ep_reference`), and `ep_time_ratio_all_experts` = EP median / the one-device
    moe median of the same recipe (`one_device_ms`)."""
    def single_device_moe(field):
        return {(r["shape"], r["pass"], r.get("recipe") or "native"): r.get(field)
                for r in records if r["impl"] == MOK and r.get(field)
                and not is_ep_record(r) and not is_compute_only_record(r)}

    mok_ms, mok_queued = single_device_moe("median_ms"), single_device_moe("queued_ms")
    compute_ms = {(r["shape"], r["pass"], r["compute_only_for_ep"], r.get("recipe")):
                  r["median_ms"]
                  for r in records if is_compute_only_record(r) and r["median_ms"]}
    for r in records:
        # The one-device moe of this record's recipe (the native one unless it says).
        mine = mok_ms.get((r["shape"], r["pass"], r.get("recipe") or "native"))
        if is_ep_record(r):
            ref = compute_ms.get((r["shape"], r["pass"], r["ep_size"], r.get("recipe")))
            ms = r["median_ms"]
            r.pop("mok_speedup", None)
            r["ep_reference"] = compute_only_impl(r["ep_size"])
            r["ep_reference_ms"] = ref
            r["ep_time_ratio"] = ms / ref if ref and ms else None
            r["one_device_ms"] = mine
            r["ep_time_ratio_all_experts"] = ms / mine if mine and ms else None
            continue
        if r["impl"] == MOK and r.get("recipe") not in (None, "native"):
            # Another recipe of moe: the native moe's median over this one's.
            native = mok_ms.get((r["shape"], r["pass"], "native"))
            r["mok_speedup"] = None
            r["recipe_speedup"] = (native / r["median_ms"]
                                   if native and r["median_ms"] else None)
            continue
        # A baseline against moe of its own recipe, from blocked and queued times.
        baseline = r["impl"] != MOK and not is_compute_only_record(r)
        queued = mok_queued.get((r["shape"], r["pass"], r.get("recipe") or "native"))
        r["mok_speedup"] = (r["median_ms"] / mine
                            if baseline and mine and r["median_ms"] else None)
        r["mok_speedup_queued"] = (r["queued_ms"] / queued
                                   if baseline and queued and r.get("queued_ms") else None)


def ep_ratio_text(record: dict) -> str:
    """One EP record's comparison with the compute-only time, e.g. "EP=2 fused /
    compute-only: 1.90x (time ratio, lower is better); / 1 device, all 128
    experts: 1.85x"."""
    ratio = record.get("ep_time_ratio")
    value = "-" if ratio is None else f"{ratio:.2f}x"
    backend = f" {record['backend']}" if record.get("backend") else ""
    text = (f"EP={record['ep_size']}{backend} / compute-only: {value} "
            "(time ratio, lower is better)")
    if ratio is None:
        text += (": no compute-only time to compare with" if record["median_ms"]
                 else f": EP run {record['status']}")
    elif record.get("ep_time_ratio_all_experts") is not None:
        text += (f"; / 1 device, all {record.get('E', 'E')} experts: "
                 f"{record['ep_time_ratio_all_experts']:.2f}x")
    return text


def impl_label(record: dict) -> str:
    """The impl as the table shows it: mok_jax's with its recipe unless native."""
    recipe = record.get("recipe")
    return record["impl"] if recipe in (None, "native") else f"{record['impl']} [{recipe}]"


def format_table(records: list[dict]) -> str:
    """A text table: one row per record; errors shortened to one line.

    Single-device baselines get `mok speedup`; EP rows get `EP/compute`, the time
    ratio to the compute-only record (lower is better), and an EP summary line each
    below; compute-only rows are marked `(ref)` there.
    """
    checked = any(r.get("rel_err") for r in records)
    ep_records = [r for r in records if is_ep_record(r)]
    queued = any(r.get("queued_ms") for r in records)
    header = ("shape", "impl", "pass", "median ms", "min ms", "TFLOP/s", "mok speedup")
    header += ("queued ms", "queued speedup") if queued else ()
    header += ("EP/compute",) if ep_records else ()
    header += ("max rel err",) if checked else ()
    rows = [header]
    notes: dict[str, list[str]] = {}   # one line per distinct failure, with where
    for r in records:
        if r["median_ms"] is None:
            first_line = ((r["error"] or "").splitlines() or [""])[0][:300]
            where = notes.setdefault(f"{r['impl']}: {r['status']}: {first_line}", [])
            where.append(f"{r['shape']}/{r['pass']}")
            rows.append((r["shape"], impl_label(r), r["pass"], r["status"])
                        + ("-",) * (len(header) - 4))
            continue
        speedup = r.get("mok_speedup")
        if speedup is None:
            speedup = r.get("recipe_speedup")
        tflops = r["tflops"]
        row = (r["shape"], impl_label(r), r["pass"], f"{r['median_ms']:.3f}",
               f"{r['min_ms']:.3f}",
               f"{tflops:.1f}" if tflops >= 1 else f"{tflops:.4f}",
               "-" if speedup is None else f"{speedup:.2f}x")
        if queued:
            q_ms, q_speedup = r.get("queued_ms"), r.get("mok_speedup_queued")
            row += ("-" if q_ms is None else f"{q_ms:.3f}",
                    "-" if q_speedup is None else f"{q_speedup:.2f}x")
        if ep_records:
            ratio = r.get("ep_time_ratio")
            row += ("(ref)" if is_compute_only_record(r)
                    else "-" if ratio is None else f"{ratio:.2f}x",)
        if checked:
            errs = r.get("rel_err") or {}
            worst = max(errs, key=errs.get) if errs else None
            row += (f"{errs[worst]:.1e} ({worst})" if worst else "-",)
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    text = "\n".join(lines)
    text += ("\n\nmok speedup: baseline median / moe median, same shape, pass and process "
             "(> 1: moe is faster); single-device rows only.")
    if queued:
        text += ("\nqueued ms: per call, median of batches of --queue calls dispatched back "
                 "to back and blocked once (device-bound; median ms blocks on every call); "
                 "queued speedup: the same ratio from it.")
    if ep_records:
        text += ("\nEP/compute: EP=N median / the median of moe_compute_epN, moe on one "
                 "device with one rank's work (T tokens, K of E/N experts: the same rows "
                 "and GEMM FLOPs per device, no communication). A time ratio: lower is "
                 "better, 1.00x is perfect weak scaling. TFLOP/s of EP rows are per "
                 "device.")
    if checked:
        text += ("\nmax rel err: the largest relative Frobenius error over y and the "
                 "gradients, against the reference (in parentheses: which output).")
    for note, where in notes.items():
        text += f"\n{note}  [{', '.join(where)}]"
    if ep_records:
        text += "\n\nEP against compute-only (one device, one rank's E/N experts):"
        for r in ep_records:
            text += f"\n  {r['shape']} {r['pass']} {r['impl']}: {ep_ratio_text(r)}"
    return text


def format_exchanges(records: list[dict]) -> str:
    """A text table of the --exchange records: time, bytes per device, GB/s."""
    header = ("shape", "exchange", "P", "median ms", "MB/device", "GB/s", "status")
    rows = [header]
    for r in records:
        mb = r.get("bytes_per_device")
        rows.append((r["shape"], r["exchange"], str(r["ep_size"]),
                     "-" if r["median_ms"] is None else f"{r['median_ms']:.3f}",
                     "-" if mb is None else f"{mb / 1e6:.2f}",
                     "-" if r["gb_per_s"] is None else f"{r['gb_per_s']:.1f}",
                     r["status"]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < 2 or i == 6 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    text = "\n".join(lines)
    text += ("\n\nMB/device, GB/s: all_to_all_* and ragged count the (P-1)/P of the T*K "
             "rows that must leave a device under balanced routing (all_to_all_slots "
             "moves P-1 times that: bytes_moved_per_device); nvlink_pull* count the "
             "token rows each device pulls from other ranks (one per distinct token and "
             "destination rank, real routing), the mean over devices.")
    notes: dict[str, list[str]] = {}
    for r in records:
        if r["median_ms"] is None and r["error"]:
            first = (r["error"].splitlines() or [""])[0][:300]
            notes.setdefault(f"{r['exchange']}: {r['status']}: {first}", []).append(
                f"{r['shape']}/P={r['ep_size']}")
    for note, where in notes.items():
        text += f"\n{note}  [{', '.join(where)}]"
    return text


def _git_commit() -> str | None:
    if os.environ.get("MOK_GIT_COMMIT"):  # set by scripts/gpu_ci.sh (no .git there)
        return os.environ["MOK_GIT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
            cwd=os.path.dirname(os.path.abspath(__file__)), check=True)
        return out.stdout.strip() or None
    except Exception:  # pylint: disable=broad-except
        return None


def machine_info() -> dict:
    """Versions, device and time, recorded with every run."""
    devices = jax.devices()
    info = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"),
        "jax_version": jax.__version__,
        "jaxlib_version": getattr(getattr(jax, "lib", None), "__version__", None),
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "git_commit": _git_commit(),
    }
    try:
        import jaxlib  # pylint: disable=import-outside-toplevel
        info["jaxlib_version"] = jaxlib.__version__
    except Exception:  # pylint: disable=broad-except
        pass
    return info


def _dedupe(items: Sequence) -> list:
    """`items` without repeats, in order (a name given twice is timed once)."""
    return list(dict.fromkeys(items))


def _csv(choices: Sequence[str], what: str) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        bad = [item for item in items if item not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {bad or text!r}; choose from {','.join(choices)}")
        return _dedupe(items)
    return parse


def _int_list(text: str) -> list[int]:
    try:
        sizes = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from None
    if not sizes or any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"EP sizes must be >= 1: {text!r}")
    return _dedupe(sizes)


def _csv_free(text: str) -> list[str]:
    return _dedupe(t.strip() for t in text.split(",") if t.strip())


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


# XLA lowers ragged_dot's weight gradient to a dense masked f32 [E, T*K, H] tensor.
# On an H200 (jax 0.11.2) it failed to compile, after minutes, from 120 GB up
# (small-experts, deepseek-slice, ep; docs/performance.md); mixtral-like (4 GB) compiled.
RAGGED_DOT_DENSE_WGRAD_LIMIT = 64 * 2**30


def auto_skip(shape: Shape, impl: str, pass_name: str, backend: str) -> str | None:
    """Why a measurement is not attempted by default, or None."""
    if impl == "ragged_dot" and pass_name == "fwdbwd" and backend == "gpu":
        dense = shape.experts * shape.tokens * shape.top_k * shape.hidden * 4
        if dense >= RAGGED_DOT_DENSE_WGRAD_LIMIT:
            return (f"ragged_dot's backward needs a dense [E, T*K, H] f32 weight gradient "
                    f"({dense / 2**30:.0f} GiB) that XLA failed to compile on an H200; "
                    "--try-all attempts it")
    return None


def skipped(skips: Sequence[str], impl: str, pass_name: str, shape_name: str) -> bool:
    """Whether an entry of --skip ("impl/pass" or "impl/pass/shape") names this one."""
    return any(s in (f"{impl}/{pass_name}", f"{impl}/{pass_name}/{shape_name}")
               for s in skips)


def _dims(shape: Shape) -> str:
    return (f"T={shape.tokens:<6} K={shape.top_k:<2} E={shape.experts:<4} "
            f"H={shape.hidden:<5} F={shape.ffn:<6}")


HELP_WIDTH = 88


def _entry(name: str, text: str, width: int) -> list[str]:
    """`name` and its description, wrapped under itself, as help lines."""
    return textwrap.wrap(text, HELP_WIDTH, initial_indent=f"  {name:<{width}}  ",
                         subsequent_indent=" " * (width + 4))


# What --ep N adds (help; N stands for each size).
EP_ABOUT = {
    "moe_compute_epN": "moe on ONE device with T tokens, top-K of E/N experts: one EP "
                       "rank's expert work without communication, the reference of the "
                       "EP rows",
    "moe_epN_xla": "moe(backend='xla') on a mesh of N devices (experts and tokens "
                   "sharded, T tokens per device), rows moved by XLA's all_to_all",
    "moe_epN_fused": "moe(backend='fused') on the same mesh, rows moved by mok_jax's "
                     "NVLink transport; needs a CUDA GPU and a build with it",
}


def help_epilog() -> str:
    """The end of --help: every shape with its dimensions, every pipeline, pass and
    exchange with what it is, and how to read the numbers (made from the tables
    above, so it cannot go stale)."""
    width = max(len(n) for n in (*IMPLS, *EXTRA_IMPLS, *TORCH_IMPLS, *EXCHANGES,
                                 *EP_ABOUT))
    lines = ["shapes (--shapes; T tokens per device, top-K of E experts, hidden H,",
             "expert FFN F; rows per expert T*K/E):"]
    for name, full in FULL_SHAPES.items():
        quick = QUICK_SHAPES[name]
        default = "" if name in DEFAULT_SHAPES else " (only when --shapes names it)"
        lines.append(f"  {name}: {SHAPE_ABOUT.get(name, '')}{default}")
        for label, shape in (("full", full), ("quick", quick)):
            lines.append(f"      {label:<5}  {_dims(shape)} "
                         f"{shape.tokens * shape.top_k // shape.experts:>5} rows/expert")
    lines += [
        "  quick: the same problems scaled for a 2-core CPU (--quick; the default on CPU",
        "  unless --full-on-cpu).",
        "",
        "custom problems (--shape [NAME=]T,K,E,H,F, repeatable): five positive integers",
        "  with K <= E, timed as given (--quick does not scale them). --shape replaces",
        "  the default shape list: only the custom problems run, plus the bench shapes",
        "  an explicit --shapes names. Default NAME: T<T>-K<K>-E<E>-H<H>-F<F>; the name",
        "  serves --skip IMPL/PASS/NAME and --ep-shapes.",
        "",
        f"pipelines (--impls; default {','.join(IMPLS)}):",
    ]
    for name in IMPLS + EXTRA_IMPLS:
        lines += _entry(name, IMPL_ABOUT[name], width)
    lines.append("--torch adds (PyTorch, bf16, in a subprocess before JAX starts; CUDA only):")
    for name in TORCH_IMPLS:
        lines += _entry(name, TORCH_ABOUT[name], width)
    lines += [
        "--ep N adds, for each N >= 2 and each of --ep-shapes:",
    ]
    for name, text in EP_ABOUT.items():
        lines += _entry(name, text, width)
    lines.append("--exchange adds, with --ep N, the EP dispatch exchange alone (bytes per "
                 "device, GB/s):")
    for name in EXCHANGES:
        lines += _entry(name, EXCHANGE_ABOUT[name], width)
    lines.append("passes (--passes; default both):")
    for name in PASSES:
        lines += _entry(name, PASS_ABOUT[name], width)
    lines += [
        "",
        "method: each pass is jitted and compiled, run --warmup times untimed, then timed",
        "  --repeats times (each run blocked on); records report the median. --queue N",
        "  adds --repeats batches of N calls blocked once each (queued ms). Routing is",
        "  made outside the timed function. TFLOP/s count GEMM FLOPs only (fwd",
        "  6*T*K*H*F, fwdbwd 18*T*K*H*F) for every pipeline alike. All baselines run in",
        "  the same process as moe (torch: a subprocess just before).",
        "reading the results:",
        "  mok speedup   baseline median / moe median, same shape and pass (> 1: moe is",
        "                faster); single-device rows only",
        "  EP/compute    EP=N median / the moe_compute_epN median of the same shape and",
        "                pass, the compute-only time of one device doing one rank's work",
        "                (T tokens, K of E/N experts: the same rows and GEMM FLOPs per",
        "                device, no communication); a time ratio, lower is better, 1.00x",
        "                is perfect weak scaling. The JSON also has the ratio to the",
        "                one-device moe record with all E experts",
        "                (ep_time_ratio_all_experts)",
    ]
    lines += textwrap.wrap(
        f"GPU-only measurements ({', '.join(GPU_ONLY)}) are not attempted on CPU: they "
        "are recorded as skipped, with the reason.", HELP_WIDTH, initial_indent="  ",
        subsequent_indent="  ")
    lines += [
        "",
        "examples:",
        "  python -m mok_jax.bench --quick --repeats 5",
        "  python -m mok_jax.bench --shape 4096,8,64,2048,1024 --impls moe,ragged_dot",
        "  python -m mok_jax.bench --shapes ep --impls moe --ep 2,4 --exchange --json ep.json",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mok_jax.bench",
        description="Time mok_jax.moe (forward, and forward+backward) against pure-JAX\n"
                    "MoE baselines on the bench shapes or a custom one, in one process.",
        epilog=help_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="the scaled-down bench shapes (for CPU: a few minutes in all)")
    parser.add_argument("--full-on-cpu", action="store_true",
                        help="run the full bench shapes even on CPU (very slow)")
    parser.add_argument("--shapes", type=_csv(tuple(FULL_SHAPES), "shape"), default=None,
                        help="comma list of bench shapes (default: "
                             f"{','.join(DEFAULT_SHAPES)}, or none when --shape is given)")
    parser.add_argument("--shape", type=custom_shape, action="append", default=[],
                        metavar="[NAME=]T,K,E,H,F",
                        help="a custom problem (repeatable): T tokens, top-K of E experts, "
                             "hidden H, expert FFN F, five positive integers, K <= E; "
                             "replaces the default shape list (see below)")
    parser.add_argument("--impls", type=_csv(IMPLS + EXTRA_IMPLS, "impl"),
                        default=list(IMPLS), help="comma list of pipelines (see below)")
    parser.add_argument("--passes", type=_csv(PASSES, "pass"), default=list(PASSES),
                        help="fwd and/or fwdbwd")
    parser.add_argument("--queue", type=int, default=0, metavar="N",
                        help="also time each single-device pipeline (and the torch ones) "
                             "in --repeats batches of N calls dispatched back to back, "
                             "blocked once per batch: the device-bound time per call "
                             "(`queued ms`); 0 (default): not measured")
    parser.add_argument("--repeats", type=int, default=20,
                        help="timed runs per measurement (median of these; default 20)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed runs after compilation (default 3)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--recipe", type=_recipes, default=("native",),
                        help="mok_jax.moe's recipes, comma-separated, each timed in the "
                             "same process (default native: GEMMs in --dtype; fp8: "
                             "float8_e4m3fn with block scales, bf16 only); the baselines "
                             "always compute in --dtype")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true",
                        help="also compare each pipeline's outputs (and gradients) "
                             "with the dense reference; costs memory and time")
    parser.add_argument("--verbose", action="store_true",
                        help="print the traceback of each failing pipeline")
    parser.add_argument("--torch", action="store_true",
                        help="also time PyTorch baselines (torch._grouped_mm pipeline, its "
                             "GEMMs alone, and the FP8 torch._scaled_grouped_mm GEMMs "
                             "forward) in a subprocess; bf16 inputs; needs torch with "
                             "CUDA (skipped, with the reason, on CPU)")
    parser.add_argument("--ep", type=_int_list, default=[], metavar="N[,N...]",
                        help="also time moe on a mesh of N devices (experts and tokens "
                             "sharded; T tokens per device: weak scaling) per exchange "
                             "backend (xla, fused), and one rank's work on one device "
                             "(compute-only, their reference), for each of --ep-shapes; "
                             "a comma list times each size, e.g. 2,4,8. Needs N devices, "
                             "moe in --impls, and E divisible by N")
    parser.add_argument("--exchange", action="store_true",
                        help="with --ep N: also time the EP dispatch exchange alone "
                             "(see below) for each of --ep-shapes")
    parser.add_argument("--ep-shapes", type=_csv_free, default=None, metavar="SHAPE[,...]",
                        help="comma list of the shapes timed with --ep and --exchange, "
                             "each one of this run's shapes (default: the ep bench shape "
                             "and every --shape, of those in this run)")
    parser.add_argument("--skip", type=_csv_free, default=[], metavar="IMPL/PASS[/SHAPE]",
                        help="comma list of measurements not to attempt (recorded as "
                             "skipped), e.g. ragged_dot/fwdbwd/small-experts: a pipeline "
                             "XLA spends minutes failing to compile; each entry must "
                             "name a measurement of this run")
    parser.add_argument("--try-all", action="store_true",
                        help="attempt ragged_dot's backward on GPU even where its dense "
                             "weight gradient is known not to compile (see auto_skip)")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write machine info, argv and records here")
    return parser


def use_quick(args: argparse.Namespace, backend: str) -> bool:
    """Whether the bench shapes are the --quick ones (also the default on CPU)."""
    return args.quick or (backend == "cpu" and not args.full_on_cpu)


def run_shapes(args: argparse.Namespace, quick: bool) -> list[Shape]:
    """The shapes of this run: the --shapes bench shapes, then the --shape ones."""
    table = QUICK_SHAPES if quick else FULL_SHAPES
    return [table[name] for name in args.shapes] + list(args.shape)


def plan(args: argparse.Namespace, shapes: Sequence[Shape], backend: str | None = None
         ) -> list[tuple[Shape, str, str]]:
    """The single-device measurements this run attempts, (shape, impl, pass): those
    not named in --skip and, when `backend` is given, neither GPU-only there nor
    auto-skipped (unless --try-all)."""
    return [(shape, impl, pass_name)
            for shape in shapes for pass_name in args.passes for impl in args.impls
            if not skipped(args.skip, impl, pass_name, shape.name)
            and (backend is None or not (
                platform_skip(impl, backend)
                or (not args.try_all and auto_skip(shape, impl, pass_name, backend))))]


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses (parser.error) flags that would select nothing, or not what they name,
    and fills in the defaults that depend on other flags (shapes, ep_shapes).
    Needs no devices; check_platform does the checks that do."""
    fail = parser.error
    if args.repeats < 1 or args.warmup < 0 or args.queue < 0:
        fail("--repeats must be >= 1, --warmup and --queue >= 0")
    if "fp8" in args.recipe and args.dtype != "bf16":
        fail("--recipe fp8 takes bfloat16 inputs: use --dtype bf16")
    names = [shape.name for shape in args.shape]
    twice = _dedupe(n for n in names if names.count(n) > 1)
    if twice:
        fail(f"--shape {','.join(twice)} given twice (name them apart with NAME=T,K,E,H,F)")
    if args.shapes is None:
        args.shapes = [] if args.shape else list(DEFAULT_SHAPES)
    selected = args.shapes + names
    if args.quick and args.full_on_cpu:
        fail("--quick and --full-on-cpu contradict each other (--quick: the scaled-down "
             "bench shapes; --full-on-cpu: the full ones, even on CPU)")
    if (args.quick or args.full_on_cpu) and not args.shapes:
        flag = "--quick" if args.quick else "--full-on-cpu"
        fail(f"{flag} chooses between the full and the scaled-down bench shapes, and this "
             "run has none: a --shape is timed as given (add --shapes NAME,... to time "
             "bench shapes too)")
    if args.torch and args.dtype != "bf16":
        fail(f"--torch times its PyTorch baselines in bf16 only, so they would not compare "
             f"with --dtype {args.dtype}; drop one of the two")
    if args.json:  # checked now: the file is first written after the first measurement
        path = os.path.abspath(args.json)
        if os.path.isdir(path):
            fail(f"--json {args.json} is a directory; give the path of a file")
        parent = os.path.dirname(path)
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
            fail(f"--json {args.json} cannot be written: {parent} is not a writable directory")

    for entry in args.skip:  # a typo would silently run what it meant to skip
        parts = entry.split("/")
        if (len(parts) not in (2, 3) or parts[0] not in IMPLS + EXTRA_IMPLS + TORCH_IMPLS
                or parts[1] not in PASSES
                or (len(parts) == 3 and parts[2] not in (*FULL_SHAPES, *names))):
            fail(f"--skip entry {entry!r} is not IMPL/PASS[/SHAPE] with IMPL in "
                 f"{IMPLS + EXTRA_IMPLS + TORCH_IMPLS}, PASS in {PASSES}, SHAPE in "
                 f"{(*FULL_SHAPES, *names)}")
        why = []
        if parts[0] in TORCH_IMPLS:
            if not args.torch:
                why.append(f"{parts[0]} runs only with --torch")
        elif parts[0] not in args.impls:
            why.append(f"{parts[0]} is not in --impls ({','.join(args.impls)})")
        if parts[1] not in args.passes:
            why.append(f"{parts[1]} is not in --passes ({','.join(args.passes)})")
        if len(parts) == 3 and parts[2] not in selected:
            why.append(f"{parts[2]} is not among this run's shapes ({','.join(selected)})")
        if why:
            fail(f"--skip entry {entry!r} matches nothing in this run: {'; '.join(why)}")

    sizes = [n for n in args.ep if n > 1]
    if args.exchange and not sizes:
        fail("--exchange needs --ep with a size >= 2")
    if args.ep and not sizes:
        fail(f"--ep {','.join(map(str, args.ep))} adds nothing: EP=1 is the one-device moe "
             "record every run has; give a size >= 2, e.g. --ep 2")
    if args.ep_shapes is not None and not args.ep:
        fail("--ep-shapes chooses the shapes of --ep and --exchange, and there is no "
             "--ep N: it would select nothing")
    if args.ep:
        if args.ep_shapes is None:
            args.ep_shapes = [n for n in selected if n == "ep" or n in names]
            if not args.ep_shapes:
                fail(f"--ep {','.join(map(str, args.ep))} would time nothing: EP runs on "
                     "--ep-shapes (default: the ep bench shape and every --shape), and this "
                     f"run's shapes ({','.join(selected)}) include none of them; add ep to "
                     "--shapes, or pass --ep-shapes with one of this run's shapes")
        else:
            missing = [n for n in args.ep_shapes if n not in selected]
            if missing:
                fail(f"--ep-shapes {','.join(missing)}: not among this run's shapes "
                     f"({','.join(selected)}); EP rows are also compared with the "
                     "one-device moe record of the same shape, so add them to --shapes "
                     "(or --shape)")
        if MOK not in args.impls:
            fail(f"--ep times moe (on N devices, and on one device with one rank's E/N "
                 f"experts), and --impls ({','.join(args.impls)}) has no moe; add moe to "
                 "--impls")
        for name in args.ep_shapes:
            for pass_name in args.passes:
                if skipped(args.skip, MOK, pass_name, name):
                    fail(f"--skip removes moe/{pass_name} on {name}, the one-device record "
                         f"(all E experts) its EP rows are also compared with")
    else:
        args.ep_shapes = []
    if not args.torch and not args.ep and not plan(args, run_shapes(args, False)):
        fail("nothing to time: --skip names every measurement of --impls x --passes x "
             "shapes")


def check_platform(parser: argparse.ArgumentParser, args: argparse.Namespace,
                   backend: str, device_count: int) -> None:
    """The checks of check_args that need to know the devices: refuses (parser.error)
    --ep sizes the machine cannot run, GPU-only selections on CPU that leave nothing
    to time, and flags that change nothing on this backend."""
    fail = parser.error
    sizes = [n for n in args.ep if n > 1]
    if sizes and max(sizes) > device_count:
        hint = (" (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N gives N host "
                "devices)" if backend == "cpu" else "")
        fail(f"--ep {max(sizes)} needs {max(sizes)} devices; JAX sees {device_count} "
             f"{backend} device(s){hint}")
    quick = use_quick(args, backend)
    shapes = run_shapes(args, quick)
    for shape in shapes:
        if shape.name in args.ep_shapes:
            for n in sizes:
                if shape.experts % n:
                    fail(f"--ep {n}: shape {shape.name} has E={shape.experts} experts, which "
                         f"do not split evenly over {n} devices (EP shards the experts)")
    if args.full_on_cpu and backend != "cpu":
        fail(f"--full-on-cpu changes nothing on {backend}: the full shapes are the default "
             "there")
    torch_runs = args.torch and not any(platform_skip(i, backend) for i in TORCH_IMPLS)
    if not args.ep and not torch_runs and not plan(args, shapes, backend):
        why = _dedupe([f"{i}: {platform_skip(i, backend)}" for i in args.impls
                       if platform_skip(i, backend)]
                      + [f"{i}: {platform_skip(i, backend)}" for i in TORCH_IMPLS
                         if args.torch and platform_skip(i, backend)]
                      + [f"{impl}/{p} on {shape.name}: {auto_skip(shape, impl, p, backend)}"
                         for shape, impl, p in plan(args, shapes)
                         if auto_skip(shape, impl, p, backend)])
        fail(f"nothing to time on {backend}: every selected measurement is skipped here ("
             + "; ".join(why) + ")")
    if args.try_all and not any(auto_skip(shape, impl, p, backend)
                                for shape, impl, p in plan(args, shapes)):
        fail(f"--try-all changes nothing in this run: nothing here is auto-skipped (only "
             f"ragged_dot fwdbwd on GPU is, where its dense f32 weight gradient needs >= "
             f"{RAGGED_DOT_DENSE_WGRAD_LIMIT // 2**30} GiB)")


def parse_args(argv: Sequence[str] | None,
               platform_: tuple[str, int] | None = None) -> argparse.Namespace:
    """The parsed and checked command line (check_args); with `platform_` =
    (backend, device count) also check_platform's checks."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    if platform_ is not None:
        check_platform(parser, args, *platform_)
    return args


def detect_platform(isolated: bool = False) -> tuple[str, int]:
    """(JAX's default backend, its device count).

    With `isolated`, and while JAX has not started its backends in this process,
    a subprocess that does not preallocate GPU memory answers, so that the --torch
    baselines, run before JAX starts here, still find the GPU's memory free.
    """
    if isolated:
        try:
            from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
            started = xla_bridge.backends_are_initialized()
        except Exception:  # pylint: disable=broad-except
            started = False
        if not started:
            env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
            if jax.config.jax_platforms:
                env["JAX_PLATFORMS"] = jax.config.jax_platforms
            code = ("import json, jax; "
                    "print(json.dumps([jax.default_backend(), jax.device_count()]))")
            try:
                proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                      text=True, timeout=600, env=env, check=True)
                backend, count = json.loads(proc.stdout.strip().splitlines()[-1])
                return str(backend), int(count)
            except Exception:  # pylint: disable=broad-except
                pass  # ask this process instead
    return jax.default_backend(), jax.device_count()


def _print_progress(record: dict) -> None:
    if record["median_ms"] is not None:
        per = " per device" if is_ep_record(record) else ""
        done = f"{record['median_ms']:.3f} ms, {record['tflops']:.3g} TFLOP/s{per}"
    else:  # the reason, shortened: a timeout may keep the JSON from being written
        done = f"{record['status']}: {str(record.get('error') or '')[:200]}"
    print(f"  {record['shape']} {record['impl']} {record['pass']}: {done}", file=sys.stderr,
          flush=True)


def main(argv: Sequence[str] | None = None) -> dict:
    """Runs the benchmark; prints the table; returns (and maybe writes) the results."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    # Before anything runs: the device checks (with --torch, without taking the GPU).
    backend, device_count = detect_platform(isolated=args.torch)
    check_platform(build_parser(), args, backend, device_count)
    quick = use_quick(args, backend)
    if quick and not args.quick and args.shapes:
        print("note: full bench shapes on CPU take very long; running the --quick "
              "shapes (pass --full-on-cpu to run the full ones).", file=sys.stderr)
    shapes = run_shapes(args, quick)
    gpu_only = [n for n in (*args.impls, *(TORCH_IMPLS if args.torch else ()),
                            *((FUSED_EP,) if args.ep else ()),
                            *(EXCHANGES if args.exchange else ()))
                if platform_skip(n, backend)]
    for name in gpu_only:
        print(f"note: {name} is not attempted on {backend} (recorded as skipped): "
              f"{platform_skip(name, backend)}", file=sys.stderr)
    pre_records = []
    if args.torch:  # before JAX initialises the GPU and reserves its memory
        pre_records = torch_records(shapes, args.passes, warmup=args.warmup,
                                    repeats=args.repeats, backend=backend, skip=args.skip,
                                    queue=args.queue)
        for record in pre_records:
            _print_progress(record)
    info = machine_info()
    print(f"mok_jax.bench: {info['backend']} ({info['device_kind']}), jax "
          f"{info['jax_version']}, {args.dtype}, shapes {','.join(s.name for s in shapes)}"
          f"{(' (quick dims)' if quick else ' (full dims)') if args.shapes else ''}, "
          f"{args.warmup} warm-up + {args.repeats} timed runs", file=sys.stderr)

    records, exchange_records = [], []
    start = time.perf_counter()

    def save(records: list[dict]) -> dict:
        """The result so far; written to --json after every record (a run cut short by
        a time limit keeps what it measured)."""
        result = {
            "machine": info,
            "argv": argv,
            "settings": {"quick": quick, "check": args.check, "dtype": args.dtype,
                         "recipe": ",".join(args.recipe),
                         "warmup": args.warmup,
                         "repeats": args.repeats, "seed": args.seed,
                         "shapes": args.shapes,
                         "custom_shapes": [dataclasses.asdict(s) for s in args.shape],
                         "impls": args.impls,
                         "passes": args.passes, "ep": args.ep, "torch": args.torch,
                         "ep_shapes": args.ep_shapes, "exchange": args.exchange,
                         "skip": args.skip, "try_all": args.try_all},
            "legend": LEGEND,
            "elapsed_s": time.perf_counter() - start,
            "records": records,
            "exchange": exchange_records,
        }
        if args.json:
            directory = os.path.dirname(os.path.abspath(args.json))
            os.makedirs(directory, exist_ok=True)
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=1)
                f.write("\n")
        return result

    for shape in shapes:
        inputs = make_inputs(shape, DTYPES[args.dtype], args.seed)
        for pass_name in args.passes:
            reference = None
            if args.check:
                check_name, reference, check_error = reference_outputs(
                    pass_name, inputs)
                if check_error:
                    print(f"  {shape.name} {pass_name}: no check, {check_name} "
                          f"failed: {check_error.splitlines()[0][:300]}",
                          file=sys.stderr)
            for impl in args.impls:
                why_not = ("named in --skip" if skipped(args.skip, impl, pass_name, shape.name)
                           else platform_skip(impl, backend)
                           or (None if args.try_all
                               else auto_skip(shape, impl, pass_name, backend)))
                if why_not:
                    record = new_record(shape, impl, pass_name, dtype_name=args.dtype,
                                        warmup=args.warmup, repeats=args.repeats)
                    record.update(status="skipped", error=why_not)
                    records.append(record)
                    _print_progress(record)
                    save(records + pre_records)
                    continue
                for recipe in (args.recipe if impl in MOK_IMPLS else ("native",)):
                    record = bench_one(shape, impl, pass_name, inputs,
                                       dtype_name=args.dtype, warmup=args.warmup,
                                       repeats=args.repeats, reference=reference,
                                       verbose=args.verbose, recipe=recipe,
                                       queue=args.queue)
                    if args.check:
                        record["check_reference"] = check_name
                        record["check_error"] = record["check_error"] or check_error
                    records.append(record)
                    _print_progress(record)
                    save(records + pre_records)
            del reference
            for ep_size in (args.ep if shape.name in args.ep_shapes else []):
                if ep_size < 2:
                    continue  # EP=1 is the single-device record above
                runs = []
                for recipe in args.recipe:
                    common = {"dtype": DTYPES[args.dtype], "dtype_name": args.dtype,
                              "seed": args.seed, "warmup": args.warmup,
                              "repeats": args.repeats, "verbose": args.verbose,
                              "recipe": recipe}
                    # The reference first: one rank's expert work on one device, then
                    # the EP layer over each exchange backend (each saved as it ends).
                    runs += [functools.partial(bench_compute_only, shape, ep_size,
                                               pass_name, **common)]
                    runs += [functools.partial(bench_ep, shape, ep_size, pass_name,
                                               backend=b, **common) for b in EP_BACKENDS]
                for run in runs:
                    record = run()
                    records.append(record)
                    _print_progress(record)
                    save(records + pre_records)
        del inputs
        exchange_sizes = [n for n in args.ep if n > 1] if args.exchange else []
        for ep_size, kind in ((n, k) for n in exchange_sizes for k in EXCHANGES):
            if shape.name in args.ep_shapes:
                xrec = bench_exchange(shape, ep_size, kind, dtype=DTYPES[args.dtype],
                                      warmup=args.warmup, repeats=args.repeats,
                                      seed=args.seed)
                exchange_records.append(xrec)
                done = (f"{xrec['median_ms']:.3f} ms, {xrec['gb_per_s']:.1f} GB/s"
                        if xrec["median_ms"] is not None
                        else f"{xrec['status']}: {str(xrec['error'])[:200]}")
                print(f"  {shape.name} exchange {kind} P={ep_size}: {done}",
                      file=sys.stderr, flush=True)
                save(records + pre_records)
    records += pre_records
    add_speedups(records)
    print(format_table(records))
    if exchange_records:
        print("\n" + format_exchanges(exchange_records))
    print(f"\n{len(records)} measurements in {time.perf_counter() - start:.1f} s")
    result = save(records)
    if args.json:
        print(f"wrote {args.json}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
