"""The results: speedups and EP time ratios derived from the records, the text
tables, the JSON legend and the machine a run was on."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess

import jax

from mok_jax.bench.expert_parallel import compute_only_impl
from mok_jax.bench.pipelines import MOK


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
    "recipe_speedup_queued": "as recipe_speedup, from queued_ms (the table's queued "
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
    moe median of the same recipe (`one_device_ms`); on each moe record of another
    recipe `recipe_speedup` = the native moe's median / its median, and
    `recipe_speedup_queued` the same from queued_ms."""
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
            native_queued = mok_queued.get((r["shape"], r["pass"], "native"))
            r["mok_speedup"] = r["mok_speedup_queued"] = None
            r["recipe_speedup"] = (native / r["median_ms"]
                                   if native and r["median_ms"] else None)
            r["recipe_speedup_queued"] = (native_queued / r["queued_ms"]
                                          if native_queued and r.get("queued_ms") else None)
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
            if q_speedup is None:
                q_speedup = r.get("recipe_speedup_queued")
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
            text += f"\n  {r['shape']} {r['pass']} {impl_label(r)}: {ep_ratio_text(r)}"
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
