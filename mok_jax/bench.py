"""`python -m mok_jax.bench`: `mok_jax.moe` side by side with pure-JAX baselines.

Method (DESIGN.md §4): bench shapes in bf16; each pipeline is jitted and timed on
the whole layer (dispatch and combine included, routing excluded: ids and weights
are made outside the timed function); the median of >= 20 timed runs after warm-up;
TFLOP/s from GEMM FLOPs only (forward 6*T*K*H*F, forward+backward 18*T*K*H*F,
credited alike to every pipeline, so the dense one-hot baseline's extra E/K work
counts as waste); every baseline measured in the same process.

Examples::

    python -m mok_jax.bench                                # all shapes, impls, passes
    python -m mok_jax.bench --quick --repeats 5            # scaled-down shapes (CPU)
    python -m mok_jax.bench --shapes ep --impls moe,tokamax --passes fwd --json out.json
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


# DESIGN.md §4. `ep` is the per-GPU work of the EP shape with all 128 experts local.
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

IMPLS = ("moe", "ragged_dot", "dense_onehot", "tokamax")
# Selectable, not run by default: mok_jax.moe forced onto its XLA-exchange path.
EXTRA_IMPLS = ("moe_xla",)
PASSES = ("fwd", "fwdbwd")
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
MOK = "moe"

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


def torch_records(shapes: Sequence[Shape], passes: Sequence[str], *, warmup: int,
                  repeats: int, timeout_s: float = 1800) -> list[dict]:
    """PyTorch baselines (mok_jax/_torch_moe.py) timed in a subprocess.

    Call this before JAX touches the GPU: JAX reserves most of its memory.
    Returns bench records (status "unavailable" when torch or CUDA is missing).
    """
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


def add_speedups(records: list[dict]) -> None:
    """Sets `mok_speedup` = baseline median / moe median on each measured baseline."""
    mok_ms = {(r["shape"], r["pass"]): r["median_ms"] for r in records
              if r["impl"] == MOK and r["median_ms"]}
    for r in records:
        ref = mok_ms.get((r["shape"], r["pass"]))
        r["mok_speedup"] = (r["median_ms"] / ref
                            if ref and r["median_ms"] and r["impl"] != MOK else None)


def format_table(records: list[dict]) -> str:
    """A text table: one row per record; errors shortened to one line."""
    checked = any(r.get("rel_err") for r in records)
    header = ("shape", "impl", "pass", "median ms", "min ms", "TFLOP/s", "mok speedup")
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
        speedup = "-" if r["mok_speedup"] is None else f"{r['mok_speedup']:.2f}x"
        tflops = r["tflops"]
        row = (r["shape"], r["impl"], r["pass"], f"{r['median_ms']:.3f}",
               f"{r['min_ms']:.3f}",
               f"{tflops:.1f}" if tflops >= 1 else f"{tflops:.4f}", speedup)
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
    text += ("\n\nmok speedup: baseline median / moe median, same process "
             "(> 1: moe is faster).")
    if checked:
        text += ("\nmax rel err: the largest relative Frobenius error over y and the "
                 "gradients, against the reference (in parentheses: which output).")
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


def _csv(choices: Sequence[str], what: str) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        bad = [item for item in items if item not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {bad or text!r}; choose from {','.join(choices)}")
        return items
    return parse


def _int_list(text: str) -> list[int]:
    try:
        sizes = [int(t) for t in text.split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from None
    if any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"EP sizes must be >= 1: {text!r}")
    return sizes


def _csv_free(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


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


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m mok_jax.bench",
        description="Time mok_jax.moe against pure-JAX MoE baselines (DESIGN.md §4).")
    parser.add_argument("--quick", action="store_true",
                        help="scaled-down shapes for CPU (a few minutes in all)")
    parser.add_argument("--full-on-cpu", action="store_true",
                        help="run the full shapes even on CPU (very slow)")
    parser.add_argument("--shapes", type=_csv(tuple(FULL_SHAPES), "shape"),
                        default=list(FULL_SHAPES), help="comma list of shapes")
    parser.add_argument("--impls", type=_csv(IMPLS + EXTRA_IMPLS, "impl"),
                        default=list(IMPLS), help="comma list of pipelines")
    parser.add_argument("--passes", type=_csv(PASSES, "pass"), default=list(PASSES),
                        help="fwd and/or fwdbwd")
    parser.add_argument("--repeats", type=int, default=20,
                        help="timed runs per measurement (median of these)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed runs after compilation")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true",
                        help="also compare each pipeline's outputs (and gradients) "
                             "with the dense reference; costs memory and time")
    parser.add_argument("--verbose", action="store_true",
                        help="print the traceback of each failing pipeline")
    parser.add_argument("--torch", action="store_true",
                        help="also time PyTorch baselines (torch._grouped_mm pipeline and "
                             "GEMMs alone) in a subprocess; needs torch with CUDA")
    parser.add_argument("--ep", type=_int_list, default=[], metavar="N[,N...]",
                        help="also time moe on a mesh of N devices (experts and tokens "
                             "sharded; T tokens per device: weak scaling) for each of "
                             "--ep-shapes; a comma list times each size, e.g. 2,4,8")
    parser.add_argument("--exchange", action="store_true",
                        help="with --ep N: also time the EP dispatch exchange alone "
                             "(all_to_all with ep.py's slots, exact all_to_all, "
                             "ragged_all_to_all) for each of --ep-shapes")
    parser.add_argument("--ep-shapes", type=_csv(tuple(FULL_SHAPES), "shape"),
                        default=["ep"], help="comma list of shapes timed with --ep and "
                                             "--exchange (default: ep, DESIGN §4's EP shape)")
    parser.add_argument("--skip", type=_csv_free, default=[], metavar="IMPL/PASS[/SHAPE]",
                        help="comma list of measurements not to attempt (recorded as "
                             "skipped), e.g. ragged_dot/fwdbwd/small-experts: a pipeline "
                             "XLA spends minutes failing to compile")
    parser.add_argument("--try-all", action="store_true",
                        help="attempt ragged_dot's backward on GPU even where its dense "
                             "weight gradient is known not to compile (see auto_skip)")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write machine info, argv and records here")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    if args.exchange and not any(n > 1 for n in args.ep):
        parser.error("--exchange needs --ep with a size >= 2")
    for entry in args.skip:  # a typo would silently run what it meant to skip
        parts = entry.split("/")
        if (len(parts) not in (2, 3) or parts[0] not in IMPLS + EXTRA_IMPLS
                or parts[1] not in PASSES or (len(parts) == 3 and parts[2] not in FULL_SHAPES)):
            parser.error(f"--skip entry {entry!r} is not IMPL/PASS[/SHAPE] with IMPL in "
                         f"{IMPLS + EXTRA_IMPLS}, PASS in {PASSES}, SHAPE in "
                         f"{tuple(FULL_SHAPES)}")
    return args


def _print_progress(record: dict) -> None:
    if record["median_ms"] is not None:
        done = f"{record['median_ms']:.3f} ms, {record['tflops']:.3g} TFLOP/s"
    else:  # the reason, shortened: a timeout may keep the JSON from being written
        done = f"{record['status']}: {str(record.get('error') or '')[:200]}"
    print(f"  {record['shape']} {record['impl']} {record['pass']}: {done}", file=sys.stderr,
          flush=True)


def main(argv: Sequence[str] | None = None) -> dict:
    """Runs the benchmark; prints the table; returns (and maybe writes) the results."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    pre_records = []
    if args.torch:  # before JAX initialises the GPU and reserves its memory
        torch_shapes = [(QUICK_SHAPES if args.quick else FULL_SHAPES)[n] for n in args.shapes]
        pre_records = torch_records(torch_shapes, args.passes, warmup=args.warmup,
                                    repeats=args.repeats)
        for record in pre_records:
            _print_progress(record)
    info = machine_info()
    quick = args.quick
    if info["backend"] == "cpu" and not quick and not args.full_on_cpu:
        print("note: full bench shapes on CPU take very long; running the --quick "
              "shapes (pass --full-on-cpu to run the full ones).", file=sys.stderr)
        quick = True
    shapes = QUICK_SHAPES if quick else FULL_SHAPES
    print(f"mok_jax.bench: {info['backend']} ({info['device_kind']}), jax "
          f"{info['jax_version']}, {args.dtype}, {'quick' if quick else 'full'} shapes, "
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
                         "shapes": args.shapes, "impls": args.impls,
                         "passes": args.passes, "ep": args.ep, "torch": args.torch,
                         "ep_shapes": args.ep_shapes, "exchange": args.exchange,
                         "skip": args.skip, "try_all": args.try_all},
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

    for shape_name in args.shapes:
        shape = shapes[shape_name]
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
                           else None if args.try_all
                           else auto_skip(shape, impl, pass_name, info["backend"]))
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
