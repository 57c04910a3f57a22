"""`--torch`: the PyTorch baselines (the eager pipeline and the grouped GEMMs
alone), timed by `_torch_moe.py` in a subprocess before JAX takes the GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence

from mok_jax.bench.measure import error_string, finish_record, new_record
from mok_jax.bench.pipelines import platform_skip, skipped
from mok_jax.bench.shapes import Shape


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
                  queue: int = 0, kernels: int = 0, seed: int = 0) -> list[dict]:
    """PyTorch baselines (_torch_moe.py beside this file) timed in a subprocess; the
    measurements `skip` names (--skip entries: shapes by name) are recorded as
    skipped, not run.
    The subprocess draws its routing and inputs from `seed` (the bench's --seed)
    with torch's generators: the same problem sizes and kind of routing as the JAX
    pipelines' draw from that seed, not the same numbers.
    kernels > 0: each measured record also holds the kernels of that many traced
    calls (`kernel_ms`, `kernels`: _torch_moe.kernel_table's rows).

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
           "--repeats", str(repeats), "--queue", str(queue), "--kernels", str(kernels),
           "--seed", str(seed)]
    # Shapes go by name, there and back: two shapes of the same dimensions (a
    # --shape NAME=... beside a bench shape) are two problems, each its own records.
    for shape in shapes:
        dims = ",".join(str(v) for v in (shape.tokens, shape.top_k, shape.experts,
                                         shape.hidden, shape.ffn))
        cmd += ["--shape", f"{shape.name}={dims}"]
        cmd += [arg for impl in TORCH_IMPLS for pass_name in passes
                if skipped(skip, impl, pass_name, shape.name)
                for arg in ("--skip", f"{impl}/{pass_name}/{shape.name}")]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              check=False)
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except Exception as err:  # pylint: disable=broad-except
        result = {"records": [], "error": error_string(err)}
    by_key = {(r.get("name"), r["impl"], r["pass"]): r for r in result["records"]}
    records = []
    for shape in shapes:
        for pass_name in passes:
            for impl in TORCH_IMPLS:
                got = by_key.get((shape.name, impl, pass_name), {})
                record = new_record(shape, impl, pass_name, dtype_name="bf16",
                                    warmup=warmup, repeats=repeats)
                record["recipe"] = BASELINE_RECIPE.get(impl)
                record["torch_version"] = result.get("torch_version")
                if skipped(skip, impl, pass_name, shape.name):
                    record.update(status="skipped", error="named in --skip")
                elif got.get("times_ms"):
                    record["queue"] = queue
                    finish_record(record, got["times_ms"], None, got.get("queued_times_ms"))
                    if "kernels" in got:
                        record.update(kernel_ms=got["kernel_ms"], kernels=got["kernels"])
                else:
                    record.update(status=got.get("status", "unavailable"),
                                  error=got.get("error", result.get("error")))
                records.append(record)
    return records
