"""Where a training step's time goes: device time by part of the model.

`examples/train_moe_lm.py --profile DIR` traces a few steps with
``jax.profiler`` and calls `breakdown`: every GPU kernel in the trace is
attributed to the HLO instruction that launched it, that instruction to the JAX
name scope it came from (``metadata={op_name=...}`` of the compiled step), and
the scope to a part of the model (on a CPU, the runtime's thunks stand in for
kernels):

    mok_jax -> MoE layer (dispatch, expert GEMMs, combine)   router -> routing + aux losses
    attention -> attention (QKV, scores, output projection)  norm -> RMSNorms
    residual -> the blocks' residual adds
    embed_and_loss -> embedding, unembedding, cross-entropy  optimizer -> optax update
    collectives -> all-reduce / all-to-all / ... not inside a part above

What no kernel covers (host work, launch gaps, synchronisation) is the host gap:
the steps' wall time minus the time at least one kernel was running.
"""

from __future__ import annotations

import glob
import os
import re

PARTS = (  # (label, name-scope keyword), the first match wins
    ("MoE layer (mok_jax)", "mok_jax"),
    ("router + aux losses", "router"),
    ("attention", "attention"),
    ("norms", "norm"),
    ("residual adds", "residual"),
    ("embedding + loss", "embed_and_loss"),
    ("optimizer", "optimizer"),
)
_COLLECTIVE = re.compile(r"all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute|"
                         r"nccl", re.IGNORECASE)
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=")
_OP_NAME = re.compile(r"op_name=\"([^\"]*)\"")
_CALLS = re.compile(r"calls=%?([^\s,)}]+)")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
TOP_KERNELS = 60  # kernels listed in a breakdown's "top_kernels"
TOP_GAPS = 20  # (before, after) pairs listed in a breakdown's "gaps"
PER_LAYER = {"MoE layer (mok_jax)", "router + aux losses", "attention", "norms",
             "residual adds"}


def op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> the op_name (JAX name stack) in its metadata.

    A fusion whose own line has no metadata (XLA:CPU's YNNPACK fusions, for
    one) takes the op_name of the computation it calls: that of its ROOT
    instruction, or else the most common among the computation's
    instructions."""
    out, calls = {}, {}
    computation, comp_names, comp_root = None, {}, {}
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            computation = head.group(1)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name = m.group(1)
        op = _OP_NAME.search(line)
        if op:
            out[name] = op.group(1)
            if computation is not None:
                comp_names.setdefault(computation, []).append(op.group(1))
                if line.lstrip().startswith("ROOT"):
                    comp_root[computation] = op.group(1)
        else:
            called = _CALLS.search(line)
            if called:
                calls[name] = called.group(1)
    for name, comp in calls.items():
        if comp in comp_root:
            out[name] = comp_root[comp]
        elif comp_names.get(comp):
            seen = comp_names[comp]
            out[name] = max(seen, key=seen.count)
    return out


def part_of(hlo_op: str, op_name: str, kernel: str) -> str:
    text = op_name or ""
    for label, key in PARTS:
        if key in text:
            return label
    if _COLLECTIVE.search(hlo_op) or _COLLECTIVE.search(kernel):
        return "collectives"
    return "other"


def _stat(event, *names):
    stats = dict(event.stats)
    for n in names:
        if n in stats:
            return str(stats[n])
    return ""


def device_ops(trace_dir: str, module: str = "train_step"):
    """(start_ns, end_ns, event name, hlo_op, device) of every operation of the HLO
    module whose name contains `module`, in the newest trace under `trace_dir`: GPU
    kernels on the GPU planes' stream lines (device: the plane, one per GPU), or,
    without a GPU, the CPU runtime's thunks (device: the host plane; CPU devices
    share it, so a multi-device CPU trace counts as one device)."""
    from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel

    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}")
    data = ProfileData.from_file(max(paths, key=os.path.getmtime))
    gpu, cpu = [], []
    for plane in data.planes:
        on_gpu = plane.name.startswith("/device:GPU")
        for line in plane.lines:
            if on_gpu and not line.name.lower().startswith("stream"):
                continue  # derived lines (XLA Modules/Ops) repeat the kernels
            for ev in line.events:
                stats = dict(ev.stats)
                hlo_op = str(stats.get("hlo_op", ""))
                if not hlo_op or module not in str(stats.get("hlo_module", "")):
                    continue
                start = float(ev.start_ns)
                (gpu if on_gpu else cpu).append(
                    (start, start + float(ev.duration_ns), ev.name, hlo_op, plane.name))
    return gpu or cpu


def busy_ns(intervals) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def idle_gaps(kernels, names: dict[str, str], devices) -> dict:
    """``{(before, after): [ns, count, longest ns]}`` over every interval in which a
    device runs none of `kernels` between its first and last: ``before`` is the
    kernel that ended last before the interval, ``after`` the one that ends it,
    each as "part: HLO op"."""
    def label(kernel, hlo_op):
        op = hlo_op.split(":")[0].strip().lstrip("%")
        return f"{part_of(op, names.get(op, ''), kernel)}: {op}"

    out: dict[tuple[str, str], list[float]] = {}
    for dev in devices:
        ops = sorted((k for k in kernels if k[4] == dev), key=lambda k: k[0])
        last = None  # the kernel that ends last among those started so far
        for op in ops:
            if last is not None and op[0] > last[1]:
                entry = out.setdefault((label(last[2], last[3]), label(op[2], op[3])),
                                       [0.0, 0, 0.0])
                entry[0] += op[0] - last[1]
                entry[1] += 1
                entry[2] = max(entry[2], op[0] - last[1])
            if last is None or op[1] > last[1]:
                last = op
    return out


def breakdown(trace_dir: str, hlo_text: str, *, steps: int, wall_s: float,
              n_layers: int) -> dict:
    """Per-step milliseconds by part (kernel time), the host gap, and per layer."""
    return aggregate(device_ops(trace_dir), op_names(hlo_text), steps=steps, wall_s=wall_s,
                     n_layers=n_layers)


def aggregate(kernels, names: dict[str, str], *, steps: int, wall_s: float,
              n_layers: int) -> dict:
    """`breakdown` of `device_ops`-style tuples: times are per step and per device
    (a data-parallel step's parts are each GPU's, not the sum over GPUs), the busy
    time is the mean over devices of the union of each device's kernels. Each row
    also lists its milliseconds on every device (`ms_per_step_by_device`, in the
    order of `device_names`): the mean hides an imbalance between devices, such as
    an expert-parallel step whose GPUs got different loads."""
    devices = sorted({k[4] for k in kernels},  # GPU:2 before GPU:10
                     key=lambda d: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", d)]
                     ) or [""]
    index = {dev: i for i, dev in enumerate(devices)}
    per_part: dict[str, list[float]] = {}
    per_kernel: dict[tuple[str, str], list[float]] = {}  # (part, kernel) -> [ns, launches]
    unmatched, sample = 0, {}
    for start, end, kernel, hlo_op, dev in kernels:
        op = hlo_op.split(":")[0].strip().lstrip("%")
        if op not in names:
            unmatched += 1
            if len(sample) < 12:
                sample.setdefault(op, kernel[:120])
        label = part_of(op, names.get(op, ""), kernel)
        per_part.setdefault(label, [0.0] * len(devices))[index[dev]] += end - start
        entry = per_kernel.setdefault((label, kernel), [0.0, 0])
        entry[0] += end - start
        entry[1] += 1
    busy_by_device = [busy_ns([(s, e) for s, e, _, _, d in kernels if d == dev]) / 1e6 / steps
                      for dev in devices]
    gaps = idle_gaps(kernels, names, devices)
    busy = sum(busy_by_device) / len(devices)
    step_ms = 1e3 * wall_s / steps
    rows = []
    for label, by_device in sorted(per_part.items(), key=lambda kv: -sum(kv[1])):
        by_device = [ns / 1e6 / steps for ns in by_device]
        ms = sum(by_device) / len(devices)
        rows.append({"part": label, "ms_per_step": ms, "share": ms / step_ms,
                     "ms_per_layer": ms / n_layers if label in PER_LAYER else None,
                     "ms_per_step_by_device": by_device})
    gap_by_device = [max(step_ms - b, 0.0) for b in busy_by_device]
    gap_ms = sum(gap_by_device) / len(devices)
    rows.append({"part": "host gap (no kernel running)", "ms_per_step": gap_ms,
                 "share": gap_ms / step_ms, "ms_per_layer": None,
                 "ms_per_step_by_device": gap_by_device})
    return {"steps": steps, "step_ms": step_ms, "busy_ms_per_step": busy,
            "busy_ms_per_step_by_device": busy_by_device, "device_names": devices,
            "devices": len(devices), "kernels": len(kernels), "kernels_without_op_name": unmatched,
            "unmatched_hlo_ops": sample, "rows": rows,
            # The kernels that take the most time, by part (per step and per device):
            # what a part's row is made of.
            "top_kernels": [
                {"part": label, "kernel": kernel,
                 "ms_per_step": ns / 1e6 / steps / len(devices),
                 "launches_per_step": launches / steps / len(devices)}
                for (label, kernel), (ns, launches)
                in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]],
            # Every gap together: idle between each device's first and last kernel
            # (the host gap without the time before and after the traced kernels).
            "idle_ms_per_step": sum(ns for ns, _, _ in gaps.values()) / 1e6 / steps / len(devices),
            # Where the device idles between two of the traced kernels, by the
            # kernels on either side (per step and per device): the host gap's
            # share inside the traced steps (the rest is before the first kernel
            # and after the last).
            "gaps": [
                {"before": before, "after": after, "ms_per_step": ns / 1e6 / steps / len(devices),
                 "gaps_per_step": count / steps / len(devices),
                 "longest_us": longest / 1e3}
                for (before, after), (ns, count, longest)
                in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:TOP_GAPS]],
            "note": "kernel times of overlapping streams add up, so parts can sum past the "
                    "busy time"}


def table(result: dict) -> str:
    """Markdown: one row per part; with several devices, a last column gives the
    fewest and most milliseconds any one device spent in the part."""
    several = result["devices"] > 1
    lines = [f"step {result['step_ms']:.1f} ms (device busy {result['busy_ms_per_step']:.1f} ms), "
             f"{result['kernels']} device ops over {result['steps']} steps and "
             f"{result['devices']} device(s); ms per device"
             + (" (the mean; the last column: min-max over devices)" if several else ""),
             "| part | ms / step | share of step | ms / layer |" + (" min-max |" if several else ""),
             "| --- | --- | --- | --- |" + (" --- |" if several else "")]
    for r in result["rows"]:
        layer = "" if r["ms_per_layer"] is None else f"{r['ms_per_layer']:.2f}"
        line = f"| {r['part']} | {r['ms_per_step']:.2f} | {100 * r['share']:.1f}% | {layer} |"
        if several:
            by_device = r["ms_per_step_by_device"]
            line += f" {min(by_device):.2f}-{max(by_device):.2f} |"
        lines.append(line)
    return "\n".join(lines)


def top_table(result: dict, n: int = 25) -> str:
    """Markdown: the `n` kernels that take the most time (`top_kernels`)."""
    lines = ["| part | kernel | ms / step | launches / step |", "| --- | --- | --- | --- |"]
    for k in result["top_kernels"][:n]:
        lines.append(f"| {k['part']} | {_short(k['kernel'])} | {k['ms_per_step']:.3f} | "
                     f"{k['launches_per_step']:g} |")
    return "\n".join(lines)


def gap_table(result: dict, n: int = 12) -> str:
    """Markdown: the `n` kinds of idle interval that take the most time (`gaps`)."""
    lines = [f"idle between kernels: {result.get('idle_ms_per_step', 0.0):.2f} ms a step; "
             "the longest by the kernels around them:",
             "| idle after | before | ms / step | gaps / step | longest us |",
             "| --- | --- | --- | --- | --- |"]
    for g in result.get("gaps", [])[:n]:
        lines.append(f"| {_short(g['before'])} | {_short(g['after'])} | {g['ms_per_step']:.3f} | "
                     f"{g['gaps_per_step']:g} | {g['longest_us']:.1f} |")
    return "\n".join(lines)


def _short(name: str, head: int = 60, tail: int = 40) -> str:
    """A kernel name cut to its head and tail: template instances (CUTLASS's
    mangled names share hundreds of leading characters) differ at the end."""
    return name if len(name) <= head + tail + 3 else f"{name[:head]}...{name[-tail:]}"
