"""PyTorch baselines for `python -m mok_jax.bench --torch`, run as a separate script.

    python _torch_moe.py --shape [NAME=]T,K,E,H,F [--shape ...] --passes fwd,fwdbwd \
        --repeats 20 --warmup 3 --seed 0 [--skip IMPL/PASS/NAME] --json out.json

Run in its own process (before JAX takes the GPU's memory) and never imported by
mok_jax. For each shape it times, bf16 on one CUDA GPU:

* ``torch_pipeline``: the eager MoE layer a PyTorch user writes with
  ``torch._grouped_mm``: gather the routed rows in expert order (each expert's
  group padded to 16 rows, as the grouped GEMM requires), grouped GEMM gate/up,
  SwiGLU, grouped GEMM down, weighted ``index_add_`` combine. Routing (sorting
  the pairs, offsets) is done outside the timed region, as for mok_jax.
* ``torch_grouped_mm``: the two grouped GEMMs alone on pre-permuted rows (and
  their backward for fwdbwd): the GEMM time the whole layer is compared with.
* ``torch_scaled_grouped_mm``: the same two GEMMs in FP8 with
  ``torch._scaled_grouped_mm`` (e4m3 operands quantized beforehand, one f32 scale
  per row of each operand along K, outside the timed region): the FP8 GEMM time
  the fp8 recipe is compared with (forward; fwdbwd records what torch does with
  its backward).

The routing logits (CPU generator) and x, the weights and the cotangents (CUDA
generator) are drawn from ``--seed`` (the bench's; generator_seeds): torch's own
draw for that seed, not the numbers of the JAX pipelines' draw.

Prints one JSON document (and writes it to --json): {"records": [...]} with
name (the shape's), shape (its T, K, E, H, F), impl, pass, median_ms, min_ms,
times_ms, or status/error. A shape is known by its name, in --skip and in the
records, so two shapes of the same dimensions stay apart. With
``--kernels N`` each record also holds the CUDA kernels of N more calls traced
by ``torch.profiler``: ``kernel_ms`` (their time per call, summed) and
``kernels`` (each kernel name's ms and launches per call, most time first): the
counterpart of scripts/layer_kernels.py for the baselines.
"""

import argparse
import json
import statistics
import sys
import time

ALIGN_ROWS = 16
SEED_LIMIT = 2**63  # the bench's --seed range


def generator_seeds(seed):
    """(routing seed, data seed) of the bench's ``--seed``: the seeds of torch's CPU
    generator that draws the routing logits and of the CUDA generator that draws x,
    the weights and the cotangents. Distinct for every seed in [0, 2^63) and for the
    two roles, within torch's [0, 2^64); seed 0 gives 0 and 1."""
    return 2 * seed, 2 * seed + 1


def _routing(torch, T, K, E, H, F, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(generator_seeds(seed)[0])
    logits = torch.randn(T, E, generator=g)
    top, ids = torch.topk(logits, K, dim=1)
    weights = torch.softmax(top, dim=1)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + ALIGN_ROWS - 1) // ALIGN_ROWS * ALIGN_ROWS
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    rows = int(ends[-1])
    # Row r of the padded, expert-sorted buffer holds pair src_pair[r] (or padding).
    src_pair = torch.full((rows,), -1, dtype=torch.long)
    sorted_ids = flat[order]
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(flat.numel()) - first[sorted_ids]
    src_pair[starts[sorted_ids] + rank] = order
    valid = src_pair >= 0
    src_token = torch.where(valid, src_pair // K, torch.full_like(src_pair, T))  # T: zero row
    row_weight = torch.where(valid, weights.reshape(-1)[src_pair.clamp(min=0)], 0.0)
    to = lambda t: t.to(device)  # noqa: E731
    return (to(src_token), to(row_weight.to(torch.float32)), to(ends.to(torch.int32)),
            to(torch.where(valid, src_pair // K, 0)), rows)


def _time(torch, fn, warmup, repeats):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _time_queued(torch, fn, queue, repeats):
    """Per-call ms of `repeats` batches of `queue` calls, synchronized once per batch
    (bench.time_queued's method)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(queue):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3 / queue)
    return times


def kernel_table(events, calls):
    """(kernel ms per call, rows) from (name, device us) events of `calls` calls:
    rows {"name", "ms", "launches"} per kernel name, per call, most time first."""
    by_name = {}
    for name, us in events:
        entry = by_name.setdefault(name, [0.0, 0])
        entry[0] += us
        entry[1] += 1
    rows = [{"name": name, "ms": us / 1e3 / calls, "launches": n / calls}
            for name, (us, n) in by_name.items()]
    rows.sort(key=lambda r: -r["ms"])
    return sum(r["ms"] for r in rows), rows


def _trace_kernels(torch, fn, calls):
    """kernel_table of `calls` calls of fn under torch.profiler (CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile  # pylint: disable=import-outside-toplevel
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return kernel_table(((e.name, e.device_time) for e in prof.events()
                         if e.device_type == cuda), calls)


def bench_shape(torch, shape, passes, warmup, repeats, skip=frozenset(), queue=0, kernels=0,
                seed=0, name=None):
    """Records of every baseline and pass on `shape` (T, K, E, H, F), named `name`
    (default: the dimensions, comma-separated); (impl, pass) pairs in `skip` are
    recorded as skipped, not run. kernels > 0: each record also gets the
    kernel table of that many traced calls (kernel_ms, kernels). The routing and
    the inputs are drawn from `seed` (generator_seeds)."""
    T, K, E, H, F = shape
    name = name or ",".join(str(v) for v in shape)
    dev, bf16 = "cuda", torch.bfloat16
    src_token, row_weight, offs, row_token, rows = _routing(torch, T, K, E, H, F, dev, seed)
    g = torch.Generator(device=dev).manual_seed(generator_seeds(seed)[1])
    x = torch.randn(T, H, device=dev, generator=g).to(bf16)
    # Weights stored [E, N, K] and used transposed: the layout grouped_mm wants for B.
    w1 = (torch.randn(E, 2 * F, H, device=dev, generator=g) * H ** -0.5).to(bf16)
    w2 = (torch.randn(E, H, F, device=dev, generator=g) * F ** -0.5).to(bf16)
    dy = torch.randn(T, H, device=dev, generator=g).to(bf16)
    zero = torch.zeros(1, H, device=dev, dtype=bf16)

    def layer(x, w1, w2, row_weight):
        xs = torch.cat([x, zero])[src_token]                                  # permute
        gu = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs, out_dtype=bf16)
        h = (torch.nn.functional.silu(gu[:, :F].float()) * gu[:, F:].float()).to(bf16)
        o = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs, out_dtype=bf16)
        y = torch.zeros(T, H, device=dev, dtype=torch.float32)
        y.index_add_(0, row_token, o.float() * row_weight[:, None])           # combine
        return y.to(bf16)

    xs_fixed = torch.cat([x, zero])[src_token].contiguous()
    h_fixed = torch.randn(rows, F, device=dev, generator=g).to(bf16)

    def gemms(xs, h, w1, w2):
        gu = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs, out_dtype=bf16)
        o = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs, out_dtype=bf16)
        return gu, o

    def rowwise_fp8(t):
        """t [..., K] -> (e4m3 values, f32 scales [...]): amax / 448 per row."""
        scale = t.float().abs().amax(dim=-1).clamp(min=1e-12) / 448.0
        return (t.float() / scale[..., None]).to(torch.float8_e4m3fn), scale

    def scaled_gemms(xs, h, w1, w2):
        (xq, xsc), (hq, hsc) = rowwise_fp8(xs), rowwise_fp8(h)
        (w1q, w1s), (w2q, w2s) = rowwise_fp8(w1), rowwise_fp8(w2)
        # B as [E, K, N] column-major: the transpose of the [E, N, K] weights.
        return lambda: (
            torch._scaled_grouped_mm(xq, w1q.transpose(-2, -1), xsc, w1s, offs=offs,
                                     out_dtype=bf16),
            torch._scaled_grouped_mm(hq, w2q.transpose(-2, -1), hsc, w2s, offs=offs,
                                     out_dtype=bf16))

    records = []
    for pass_name in passes:
        for impl in ("torch_pipeline", "torch_grouped_mm", "torch_scaled_grouped_mm"):
            rec = {"name": name, "shape": list(shape), "impl": impl, "pass": pass_name,
                   "status": "ok", "error": None, "rows_padded": rows}
            if (impl, pass_name) in skip:
                rec.update(status="skipped", error="named in --skip")
                records.append(rec)
                continue
            try:
                if impl == "torch_pipeline" and pass_name == "fwd":
                    fn = lambda: layer(x, w1, w2, row_weight)  # noqa: E731
                elif impl == "torch_pipeline":
                    leaves = [t.detach().requires_grad_() for t in (x, w1, w2, row_weight)]

                    def fn(leaves=leaves):
                        y = layer(*leaves)
                        torch.autograd.grad(y, leaves, dy)
                elif impl == "torch_scaled_grouped_mm":
                    fwd = scaled_gemms(xs_fixed, h_fixed, w1, w2)
                    if pass_name == "fwd":
                        fn = fwd
                    else:
                        raise NotImplementedError(
                            "torch._scaled_grouped_mm is timed forward only: torch "
                            "offers no FP8 backward for it (the transposed operands "
                            "would need their own quantization)")
                elif pass_name == "fwd":
                    fn = lambda: gemms(xs_fixed, h_fixed, w1, w2)  # noqa: E731
                else:
                    leaves = [t.detach().requires_grad_() for t in (xs_fixed, h_fixed, w1, w2)]
                    dgu = torch.randn(rows, 2 * F, device=dev, generator=g).to(bf16)
                    do = torch.randn(rows, H, device=dev, generator=g).to(bf16)

                    def fn(leaves=leaves, dgu=dgu, do=do):
                        gu, o = gemms(*leaves)
                        torch.autograd.grad((gu, o), leaves, (dgu, do))
                with torch.no_grad() if pass_name == "fwd" else _null():
                    times = _time(torch, fn, warmup, repeats)
                    queued = _time_queued(torch, fn, queue, repeats) if queue else None
                    if kernels:
                        kernel_ms, table = _trace_kernels(torch, fn, kernels)
                        rec.update(kernel_ms=kernel_ms, kernels=table)
                rec.update(median_ms=statistics.median(times), min_ms=min(times),
                           times_ms=times, queued_times_ms=queued)
            except NotImplementedError as err:
                rec.update(status="unavailable", error=str(err))
            except Exception as err:  # pylint: disable=broad-except
                rec.update(status="error", error=f"{type(err).__name__}: {err}"[:2000])
            records.append(rec)
    return records


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _named_shape(text):
    """A --shape argument, [NAME=]T,K,E,H,F: (name, (T, K, E, H, F)); the default
    name is the dimensions as given."""
    name, _, dims = text.rpartition("=")
    try:
        shape = tuple(int(v) for v in dims.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 5:
        raise argparse.ArgumentTypeError(f"{text!r} is not [NAME=]T,K,E,H,F")
    return name or dims, shape


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", type=_named_shape, action="append", required=True,
                        metavar="[NAME=]T,K,E,H,F",
                        help="a shape and its name (repeatable; default name: T,K,E,H,F)")
    parser.add_argument("--passes", default="fwd,fwdbwd")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--queue", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the routing and the inputs, in [0, 2^63) (default 0)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--kernels", type=int, default=0, metavar="N",
                        help="also trace N calls of each and record their kernels")
    parser.add_argument("--skip", action="append", default=[], metavar="IMPL/PASS/NAME",
                        help="a measurement not to run, its shape by name (repeatable)")
    args = parser.parse_args(argv)
    if not 0 <= args.seed < SEED_LIMIT:
        parser.error(f"--seed must be an integer in [0, 2^63), got {args.seed}")
    names = [name for name, _ in args.shape]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        parser.error(f"--shape names {', '.join(twice)} more than once")
    skips = {}
    for entry in args.skip:
        parts = entry.split("/")
        if len(parts) != 3 or parts[2] not in names:
            parser.error(f"--skip {entry!r} is not IMPL/PASS/NAME with NAME a --shape's name "
                         f"({', '.join(names)})")
        skips.setdefault(parts[2], set()).add((parts[0], parts[1]))
    result = {"records": []}
    try:
        import torch  # pylint: disable=import-outside-toplevel
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device for torch")
        result["torch_version"] = torch.__version__
        for name, shape in args.shape:
            result["records"] += bench_shape(torch, shape, args.passes.split(","),
                                             args.warmup, args.repeats,
                                             frozenset(skips.get(name, ())), args.queue,
                                             args.kernels, args.seed, name)
    except Exception as err:  # pylint: disable=broad-except
        result["error"] = f"{type(err).__name__}: {err}"
    text = json.dumps(result)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
