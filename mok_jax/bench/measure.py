"""One measurement: a pass of a pipeline jitted, compiled, warmed up and timed
(each run blocked on, and in queued batches), optionally checked against the
reference, as a record."""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from mok_jax.bench import baselines
from mok_jax.bench import pipelines
from mok_jax.bench.pipelines import (MOK_IMPLS, PERSISTENT_MODES, MoEFn, persistent_kernels,
                                     platform_skip, with_recipe)
from mok_jax.bench.shapes import Shape
from mok_jax.reference import moe_reference


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
    blocked runs of time_step also pay each call's round trip to the host.
    Each call's outputs are let go when the next is dispatched (freed once it
    has run), as a training loop lets them go: holding all of a batch's would
    need `queue` sets of weight gradients in memory at once."""
    times_ms = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = None
        for _ in range(queue):
            out = compiled(*args)
        jax.block_until_ready(out)
        times_ms.append((time.perf_counter() - start) * 1e3 / queue)
        del out
    return times_ms


OUTPUT_NAMES = {"fwd": ("y",),
                "fwdbwd": ("y", "dx", "dexpert_weights", "dw_gate_up", "dw_down")}


def reference_outputs(pass_name: str, inputs: dict
                      ) -> tuple[str, list[jax.Array] | None, str | None]:
    """(oracle name, its flat outputs for `pass_name`, error) for --check: the
    oracle is mok_jax.reference.moe_reference (every expert on every token)."""
    name = "mok_jax.reference.moe_reference"
    try:
        step, names = build_step(moe_reference, pass_name)
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
    fn, why = pipelines.resolve_impl(impl)
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
