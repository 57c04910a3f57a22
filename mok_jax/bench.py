"""`python -m mok_jax.bench`: `mok_jax.moe` side by side with pure-JAX baselines.

Method: each pipeline runs the whole MoE layer (dispatch and combine included,
routing excluded: expert ids and weights are made outside the timed function) on
the bench shapes below (or a custom `--shape T,K,E,H,F`), in bf16 by default. Each
pass is jitted and compiled, run `--warmup` times untimed (default 3), then timed
`--repeats` times (default 20), each run blocked on; a record reports the median
(and min and mean) of those runs. TFLOP/s count GEMM FLOPs only: forward
6*T*K*H*F, forward+backward 18*T*K*H*F, credited alike to every pipeline (so the
dense one-hot baseline's E/K times larger GEMMs count as waste). Every baseline is
measured in the same process as `moe` (the PyTorch ones, `--torch`, in a
subprocess run just before). `mok speedup` is baseline median / `moe` median of
the same shape and pass (> 1: `moe` is faster).

EP (`--ep N`): `moe` on a mesh of N devices, experts and tokens sharded, T tokens
per device (weak scaling). Its reference is the compute-only time of one device
doing one rank's work: the single-device `moe` record of the same shape and pass,
which has the same T tokens and GEMM FLOPs per device and no communication. EP
rows are reported as the time ratio EP=N / 1 device (lower is better, 1.00x is
perfect weak scaling), never as a speedup.

GPU-only baselines (tokamax's Pallas kernels, the torch `_grouped_mm` ones,
ragged_all_to_all in `--exchange`) are not attempted on CPU: they are recorded as
skipped with the reason, and a note says so.

`--help` lists every shape with its dimensions and every pipeline, pass and
exchange with what it is. Combinations of flags that would time nothing, or not
what they name, are refused before anything runs.

Examples::

    python -m mok_jax.bench                                # all shapes, impls, passes
    python -m mok_jax.bench --quick --repeats 5            # scaled-down shapes (CPU)
    python -m mok_jax.bench --shapes ep --impls moe,tokamax --passes fwd --json out.json
    python -m mok_jax.bench --shape 4096,8,64,2048,1024    # one custom problem only
    python -m mok_jax.bench --check                        # + errors vs the reference
    python -m mok_jax.bench --shapes ep --impls moe --ep 2  # + EP=2 over 2 devices

--check also compares every pipeline's y and gradients with the dense reference
(relative Frobenius error per output), so that a fast but wrong pipeline shows.

On CPU the full shapes take very long; without --full-on-cpu a CPU run uses the
--quick shapes.
"""

from __future__ import annotations

import argparse
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

from mok_jax import baselines


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
    )
}

# The same problems scaled for a 2-core CPU (all of them, every impl, both passes in
# a few minutes): T / 64-128, H and F / 16, K kept, E capped so that the rows per
# expert (T*K/E) keep their order: ep stays the shape with the fewest rows per
# expert, mixtral-like the one with the most.
QUICK_SHAPES = {
    s.name: s for s in (
        Shape("small-experts", 256, 8, 32, 128, 48),
        Shape("deepseek-slice", 128, 8, 16, 448, 128),
        Shape("mixtral-like", 128, 2, 8, 256, 896),
        Shape("ep", 64, 8, 32, 448, 128),
    )
}

# What each bench shape stands for (its dimensions are printed from the Shape).
SHAPE_ABOUT = {
    "small-experts": "many small experts",
    "deepseek-slice": "DeepSeek-V3-sized experts, a slice of the expert set",
    "mixtral-like": "few large experts, top-2 (Mixtral-like)",
    "ep": "one device's share of the EP problem, all experts local "
          "(the default --ep shape)",
}

IMPLS = ("moe", "ragged_dot", "dense_onehot", "tokamax")
# Selectable, not run by default: mok_jax.moe forced onto its XLA-exchange path.
EXTRA_IMPLS = ("moe_xla",)
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
    "tokamax": "needs a CUDA GPU: tokamax's Pallas Mosaic kernels run on GPUs only "
               "(on CPU tokamax.ragged_dot falls back to XLA's ragged_dot, which the "
               "ragged_dot row already times)",
    "torch_pipeline": "needs a CUDA GPU: torch._grouped_mm runs on CUDA only (and the "
                      "JAX pipelines here run on the CPU, so a GPU time would not compare)",
    "torch_grouped_mm": "needs a CUDA GPU: torch._grouped_mm runs on CUDA only (and the "
                        "JAX pipelines here run on the CPU, so a GPU time would not "
                        "compare)",
    "ragged_all_to_all": "needs a GPU: XLA has no CPU lowering of ragged_all_to_all",
}


def platform_skip(name: str, backend: str) -> str | None:
    """Why the pipeline, torch baseline or exchange `name` is not attempted on
    `backend` (a GPU-only one on CPU), or None."""
    if backend == "cpu" and name in GPU_ONLY:
        return GPU_ONLY[name]
    return None


MoEFn = Callable[..., jax.Array]


def resolve_impl(name: str) -> tuple[MoEFn | None, str | None]:
    """The pipeline called `name`, or (None, why it is unavailable)."""
    if name in ("moe", "moe_xla"):
        try:
            import mok_jax  # pylint: disable=import-outside-toplevel
            moe = mok_jax.moe
        except Exception as err:  # pylint: disable=broad-except
            return None, f"mok_jax.moe not importable: {type(err).__name__}: {err}"
        return (moe if name == "moe" else functools.partial(moe, backend="xla")), None
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


def make_inputs(shape: Shape, dtype, seed: int = 0) -> dict[str, jax.Array]:
    """Random layer inputs and routing (made here, outside every timed function).

    Routing: top-K of [T, E] normal logits; weights are the softmax of the K chosen
    logits. dy is a fixed [T, H] cotangent for the backward pass.
    """
    t, k, e, h, f = shape.tokens, shape.top_k, shape.experts, shape.hidden, shape.ffn
    keys = jax.random.split(jax.random.key(seed), 6)
    logits = jax.random.normal(keys[0], (t, e), jnp.float32)
    top_logits, expert_ids = jax.lax.top_k(logits, k)
    inputs = {
        "x": jax.random.normal(keys[1], (t, h), jnp.float32).astype(dtype),
        "expert_ids": expert_ids.astype(jnp.int32),
        "expert_weights": jax.nn.softmax(top_logits, axis=-1),
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
        return name, None, _error_string(err)
    return name, jax.tree_util.tree_leaves(out), None


@jax.jit
def _rel_fro(got: jax.Array, want: jax.Array) -> jax.Array:
    got = got.astype(jnp.float32)
    want = want.astype(jnp.float32)
    return jnp.linalg.norm((got - want).ravel()) / jnp.linalg.norm(want.ravel())


def relative_errors(pass_name: str, got: list[jax.Array],
                    want: list[jax.Array]) -> dict[str, float]:
    """Relative Frobenius error of each output (y, then the gradients) vs the oracle."""
    return {name: float(_rel_fro(g, w))
            for name, g, w in zip(OUTPUT_NAMES[pass_name], got, want)}


def _error_string(err: BaseException) -> str:
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
    }


def finish_record(record: dict, times_ms: list[float], compile_s: float | None) -> dict:
    """Fills the timing fields: median, min, mean and TFLOP/s at the median."""
    median_ms = statistics.median(times_ms)
    record.update(
        compile_s=compile_s, median_ms=median_ms, min_ms=min(times_ms),
        mean_ms=statistics.fmean(times_ms), times_ms=times_ms,
        tflops=record["gemm_flops"] / (median_ms * 1e-3) / 1e12)
    return record


def bench_one(shape: Shape, impl: str, pass_name: str, inputs: dict, *,
              dtype_name: str, warmup: int, repeats: int,
              reference: list[jax.Array] | None = None,
              verbose: bool = False) -> dict:
    """One record: timings of `impl` on `shape` for `pass_name`, or its error.

    With `reference` (the oracle's flat outputs), one more untimed run is compared
    with it and the record gets `rel_err` per output (or `check_error`).
    `verbose` prints the traceback of a failure to stderr.
    """
    record = new_record(shape, impl, pass_name, dtype_name=dtype_name, warmup=warmup,
                        repeats=repeats)
    why = platform_skip(impl, jax.default_backend())
    if why:
        record.update(status="skipped", error=why)
        return record
    fn, why = resolve_impl(impl)
    if fn is None:
        record.update(status="unavailable", error=why)
        return record
    if impl == "tokamax":
        record["note"] = baselines.tokamax_available()[1] or None
    try:
        step, names = build_step(fn, pass_name)
        args = [inputs[n] for n in names]
        compile_s, times_ms, compiled = time_step(step, args, warmup=warmup,
                                                  repeats=repeats)
    except Exception as err:  # pylint: disable=broad-except
        # An OOM or an unsupported shape in one pipeline must not end the run.
        record.update(status="error", error=_error_string(err))
        if verbose:
            traceback.print_exc()
        return record
    if reference is not None:
        try:
            got = jax.tree_util.tree_leaves(compiled(*args))
            record["rel_err"] = relative_errors(pass_name, got, reference)
            del got
        except Exception as err:  # pylint: disable=broad-except
            record["check_error"] = _error_string(err)
            if verbose:
                traceback.print_exc()
    return finish_record(record, times_ms, compile_s)


def ep_mesh(ep_size: int):
    """(a 1-D mesh "ep" over the first ep_size devices, None) or (None, why not)."""
    if len(jax.devices()) < ep_size:
        return None, f"needs {ep_size} devices, found {len(jax.devices())}"
    return jax.make_mesh((ep_size,), ("ep",), devices=jax.devices()[:ep_size]), None


def bench_ep(shape: Shape, ep_size: int, pass_name: str, *, dtype, dtype_name: str,
             seed: int, warmup: int, repeats: int, verbose: bool = False) -> dict:
    """`moe` under jit on a mesh of `ep_size` devices (experts sharded, EP over
    XLA collectives), with `shape.tokens` tokens per device: the per-device work
    of the single-device record of the same shape, so the two times compare."""
    from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel
    impl = f"moe_ep{ep_size}"
    record = new_record(shape, impl, pass_name, dtype_name=dtype_name, warmup=warmup,
                        repeats=repeats)
    record["ep_size"] = ep_size
    mesh, why = ep_mesh(ep_size)
    if mesh is None:
        record.update(status="unavailable", error=why)
        return record
    try:
        fn, why = resolve_impl(MOK)
        if fn is None:
            record.update(status="unavailable", error=why)
            return record
        global_shape = dataclasses.replace(shape, tokens=shape.tokens * ep_size)
        inputs = make_inputs(global_shape, dtype, seed)
        # Tokens, routing, dy and the experts dim of both weights: all split on dim 0.
        sharded = NamedSharding(mesh, PartitionSpec("ep"))
        inputs = {k: jax.device_put(v, sharded) for k, v in inputs.items()}
        step, names = build_step(fn, pass_name)
        compile_s, times_ms, _ = time_step(step, [inputs[n] for n in names], warmup=warmup,
                                           repeats=repeats)
    except Exception as err:  # pylint: disable=broad-except
        record.update(status="error", error=_error_string(err))
        if verbose:
            traceback.print_exc()
        return record
    return finish_record(record, times_ms, compile_s)


EXCHANGES = ("all_to_all_slots", "all_to_all_exact", "ragged_all_to_all")
EXCHANGE_ABOUT = {
    "all_to_all_slots": "all_to_all with ep.py's layout: a fixed slot of T*K rows per "
                        "peer (any routing fits; P times the rows travel)",
    "all_to_all_exact": "all_to_all with slots of exactly T*K/P rows (what a balanced "
                        "routing needs)",
    "ragged_all_to_all": "the T*K/P rows per peer named by offsets and sizes (only the "
                         "real rows travel); needs a GPU",
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
    raise ValueError(f"unknown exchange {kind!r}; choose from {EXCHANGES}")


def bench_exchange(shape: Shape, ep_size: int, kind: str, *, dtype, warmup: int,
                   repeats: int) -> dict:
    """Time of one dispatch exchange of `shape`'s T*K rows per device over `ep_size`
    devices; GB/s counts the rows that must leave each device ((P-1)/P of them)."""
    from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel
    rows, hidden = shape.tokens * shape.top_k, shape.hidden
    record = {"shape": shape.name, "exchange": kind, "ep_size": ep_size, "rows": rows,
              "hidden": hidden, "dtype": jnp.dtype(dtype).name, "status": "ok",
              "error": None, "median_ms": None, "gb_per_s": None}
    why = platform_skip(kind, jax.default_backend())
    if why:
        record.update(status="skipped", error=why)
        return record
    mesh, why = ep_mesh(ep_size)
    if mesh is None:
        record.update(status="unavailable", error=why)
        return record
    try:
        sharded = NamedSharding(mesh, PartitionSpec("ep"))
        local_rows = rows * ep_size if kind == "all_to_all_slots" else rows

        def filled(n_rows, value):  # made in place, shard by shard (not on one device)
            return jax.jit(lambda: jnp.full((ep_size * n_rows, hidden), value, dtype),
                           out_shardings=sharded)()
        args = [filled(local_rows, 1)]
        specs = (PartitionSpec("ep"),)
        if kind == "ragged_all_to_all":
            args.append(filled(rows, 0))
            specs += (PartitionSpec("ep"),)
        step = jax.jit(jax.shard_map(exchange_fn(kind, ep_size, rows, hidden), mesh=mesh,
                                     in_specs=specs, out_specs=PartitionSpec("ep")))
        compile_s, times_ms, _ = time_step(step, args, warmup=warmup, repeats=repeats)
    except Exception as err:  # pylint: disable=broad-except
        record.update(status="error", error=_error_string(err))
        return record
    median = statistics.median(times_ms)
    leaving = rows * (ep_size - 1) // ep_size * hidden * jnp.dtype(dtype).itemsize
    record.update(median_ms=median, min_ms=min(times_ms), compile_s=compile_s,
                  times_ms=times_ms, gb_per_s=leaving / (median * 1e-3) / 1e9)
    return record


TORCH_IMPLS = ("torch_pipeline", "torch_grouped_mm")
TORCH_ABOUT = {
    "torch_pipeline": "the eager PyTorch layer a user writes with torch._grouped_mm "
                      "(gather, grouped GEMMs, SwiGLU, index_add_ combine)",
    "torch_grouped_mm": "torch._grouped_mm's two grouped GEMMs alone on pre-permuted "
                        "rows: the GEMM time the whole layer is compared with",
}


def torch_records(shapes: Sequence[Shape], passes: Sequence[str], *, warmup: int,
                  repeats: int, timeout_s: float = 1800,
                  backend: str | None = None) -> list[dict]:
    """PyTorch baselines (mok_jax/_torch_moe.py) timed in a subprocess.

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
           "--repeats", str(repeats)]
    for shape in shapes:
        cmd += ["--shape", ",".join(str(v) for v in (shape.tokens, shape.top_k, shape.experts,
                                                      shape.hidden, shape.ffn))]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              check=False)
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except Exception as err:  # pylint: disable=broad-except
        result = {"records": [], "error": _error_string(err)}
    by_key = {(tuple(r["shape"]), r["impl"], r["pass"]): r for r in result["records"]}
    records = []
    for shape in shapes:
        key_shape = (shape.tokens, shape.top_k, shape.experts, shape.hidden, shape.ffn)
        for pass_name in passes:
            for impl in TORCH_IMPLS:
                got = by_key.get((key_shape, impl, pass_name), {})
                record = new_record(shape, impl, pass_name, dtype_name="bf16",
                                    warmup=warmup, repeats=repeats)
                record["torch_version"] = result.get("torch_version")
                if got.get("times_ms"):
                    finish_record(record, got["times_ms"], None)
                else:
                    record.update(status=got.get("status", "unavailable"),
                                  error=got.get("error", result.get("error")))
                records.append(record)
    return records


def is_ep_record(record: dict) -> bool:
    """Whether `record` is `moe` on an EP mesh of >= 2 devices (bench_ep)."""
    return (record.get("ep_size") or 1) > 1


# What the derived fields mean; written into the JSON (its "legend").
LEGEND = {
    "median_ms": "median of the timed runs (milliseconds), after compilation and "
                 "the warm-up runs",
    "tflops": "GEMM FLOPs only (fwd 6*T*K*H*F, fwdbwd 18*T*K*H*F) / median time; "
              "per device for EP records",
    "mok_speedup": "baseline median / moe median, same shape, pass and process "
                   "(> 1: moe is faster); single-device baselines only, absent from "
                   "EP records",
    "ep_time_ratio": "EP records only: EP=N median / the one-device moe median of the "
                     "same shape and pass (T tokens and the same GEMM FLOPs per "
                     "device, no communication). A time ratio, lower is better; 1.0 "
                     "is perfect weak scaling; not a speedup",
    "status": "ok; error (attempted and failed: see error); unavailable (not "
              "importable, or too few devices); skipped (not attempted: --skip, "
              "auto-skip or needs a GPU; error says why)",
}


def add_speedups(records: list[dict]) -> None:
    """Sets `mok_speedup` = baseline median / moe median on each measured
    single-device baseline, and on each EP record (no `mok_speedup` there)
    `ep_time_ratio` = EP median / the one-device moe median of the same shape and
    pass, with that median as `ep_reference_ms`."""
    mok_ms = {(r["shape"], r["pass"]): r["median_ms"] for r in records
              if r["impl"] == MOK and r["median_ms"]}
    for r in records:
        ref = mok_ms.get((r["shape"], r["pass"]))
        if is_ep_record(r):
            r.pop("mok_speedup", None)
            r["ep_reference_ms"] = ref
            r["ep_time_ratio"] = r["median_ms"] / ref if ref and r["median_ms"] else None
            continue
        r["mok_speedup"] = (r["median_ms"] / ref
                            if ref and r["median_ms"] and r["impl"] != MOK else None)


def ep_ratio_text(record: dict) -> str:
    """One EP record's comparison with one device, e.g.
    "EP=2 / 1 device: 1.90x (time ratio, lower is better)"."""
    ratio = record.get("ep_time_ratio")
    value = "-" if ratio is None else f"{ratio:.2f}x"
    text = f"EP={record['ep_size']} / 1 device: {value} (time ratio, lower is better)"
    if ratio is None:
        text += (": no one-device moe time to compare with" if record["median_ms"]
                 else f": EP run {record['status']}")
    return text


def format_table(records: list[dict]) -> str:
    """A text table: one row per record; errors shortened to one line.

    Single-device baselines get `mok speedup`; EP rows get `EP/1 device`, the time
    ratio to one device (lower is better), and an EP summary line each below.
    """
    checked = any(r.get("rel_err") for r in records)
    ep_records = [r for r in records if is_ep_record(r)]
    header = ("shape", "impl", "pass", "median ms", "min ms", "TFLOP/s", "mok speedup")
    header += ("EP/1 device",) if ep_records else ()
    header += ("max rel err",) if checked else ()
    rows = [header]
    notes: dict[str, list[str]] = {}   # one line per distinct failure, with where
    for r in records:
        if r["median_ms"] is None:
            first_line = ((r["error"] or "").splitlines() or [""])[0][:300]
            where = notes.setdefault(f"{r['impl']}: {r['status']}: {first_line}", [])
            where.append(f"{r['shape']}/{r['pass']}")
            rows.append((r["shape"], r["impl"], r["pass"], r["status"])
                        + ("-",) * (len(header) - 4))
            continue
        speedup = r.get("mok_speedup")
        tflops = r["tflops"]
        row = (r["shape"], r["impl"], r["pass"], f"{r['median_ms']:.3f}",
               f"{r['min_ms']:.3f}",
               f"{tflops:.1f}" if tflops >= 1 else f"{tflops:.4f}",
               "-" if speedup is None else f"{speedup:.2f}x")
        if ep_records:
            ratio = r.get("ep_time_ratio")
            row += ("-" if ratio is None else f"{ratio:.2f}x",)
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
    if ep_records:
        text += ("\nEP/1 device: EP=N median / the one-device moe median of the same shape "
                 "and pass (both T tokens per device, the same GEMM FLOPs per device; "
                 "one device does no communication). A time ratio: lower is better, "
                 "1.00x is perfect weak scaling. TFLOP/s of EP rows are per device.")
    if checked:
        text += ("\nmax rel err: the largest relative Frobenius error over y and the "
                 "gradients, against the reference (in parentheses: which output).")
    for note, where in notes.items():
        text += f"\n{note}  [{', '.join(where)}]"
    if ep_records:
        text += "\n\nEP against one device:"
        for r in ep_records:
            text += f"\n  {r['shape']} {r['pass']}: {ep_ratio_text(r)}"
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
# (small-experts, deepseek-slice, ep; docs/perf.md); mixtral-like (4 GB) compiled.
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


def help_epilog() -> str:
    """The end of --help: every shape with its dimensions, every pipeline, pass and
    exchange with what it is, and how to read the numbers (made from the tables
    above, so it cannot go stale)."""
    width = max(len(n) for n in (*IMPLS, *EXTRA_IMPLS, *TORCH_IMPLS, *EXCHANGES))
    lines = ["shapes (--shapes; T tokens per device, top-K of E experts, hidden H,",
             "expert FFN F; rows per expert T*K/E):"]
    for name, full in FULL_SHAPES.items():
        quick = QUICK_SHAPES[name]
        lines.append(f"  {name}: {SHAPE_ABOUT.get(name, '')}")
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
    lines += _entry("moe_epN", "moe on a mesh of N devices (experts and tokens sharded, T "
                    "tokens per device); reported as a time ratio to one device", width)
    lines.append("--exchange adds, with --ep N, the EP dispatch exchange alone (GB/s):")
    for name in EXCHANGES:
        lines += _entry(name, EXCHANGE_ABOUT[name], width)
    lines.append("passes (--passes; default both):")
    for name in PASSES:
        lines += _entry(name, PASS_ABOUT[name], width)
    lines += [
        "",
        "method: each pass is jitted and compiled, run --warmup times untimed, then timed",
        "  --repeats times (each run blocked on); records report the median. Routing is",
        "  made outside the timed function. TFLOP/s count GEMM FLOPs only (fwd",
        "  6*T*K*H*F, fwdbwd 18*T*K*H*F) for every pipeline alike. All baselines run in",
        "  the same process as moe (torch: a subprocess just before).",
        "reading the results:",
        "  mok speedup   baseline median / moe median, same shape and pass (> 1: moe is",
        "                faster); single-device rows only",
        "  EP/1 device   EP=N median / the one-device moe median of the same shape and",
        "                pass, the compute-only time of one device doing one rank's work",
        "                (same T and GEMM FLOPs per device, no communication); a time",
        "                ratio, lower is better, 1.00x is perfect weak scaling",
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
                        help="comma list of bench shapes (default: all of them, or none "
                             "when --shape is given)")
    parser.add_argument("--shape", type=custom_shape, action="append", default=[],
                        metavar="[NAME=]T,K,E,H,F",
                        help="a custom problem (repeatable): T tokens, top-K of E experts, "
                             "hidden H, expert FFN F, five positive integers, K <= E; "
                             "replaces the default shape list (see below)")
    parser.add_argument("--impls", type=_csv(IMPLS + EXTRA_IMPLS, "impl"),
                        default=list(IMPLS), help="comma list of pipelines (see below)")
    parser.add_argument("--passes", type=_csv(PASSES, "pass"), default=list(PASSES),
                        help="fwd and/or fwdbwd")
    parser.add_argument("--repeats", type=int, default=20,
                        help="timed runs per measurement (median of these; default 20)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed runs after compilation (default 3)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true",
                        help="also compare each pipeline's outputs (and gradients) "
                             "with the dense reference; costs memory and time")
    parser.add_argument("--verbose", action="store_true",
                        help="print the traceback of each failing pipeline")
    parser.add_argument("--torch", action="store_true",
                        help="also time PyTorch baselines (torch._grouped_mm pipeline and "
                             "GEMMs alone) in a subprocess; bf16 only; needs torch with "
                             "CUDA (skipped, with the reason, on CPU)")
    parser.add_argument("--ep", type=_int_list, default=[], metavar="N[,N...]",
                        help="also time moe on a mesh of N devices (experts and tokens "
                             "sharded; T tokens per device: weak scaling) for each of "
                             "--ep-shapes; a comma list times each size, e.g. 2,4,8. "
                             "Needs N devices, moe in --impls, and E divisible by N")
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
    if args.repeats < 1 or args.warmup < 0:
        fail("--repeats must be >= 1 and --warmup >= 0")
    names = [shape.name for shape in args.shape]
    twice = _dedupe(n for n in names if names.count(n) > 1)
    if twice:
        fail(f"--shape {','.join(twice)} given twice (name them apart with NAME=T,K,E,H,F)")
    if args.shapes is None:
        args.shapes = [] if args.shape else list(FULL_SHAPES)
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

    for entry in args.skip:  # a typo would silently run what it meant to skip
        parts = entry.split("/")
        if (len(parts) not in (2, 3) or parts[0] not in IMPLS + EXTRA_IMPLS
                or parts[1] not in PASSES
                or (len(parts) == 3 and parts[2] not in (*FULL_SHAPES, *names))):
            fail(f"--skip entry {entry!r} is not IMPL/PASS[/SHAPE] with IMPL in "
                 f"{IMPLS + EXTRA_IMPLS}, PASS in {PASSES}, SHAPE in "
                 f"{(*FULL_SHAPES, *names)}")
        why = []
        if parts[0] not in args.impls:
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
                     f"({','.join(selected)}); EP rows are compared with the one-device moe "
                     "record of the same shape, so add them to --shapes (or --shape)")
        if MOK not in args.impls:
            fail(f"--ep compares moe on N devices with the one-device moe record of the same "
                 f"shape, and --impls ({','.join(args.impls)}) has no moe; add moe to --impls")
        for name in args.ep_shapes:
            for pass_name in args.passes:
                if skipped(args.skip, MOK, pass_name, name):
                    fail(f"--skip removes moe/{pass_name} on {name}, the one-device record "
                         f"its EP rows are compared with")
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
                            *(EXCHANGES if args.exchange else ()))
                if platform_skip(n, backend)]
    for name in gpu_only:
        print(f"note: {name} is not attempted on {backend} (recorded as skipped): "
              f"{platform_skip(name, backend)}", file=sys.stderr)
    pre_records = []
    if args.torch:  # before JAX initialises the GPU and reserves its memory
        pre_records = torch_records(shapes, args.passes, warmup=args.warmup,
                                    repeats=args.repeats, backend=backend)
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
                else:
                    record = bench_one(shape, impl, pass_name, inputs,
                                       dtype_name=args.dtype, warmup=args.warmup,
                                       repeats=args.repeats, reference=reference,
                                       verbose=args.verbose)
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
                record = bench_ep(shape, ep_size, pass_name, dtype=DTYPES[args.dtype],
                                  dtype_name=args.dtype, seed=args.seed, warmup=args.warmup,
                                  repeats=args.repeats, verbose=args.verbose)
                records.append(record)
                _print_progress(record)
                save(records + pre_records)
        del inputs
        exchange_sizes = [n for n in args.ep if n > 1] if args.exchange else []
        for ep_size, kind in ((n, k) for n in exchange_sizes for k in EXCHANGES):
            if shape.name in args.ep_shapes:
                xrec = bench_exchange(shape, ep_size, kind, dtype=DTYPES[args.dtype],
                                      warmup=args.warmup, repeats=args.repeats)
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
    print(f"\n{len(records)} measurements in {time.perf_counter() - start:.1f} s")
    result = save(records)
    if args.json:
        print(f"wrote {args.json}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
