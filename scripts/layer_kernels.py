"""Kernel times of one `mok_jax.moe` layer, forward and forward+backward, from a trace.

    python scripts/layer_kernels.py --shape preset=32768,4,32,1024,1024 [--dtype bf16]
    python scripts/layer_kernels.py --shapes small-experts --calls 10
    python scripts/layer_kernels.py --shapes small-experts --passes fwdbwd --torch

Each pass is jitted, run a few times, then traced over `--calls` calls with
``jax.profiler``. Printed per pass: the kernels' summed time per call, each
kernel's time and launches per call (kernels of one name added), and the launch
order of the last call (where a layer's time goes, kernel by kernel: such a list
singled out GEMM1's SwiGLU epilogue before cd66041; docs/ledger.md, 2026-12-01).
CUTLASS's GEMM kernels get short labels (schedule, SwiGLU epilogue, output type)
and a number; the legend at the end maps the numbers to the kernels' full names.
`--torch` adds the kernels of the bench's torch baselines (the eager layer and the
grouped GEMMs alone, `--calls` calls each, by `torch.profiler` in a subprocess run
first) after each pass: where each side's time goes, in one run.
On a CPU the runtime's thunks stand in for kernels: each of the layer's FFI calls
is one.

`--load-max L` routes like a training run whose router has not balanced yet: expert
0 gets L times the mean load (a share L*K/E of the tokens pick it; at most E/K,
every token), the other experts share the rest evenly; `--hot-expert N` makes
expert N the busy one instead (the weight-gradient GEMM deals its groups' tiles
longest group first; dealt in expert order, expert 0 would be one of the lucky
cases: docs/ledger.md, 2026-12-01, and scripts/wgrad_schedule_model.py). The
default is the bench's routing (top-K of random logits: about even). In the h200
preset's first hundred steps the busiest expert's load falls from E/K = 8 times
the mean to ~3.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import tempfile
import zlib

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import step_profile  # noqa: E402  (examples/step_profile.py: the trace reader)

import mok_jax  # noqa: E402
from mok_jax import bench  # noqa: E402

DTYPES = {"bf16": jax.numpy.bfloat16, "f32": jax.numpy.float32}


def label(kernel: str) -> str:
    """A short name: CUTLASS GEMMs by their traits and a stable number, others cut."""
    if "GemmUniversal" not in kernel:
        return kernel[:100]
    traits = [name for key, name in (("Pingpong", "ping-pong"), ("Cooperative", "cooperative"),
                                     ("Swiglu", "SwiGLU epilogue"))
              if key in kernel]
    return f"CUTLASS GEMM #{zlib.crc32(kernel.encode()) % 10000:04d} ({', '.join(traits)})"


def kernel_table(ops, calls: int) -> tuple[str, dict[str, str]]:
    """The per-pass text for `ops` (start_ns, end_ns, kernel, hlo_op, device) of
    `calls` calls, and the labels used ({label: full name})."""
    ops = sorted(ops)
    total = collections.Counter()
    launches = collections.Counter()
    names = {}
    for start, end, kernel, _, _ in ops:
        name = label(kernel)
        names[name] = kernel
        total[name] += (end - start) / 1e6 / calls
        launches[name] += 1
    whole = sum(total.values())
    lines = [f"kernels: {whole:.3f} ms per call ({len(ops) / calls:g} launches)",
             "| ms per call | share | launches per call | kernel |", "| --- | --- | --- | --- |"]
    for name, ms in total.most_common():
        lines.append(f"| {ms:.3f} | {ms / whole:.1%} | {launches[name] / calls:g} | {name} |")
    per_call = len(ops) // calls
    lines.append(f"launch order of the last call ({per_call} launches):")
    for start, end, kernel, op, _ in ops[len(ops) - per_call:]:
        lines.append(f"{(end - start) / 1e3:10.1f} us  {op[:28]:28s} {label(kernel)}")
    return "\n".join(lines), names


def profile_pass(inputs: dict, pass_name: str, *, calls: int, warmup: int, trace_dir: str,
                 recipe: str = "native"):
    """Trace `calls` calls of one pass of `mok_jax.moe` (with `recipe`) on `inputs`
    (bench.make_inputs' names); the trace's ops."""
    step, arg_names = bench.build_step(functools.partial(mok_jax.moe, recipe=recipe),
                                       pass_name)
    args = [inputs[n] for n in arg_names]
    for _ in range(warmup):
        jax.block_until_ready(step(*args))
    jax.profiler.start_trace(trace_dir)
    for _ in range(calls):
        jax.block_until_ready(step(*args))
    jax.profiler.stop_trace()
    return step_profile.device_ops(trace_dir, module="")


def torch_table(record: dict) -> str:
    """The text for one torch baseline record of bench.torch_records(..., kernels=N)."""
    impl = record["impl"]
    if "kernels" not in record:
        return f"{impl}: {record['status']} ({record.get('error')})"
    rows = record["kernels"]
    lines = [f"{impl}: kernels {record['kernel_ms']:.3f} ms per call "
             f"({sum(r['launches'] for r in rows):g} launches)",
             "| ms per call | launches per call | kernel |", "| --- | --- | --- |"]
    lines += [f"| {r['ms']:.3f} | {r['launches']:g} | {label(r['name'])} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", type=bench.custom_shape, default=[],
                        help="[NAME=]T,K,E,H,F (repeatable)")
    parser.add_argument("--shapes", type=lambda s: [x for x in s.split(",") if x], default=[],
                        help=f"bench shapes by name: {', '.join(bench.FULL_SHAPES)}")
    parser.add_argument("--passes", default="fwd,fwdbwd", help="fwd, fwdbwd or both")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--recipe", choices=bench.RECIPES, default="native",
                        help="mok_jax.moe's recipe (fp8: bf16 only)")
    parser.add_argument("--calls", type=int, default=5, help="traced calls per pass")
    parser.add_argument("--warmup", type=int, default=3, help="untraced calls first")
    parser.add_argument("--load-max", type=float, default=None,
                        help="expert 0's load as a multiple of the mean (at most E/K); "
                             "default: the bench's routing, about even")
    parser.add_argument("--hot-expert", type=int, default=0, metavar="N",
                        help="with --load-max: expert N takes that load instead of expert 0")
    parser.add_argument("--persistent", choices=("OFF", "AUTO", "ALWAYS"), default="AUTO",
                        help="when each pass runs as its persistent kernel: never (the "
                             "kernel chains), where mok_jax picks it (default: at few "
                             "rows per expert), or wherever it can")
    parser.add_argument("--torch", action="store_true",
                        help="also the kernels of the bench's torch baselines (the eager "
                             "layer and the grouped GEMMs alone, bf16, the bench's routing; "
                             "a GPU), traced as many calls in a subprocess first")
    args = parser.parse_args(argv)
    unknown = [s for s in args.shapes if s not in bench.FULL_SHAPES]
    if unknown:
        parser.error(f"unknown bench shape(s) {unknown}: pick from {list(bench.FULL_SHAPES)}")
    passes = [p for p in args.passes.split(",") if p]
    if not passes or any(p not in ("fwd", "fwdbwd") for p in passes):
        parser.error(f"--passes {args.passes!r}: fwd, fwdbwd or both")
    if args.hot_expert and args.load_max is None:
        parser.error("--hot-expert picks the busy expert of --load-max: give --load-max too")
    if args.calls < 1 or args.warmup < 1:
        parser.error("--calls and --warmup must be at least 1 (the first call compiles)")
    shapes = args.shape + [bench.FULL_SHAPES[s] for s in args.shapes]
    if not shapes:
        parser.error("give --shape T,K,E,H,F or --shapes NAME[,NAME]")
    if args.recipe == "fp8" and args.dtype != "bf16":
        parser.error("--recipe fp8 takes bfloat16 inputs: use --dtype bf16")
    if args.torch and (args.dtype != "bf16" or args.load_max is not None
                       or args.recipe != "native"):
        parser.error("--torch: the baselines run bf16, the native recipe and the bench's routing")
    baselines = collections.defaultdict(list)
    if args.torch:  # before JAX initialises the GPU and reserves its memory
        backend, _ = bench.cli.detect_platform(isolated=True)
        for record in bench.torch_baselines.torch_records(shapes, passes, warmup=args.warmup,
                                                          repeats=1, backend=backend,
                                                          kernels=args.calls):
            baselines[(record["shape"], record["pass"])].append(record)
    legend = {}
    skewed = {}  # routing per shape with --load-max, made (and refused) before any run
    if args.load_max is not None:
        for shape in shapes:
            try:
                skewed[shape.name] = bench.skewed_expert_ids(shape, args.load_max,
                                                             hot=args.hot_expert)
            except ValueError as err:
                parser.error(f"{shape.name}: {err}")
    for shape in shapes:
        inputs = bench.make_inputs(shape, DTYPES[args.dtype])
        if shape.name in skewed:
            inputs["expert_ids"] = jax.numpy.asarray(skewed[shape.name])
        for pass_name in passes:
            with tempfile.TemporaryDirectory() as trace_dir, \
                    bench.persistent_kernels(args.persistent):
                ops = profile_pass(inputs, pass_name, calls=args.calls, warmup=args.warmup,
                                   trace_dir=trace_dir, recipe=args.recipe)
            text, names = kernel_table(ops, args.calls)
            legend.update(names)
            routing = ("" if args.load_max is None
                       else f", expert {args.hot_expert} at {args.load_max:g}x the mean")
            print(f"## {shape.name} (T {shape.tokens}, K {shape.top_k}, E {shape.experts}, "
                  f"H {shape.hidden}, F {shape.ffn}){routing}, {args.dtype}, recipe "
                  f"{args.recipe}, persistent kernels {args.persistent}, {pass_name} on "
                  f"{jax.devices()[0].device_kind}\n{text}\n", flush=True)
            for record in baselines.get((shape.name, pass_name), ()):
                print(f"### {shape.name}, {pass_name}: torch {record.get('torch_version')}, "
                      f"{torch_table(record)}\n", flush=True)
    for name, kernel in legend.items():
        if name != kernel:
            print(f"{name} = {kernel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
