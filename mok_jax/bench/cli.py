"""`python -m mok_jax.bench`'s command line: the flags, their checks before
anything runs, --help's tables, and the run itself (main)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from mok_jax.bench.exchanges import EXCHANGE_ABOUT, EXCHANGES, bench_exchange
from mok_jax.bench.expert_parallel import EP_BACKENDS, FUSED_EP, bench_compute_only, bench_ep
from mok_jax.bench.measure import bench_one, new_record, reference_outputs
from mok_jax.bench.pipelines import (DTYPES, EXTRA_IMPLS, GPU_ONLY, IMPL_ABOUT, IMPLS, MOK,
                                     MOK_IMPLS, PASS_ABOUT, PASSES,
                                     RAGGED_DOT_DENSE_WGRAD_LIMIT, RECIPES, auto_skip,
                                     platform_skip, skipped)
from mok_jax.bench.report import (LEGEND, add_speedups, format_exchanges, format_table,
                                  impl_label, is_ep_record, machine_info)
from mok_jax.bench.shapes import (DEFAULT_SHAPES, FULL_SHAPES, QUICK_SHAPES, SHAPE_ABOUT,
                                  Shape, custom_shape, make_inputs)
from mok_jax.bench.torch_baselines import TORCH_ABOUT, TORCH_IMPLS, torch_records


def _recipes(text: str) -> tuple[str, ...]:
    """--recipe's value: recipe names, comma-separated, each known, none twice."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in RECIPES]
    if not names or unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"--recipe takes distinct names of {', '.join(RECIPES)}, comma-separated; "
            f"got {text!r}")
    return names


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
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random inputs and routing: an integer in "
                             "[0, 2^63), each its own inputs (default 0); the --torch "
                             "baselines draw theirs from it too, with torch's generators")
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
                             "skipped), the torch baselines' too; SHAPE is a shape's name "
                             "(a bench shape's, or a --shape's NAME), without it every "
                             "shape: e.g. ragged_dot/fwdbwd/small-experts, a pipeline "
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
    if not 0 <= args.seed < 2**63:
        fail(f"--seed must be an integer in [0, 2^63), got {args.seed}")
    if "fp8" in args.recipe and args.dtype != "bf16":
        fail("--recipe fp8 takes bfloat16 inputs: use --dtype bf16")
    if args.recipe != ("native",) and not any(i in MOK_IMPLS for i in args.impls):
        fail(f"--recipe {','.join(args.recipe)} applies to mok_jax's pipelines "
             f"({','.join(MOK_IMPLS)}), and --impls ({','.join(args.impls)}) has none; "
             "the others run the native recipe only")
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
    if args.json is not None and not args.json.strip():
        fail("--json needs the path of a file, got an empty one")
    if args.json:  # checked now: the file is first written after the first measurement
        path = os.path.abspath(args.json)
        if os.path.isdir(path):
            fail(f"--json {args.json} is a directory; give the path of a file")
        parent = os.path.dirname(path)
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
            fail(f"--json {args.json} cannot be written: {parent} is not a writable directory")
        why = _cannot_write(path)
        if why:
            fail(f"--json {args.json} cannot be written: {why}")

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
    if args.ep_shapes is not None and not args.ep_shapes:
        fail("--ep-shapes names no shape: give one or more of this run's shapes, or drop it "
             "for the default (the ep bench shape and every --shape)")
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


def _cannot_write(path: str) -> str | None:
    """Why the file `path` (in an existing or creatable directory) cannot be opened for
    writing, or None. A missing file is created and removed, its missing directories
    created (as the first save would)."""
    existed = os.path.exists(path)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    if not existed:
        os.remove(path)
    return None


def input_bytes(shape: Shape, itemsize: int) -> int:
    """A lower bound on the memory the benchmark's inputs of `shape` take at once
    (x, dy and both weight stacks at `itemsize`, the routing's ids and weights); the
    measurements need more."""
    t, k, e, h, f = shape.tokens, shape.top_k, shape.experts, shape.hidden, shape.ffn
    return (2 * t * h + 3 * e * h * f) * itemsize + 8 * t * k


def _memory_bytes(backend: str, in_process: bool) -> int | None:
    """The memory of one device of `backend`: the host's on CPU; the GPU's as JAX
    reports it when it may start its GPU backend in this process (None otherwise, or
    where unknown)."""
    if backend == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    if not in_process:
        return None
    try:
        return int(jax.devices()[0].memory_stats()["bytes_limit"])
    except Exception:  # pylint: disable=broad-except
        return None


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
    memory = _memory_bytes(backend, in_process=not args.torch)
    itemsize = jnp.dtype(DTYPES[args.dtype]).itemsize
    for shape in shapes:
        need = input_bytes(shape, itemsize)
        if memory is not None and need > memory:
            fail(f"shape {shape.name} ({_dims(shape).strip()}) needs {need / 2**30:.1f} GiB "
                 f"for its {args.dtype} inputs alone, and this {backend} device has "
                 f"{memory / 2**30:.1f} GiB")
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
    print(f"  {record['shape']} {impl_label(record)} {record['pass']}: {done}",
          file=sys.stderr, flush=True)


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
                                    queue=args.queue, seed=args.seed)
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
            "settings": {"quick": quick if args.shapes else None, "check": args.check,
                         "dtype": args.dtype,
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
            # Written beside it, then renamed over it: a run stopped mid-write keeps
            # the previous file whole.
            partial = args.json + ".partial"
            with open(partial, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=1)
                f.write("\n")
            os.replace(partial, args.json)
        return result

    def why_not(shape: Shape, impl: str, pass_name: str) -> str | None:
        """Why this measurement is skipped, or None."""
        if skipped(args.skip, impl, pass_name, shape.name):
            return "named in --skip"
        return platform_skip(impl, backend) or (
            None if args.try_all else auto_skip(shape, impl, pass_name, backend))

    def unmeasured(shape: Shape, impl: str, pass_name: str, status: str, why: str) -> None:
        """Records (and prints) a measurement not made, with its status and reason."""
        record = new_record(shape, impl, pass_name, dtype_name=args.dtype,
                            warmup=args.warmup, repeats=args.repeats)
        record.update(status=status, error=why)
        records.append(record)
        _print_progress(record)

    for shape in shapes:
        try:
            inputs = make_inputs(shape, DTYPES[args.dtype], args.seed)
        except Exception as e:  # pylint: disable=broad-except
            # Out of memory, typically: this shape's measurements are errors (those not
            # skipped anyway), and the run goes on with the next shape.
            why = f"its inputs could not be made: {type(e).__name__}: {str(e)[:500]}"
            for pass_name in args.passes:
                for impl in args.impls:
                    skip = why_not(shape, impl, pass_name)
                    unmeasured(shape, impl, pass_name, "skipped" if skip else "error",
                               skip or why)
            save(records + pre_records)
            continue
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
                skip = why_not(shape, impl, pass_name)
                if skip:
                    unmeasured(shape, impl, pass_name, "skipped", skip)
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
