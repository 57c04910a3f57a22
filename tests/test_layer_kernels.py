"""scripts/layer_kernels.py: a layer's kernels from a trace, per pass (on a CPU the
runtime's thunks stand in for kernels: each of the layer's FFI calls is one)."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import script_env

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "layer_kernels.py")
sys.path.insert(0, os.path.dirname(SCRIPT))

import layer_kernels  # noqa: E402


def _run(*argv):
    env = script_env()
    proc = subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True,
                          timeout=600, env=env, check=False)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow
def test_both_passes_list_the_layers_calls_in_order():
    code, out = _run("--shape", "tiny=64,2,4,32,16", "--calls", "2", "--warmup", "1")
    assert code == 0, out[-3000:]
    fwd, fwdbwd = out.split("## tiny")[1:]
    assert ", fwd on " in fwd and ", fwdbwd on " in fwdbwd
    if "on cpu" in fwd:  # one thunk per FFI call: the forward, then the backward
        assert re.search(r"\| 100\.0% \| 1 \| mok_moe_fwd", fwd), fwd
        lines = fwdbwd.split("launch order of the last call (2 launches):")[1].split("\n")
        ops = [line.split()[2].split(".")[0] for line in lines if " us " in line]
        assert ops == ["mok_moe_fwd", "mok_moe_bwd"], fwdbwd
    shares = [float(s) for s in re.findall(r"\| [\d.]+ \| ([\d.]+)% \|", fwdbwd)]
    assert abs(sum(shares) - 100.0) < 0.5, shares


@pytest.mark.slow  # subprocesses that each import jax
def test_bad_arguments_are_refused_by_name():
    code, out = _run("--shapes", "nope")
    assert code == 2 and "unknown bench shape" in out
    code, out = _run("--shape", "tiny=64,2,4,32,16", "--passes", "bwd")
    assert code == 2 and "--passes" in out
    code, out = _run("--shape", "tiny=64,2,4,32,16", "--recipe", "fp8", "--dtype", "f32")
    assert code == 2 and "--recipe fp8 takes bfloat16 inputs" in out


def test_cutlass_kernels_get_short_stable_labels():
    coop = "void cutlass::device_kernel<GemmUniversal<...KernelPtrArrayTmaWarpSpecializedCooperative" \
           "...SwigluEpilogue>>(Params)"
    pp = coop.replace("Cooperative", "Pingpong").replace("SwigluEpilogue", "Sm90Epilogue")
    a, b = layer_kernels.label(coop), layer_kernels.label(pp)
    assert a.startswith("CUTLASS GEMM #") and a.endswith("(cooperative, SwiGLU epilogue)")
    assert b.endswith("(ping-pong)") and a.split()[2] != b.split()[2]
    assert layer_kernels.label(coop) == a  # the number depends on the name only
    assert layer_kernels.label("gather_rows_kernel<bf16, 8>") == "gather_rows_kernel<bf16, 8>"


def test_torch_baselines_print_their_kernels_or_why_not():
    gemm = "void cutlass::device_kernel<GemmUniversal<...Cooperative...>>(Params)"
    record = {"impl": "torch_grouped_mm", "status": "ok", "kernel_ms": 0.5,
              "kernels": [{"name": gemm, "ms": 0.45, "launches": 6.0},
                          {"name": "prepare_grouped_gemm_data", "ms": 0.05, "launches": 6.0}]}
    lines = layer_kernels.torch_table(record).split("\n")
    assert lines[0] == "torch_grouped_mm: kernels 0.500 ms per call (12 launches)"
    assert lines[3] == f"| 0.450 | 6 | {layer_kernels.label(gemm)} |"
    assert lines[4] == "| 0.050 | 6 | prepare_grouped_gemm_data |"
    skipped = {"impl": "torch_pipeline", "status": "skipped", "error": "needs a GPU"}
    assert layer_kernels.torch_table(skipped) == "torch_pipeline: skipped (needs a GPU)"
    code, out = _run("--shape", "tiny=64,2,4,32,16", "--torch", "--dtype", "f32")
    assert code == 2 and "--torch" in out


@pytest.mark.slow
def test_load_max_gives_expert_0_that_multiple_of_the_mean_load():
    from mok_jax import bench
    shape = bench.Shape("s", 20000, 4, 32, 8, 8)
    for load in (1.0, 3.0, 8.0):
        ids = bench.skewed_expert_ids(shape, load)
        assert ids.shape == (20000, 4) and ids.dtype == np.int32
        assert all(len(set(row)) == 4 for row in ids[:500])  # K distinct experts a token
        counts = np.bincount(ids.ravel(), minlength=32)
        mean = ids.size / 32
        assert abs(counts[0] / mean - load) < 0.1, (load, counts[0] / mean)
        others = counts[1:] / mean
        assert others.max() - others.min() < 0.25  # the rest about even
    # Another busy expert: the same routing with experts 0 and 17 trading places.
    base, hot = bench.skewed_expert_ids(shape, 3.0), bench.skewed_expert_ids(shape, 3.0, hot=17)
    np.testing.assert_array_equal(hot, np.where(base == 0, 17, np.where(base == 17, 0, base)))
    assert np.bincount(hot.ravel(), minlength=32).argmax() == 17
    with pytest.raises(ValueError, match="between 0 and E - 1 = 31"):
        bench.skewed_expert_ids(shape, 3.0, hot=32)
    try:
        bench.skewed_expert_ids(shape, 9.0)  # more than E/K: not every token can pick it
    except ValueError as err:
        assert "between 0 and E/K = 8" in str(err)
    else:
        raise AssertionError("--load-max past E/K accepted")
    code, out = _run("--shape", "tiny=64,2,4,32,16", "--load-max", "3", "--calls", "1",
                     "--passes", "fwd")
    assert code == 2 and "between 0 and E/K = 2" in out
    code, out = _run("--shape", "tiny=64,2,4,32,16", "--load-max", "1.5", "--calls", "1",
                     "--warmup", "1", "--passes", "fwd")
    assert code == 0 and "expert 0 at 1.5x the mean" in out, out[-2000:]


def test_wgrad_schedule_model_puts_two_long_tiles_on_one_cta_only_in_expert_order():
    """scripts/wgrad_schedule_model.py (the case for ordering the groups longest first, as the weight-gradient GEMM does):
    with one busy expert, expert order loses for most busy experts (17 here: both
    problems' long tiles meet on some CTAs) but not for expert 0; longest first
    never loses and is the same schedule as expert order when the loads tie."""
    import wgrad_schedule_model as model
    tiles = model.tiles_per_expert(1024, 1024)
    assert tiles == (64, 32)
    even = np.full(32, 4096)
    assert model.makespan(even, tiles, 132, "expert") == model.makespan(even, tiles, 132,
                                                                        "longest")
    for hot in range(32):
        rows = model.one_busy(32768, 4, 32, 8.0, hot)
        assert rows[hot] == 8 * 4096 and rows.sum() <= 32768 * 4
        expert, longest = (model.makespan(rows, tiles, 132, o) for o in ("expert", "longest"))
        assert longest <= expert + 1e-12
        if hot == 0:
            assert expert == pytest.approx(longest)
        elif hot == 17:  # its dW_down tiles land on CTAs that hold its dW_gate_up tiles
            assert expert > 1.2 * longest
    table = model.main(["--samples", "3"])
    assert set(table) >= {"even", "expert 0 at 8x", "expert 17 at 8x"}
