"""Tests for mok_jax.bench.baselines (against oracles) and mok_jax.bench (CLI, JSON, table)."""

import dataclasses
import json
import os
import subprocess
import sys
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, assert_usage_error, make_problem
import mok_jax
from mok_jax import bench
from mok_jax.bench import baselines
from mok_jax.reference import moe_reference

# The directory this process imported mok_jax from: site-packages after
# `pip install .`, the source tree in an in-place development build. The
# subprocess must import the same package, and not a source tree without _mok.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(mok_jax.__file__)))
PIPELINES = [baselines.ragged_dot_moe, baselines.dense_onehot_moe]


def _problem(t=40, k=3, e=6, h=32, f=16, dtype=jnp.float32, seed=0):
    """A small random layer as keyword arguments (top-k routing, softmax weights)."""
    names = ("x", "expert_ids", "expert_weights", "w_gate_up", "w_down")
    return dict(zip(names, make_problem(seed, t, k, e, h, f, dtype)))


def _float64_moe(x, expert_ids, expert_weights, w_gate_up, w_down):
    """Independent NumPy float64 oracle of the MoE semantics (invalid ids give 0)."""
    x, wgu, wd, w = (np.asarray(a, np.float64)
                     for a in (x, w_gate_up, w_down, expert_weights))
    ids = np.asarray(expert_ids)
    e, f, _ = wd.shape
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            expert = int(ids[t, k])
            if not 0 <= expert < e:
                continue
            gate_up = x[t] @ wgu[expert]
            gate, up = gate_up[:f], gate_up[f:]
            y[t] += w[t, k] * ((gate / (1 + np.exp(-gate)) * up) @ wd[expert])
    return y


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda p: p.__name__)
def test_baseline_matches_float64_oracle(pipeline, dtype):
    args = _problem(dtype=dtype)
    y = jax.jit(pipeline)(**args)
    assert y.shape == args["x"].shape and y.dtype == dtype
    assert_close(y, _float64_moe(**args), dtype, what=pipeline.__name__)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda p: p.__name__)
def test_baseline_matches_moe_reference(pipeline, dtype):
    args = _problem(t=33, k=4, e=8, h=24, f=40, dtype=dtype, seed=1)
    expected = moe_reference(**args)
    assert_close(jax.jit(pipeline)(**args), expected, dtype, what=pipeline.__name__)


@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda p: p.__name__)
def test_baseline_gradients_match_dense_jax(pipeline):
    """Gradients w.r.t. x, weights, w_gate_up, w_down against a plain f32 dense layer."""
    args = _problem(t=24, k=2, e=5, h=16, f=8, seed=2)
    ids = args.pop("expert_ids")

    def dense(x, expert_weights, w_gate_up, w_down):
        f = w_down.shape[1]
        gate_up = jnp.einsum("th,ehf->tef", x, w_gate_up)
        hidden = jax.nn.silu(gate_up[..., :f]) * gate_up[..., f:]
        out = jnp.einsum("tef,efh->teh", hidden, w_down)
        picked = jnp.take_along_axis(out, ids[..., None], axis=1)
        return jnp.sum(picked * expert_weights[..., None], axis=1)

    dy = jnp.asarray(np.random.default_rng(3).standard_normal(args["x"].shape),
                     jnp.float32)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a) * dy)

    names = ("x", "expert_weights", "w_gate_up", "w_down")
    operands = [args[n] for n in names]
    got = jax.grad(loss(lambda x, w, gu, d: pipeline(x, ids, w, gu, d)),
                   argnums=(0, 1, 2, 3))(*operands)
    want = jax.grad(loss(dense), argnums=(0, 1, 2, 3))(*operands)
    for name, g, w in zip(names, got, want):
        assert_close(g, w, jnp.float32, what=f"d{name}")


@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda p: p.__name__)
def test_baseline_invalid_ids_contribute_zero(pipeline):
    args = _problem(t=10, k=2, e=4, h=8, f=4, seed=4)
    ids = np.asarray(args["expert_ids"]).copy()
    ids[0, 0], ids[3, 1], ids[7, 0] = -1, 4, 1 << 20
    args["expert_ids"] = jnp.asarray(ids)
    assert_close(jax.jit(pipeline)(**args), _float64_moe(**args), jnp.float32)


def test_tokamax_available_reports_reason():
    ok, why = baselines.tokamax_available()
    assert ok or why  # unavailable always says why (available may carry a note)
    record = bench.measure.bench_one(bench.QUICK_SHAPES["ep"], "tokamax", "fwd", {},
                                     dtype_name="bf16", warmup=0, repeats=1)
    if jax.default_backend() == "cpu":  # GPU-only: not attempted, whether installed or not
        assert record["status"] == "skipped" and "CUDA GPU" in record["error"]
    elif not ok:
        assert record["status"] == "unavailable" and "tokamax" in record["error"]
    else:
        assert record["status"] == "ok" and record["median_ms"] > 0, record


@pytest.mark.parametrize("impl", ["moe_chain", "moe_persistent"])
def test_persistent_rows_need_a_gpu_and_restore_the_mode(impl):
    record = bench.measure.bench_one(bench.QUICK_SHAPES["ep"], impl, "fwd", {}, dtype_name="bf16",
                                     warmup=0, repeats=1)
    if jax.default_backend() == "cpu":  # the switch is a CUDA kernel's: not attempted
        assert record["status"] == "skipped" and "CUDA GPU" in record["error"]
    else:
        assert record["status"] == "ok" and record["median_ms"] > 0, record
    from mok_jax import _mok
    if hasattr(_mok, "set_persistent_kernels"):  # the default mode is back
        assert _mok.set_persistent_kernels(_mok.PersistentMode.AUTO) == _mok.PersistentMode.AUTO


def test_virtual_rank_rows_are_gpu_measurements_of_both_passes():
    shape = bench.QUICK_SHAPES["ep"]
    for name, ranks in bench.pipelines.VIRTUAL_RANKS.items():
        assert name in bench.pipelines.EXTRA_IMPLS and name in bench.pipelines.IMPL_ABOUT
        fn, why = bench.pipelines.resolve_impl(name)
        assert why is None and fn.keywords == {"ranks": ranks}
        for pass_name in bench.pipelines.PASSES:
            assert bench.pipelines.auto_skip(shape, name, pass_name, "gpu") is None
            record = bench.measure.bench_one(shape, name, pass_name, {}, dtype_name="bf16",
                                             warmup=0, repeats=1)
            if jax.default_backend() == "cpu":
                assert record["status"] == "skipped" and "CUDA GPU" in record["error"]
            else:
                assert record["status"] == "ok" and record["median_ms"] > 0, record


def test_gemm_flops():
    shape = bench.FULL_SHAPES["small-experts"]
    assert shape.gemm_flops("fwd") == 6 * 16384 * 8 * 2048 * 768
    assert shape.gemm_flops("fwdbwd") == 18 * 16384 * 8 * 2048 * 768


def test_quick_shapes_cover_full_shapes():
    assert set(bench.QUICK_SHAPES) == set(bench.FULL_SHAPES)
    assert set(bench.DEFAULT_SHAPES) <= set(bench.FULL_SHAPES)
    for name, quick in bench.QUICK_SHAPES.items():
        assert quick.top_k == bench.FULL_SHAPES[name].top_k
        assert quick.top_k <= quick.experts
    # The fp8 recipe's CUDA kernels take H % 8 == 0 and F % 4 == 0 (16-byte result
    # rows): every bench shape must run under every recipe.
    for shape in (*bench.QUICK_SHAPES.values(), *bench.FULL_SHAPES.values()):
        assert shape.hidden % 8 == 0 and shape.ffn % 4 == 0, shape


def test_model_like_shapes_are_the_models_experts():
    """The named model-like shapes are the published models' expert dimensions
    (H, F, E, K), T tokens per device; not part of a run unless --shapes names them."""
    want = {"olmoe-like": (8, 64, 2048, 1024), "gpt-oss-like": (4, 128, 2880, 2880),
            "qwen3-like": (8, 128, 4096, 1536), "few-tokens": (8, 128, 2048, 768)}
    for name, (k, e, h, f) in want.items():
        s = bench.FULL_SHAPES[name]
        assert (s.top_k, s.experts, s.hidden, s.ffn) == (k, e, h, f), name
        assert name not in bench.DEFAULT_SHAPES
    assert bench.FULL_SHAPES["few-tokens"].tokens == 256
    args = bench.cli.parse_args(["--impls", "moe"])
    assert args.shapes == list(bench.DEFAULT_SHAPES)
    args = bench.cli.parse_args(["--shapes", "qwen3-like,few-tokens", "--impls", "moe"])
    assert [bench.FULL_SHAPES[n].tokens for n in args.shapes] == [16384, 256]
    assert "gpt-oss-like" in bench.cli.help_epilog()


def test_make_inputs_routing():
    shape = bench.QUICK_SHAPES["small-experts"]
    inputs = bench.make_inputs(shape, jnp.bfloat16)
    ids = np.asarray(inputs["expert_ids"])
    assert ids.shape == (shape.tokens, shape.top_k) and ids.dtype == np.int32
    assert ids.min() >= 0 and ids.max() < shape.experts
    assert all(len(set(row)) == shape.top_k for row in ids)   # top-k: distinct
    np.testing.assert_allclose(np.asarray(inputs["expert_weights"]).sum(-1), 1,
                               rtol=1e-5)
    assert inputs["x"].dtype == jnp.bfloat16


def test_seeds_2_to_the_32_apart_make_different_inputs():
    """--seed takes [0, 2^63), and jax.random.key keeps a seed's low 32 bits
    (jax_enable_x64 off): --seed 1 and --seed 2^32 + 1 timed the same inputs and
    routing. Each seed now has its own; one seed twice gives the same."""
    shape = bench.QUICK_SHAPES["small-experts"]
    make = lambda seed: {k: np.asarray(v)  # noqa: E731
                         for k, v in bench.make_inputs(shape, jnp.float32, seed).items()}
    first, again = make(1), make(1)
    for name in first:
        np.testing.assert_array_equal(first[name], again[name], name)
    for seed in (2**32 + 1, 2**63 - 1):
        other = make(seed)
        for name in first:
            assert not np.array_equal(first[name], other[name]), (seed, name)


@pytest.mark.slow
def test_quick_run_writes_json(tmp_path):
    path = tmp_path / "sub" / "bench.json"
    bench.main(["--quick", "--warmup", "0", "--repeats", "2", "--json", str(path)])
    result = json.loads(path.read_text())

    machine = result["machine"]
    for key in ("jax_version", "backend", "device_kind", "date_utc", "git_commit"):
        assert key in machine
    assert result["argv"] == ["--quick", "--warmup", "0", "--repeats", "2", "--json", str(path)]

    records = result["records"]
    keys = [(r["shape"], r["impl"], r["pass"]) for r in records]
    assert len(keys) == len(set(keys))
    assert set(keys) == {(s, i, p) for s in bench.DEFAULT_SHAPES for i in bench.pipelines.IMPLS
                         for p in bench.pipelines.PASSES}

    must_run = {"ragged_dot", "dense_onehot", bench.pipelines.MOK}
    backend = jax.default_backend()
    if baselines.tokamax_available()[0] and not bench.pipelines.platform_skip("tokamax", backend):
        must_run.add("tokamax")
    for r in records:
        if r["impl"] in must_run:
            assert r["status"] == "ok", r
            assert r["median_ms"] > 0 and r["min_ms"] > 0 and r["tflops"] > 0
            assert len(r["times_ms"]) == 2
        elif bench.pipelines.platform_skip(r["impl"], backend):
            assert r["status"] == "skipped" and "CUDA GPU" in r["error"], r
            assert r["median_ms"] is None
        else:
            assert r["status"] == "unavailable" and r["error"]
            assert r["median_ms"] is None
        mok = bench.pipelines.MOK
        if r["impl"] != mok and r["status"] == "ok" and mok in must_run:
            assert r["mok_speedup"] > 0


def test_cpu_without_quick_runs_quick_shapes(capsys):
    if jax.default_backend() != "cpu":
        pytest.skip("CPU-only default")
    result = bench.main(["--shapes", "ep", "--impls", "ragged_dot", "--passes", "fwd",
                         "--repeats", "1", "--warmup", "0"])
    assert result["settings"]["quick"]
    assert result["records"][0]["T"] == bench.QUICK_SHAPES["ep"].tokens
    assert "--full-on-cpu" in capsys.readouterr().err


@pytest.mark.slow
def test_module_entry_point(tmp_path):
    path = tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [PACKAGE_PARENT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run(
        [sys.executable, "-m", "mok_jax.bench", "--quick", "--shapes", "mixtral-like",
         "--impls", "ragged_dot,dense_onehot", "--passes", "fwd", "--repeats", "1",
         "--warmup", "0", "--dtype", "f32", "--json", str(path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        check=False)
    assert proc.returncode == 0, proc.stderr
    assert "mixtral-like" in proc.stdout
    records = json.loads(path.read_text())["records"]
    assert [(r["impl"], r["status"], r["dtype"]) for r in records] == [
        ("ragged_dot", "ok", "f32"), ("dense_onehot", "ok", "f32")]


def test_bad_arguments_exit(capsys):
    assert_usage_error(capsys, lambda: bench.cli.parse_args(["--impls", "cublas"]),
                "argument --impls: unknown impl ['cublas']")
    assert_usage_error(capsys, lambda: bench.cli.parse_args(["--shapes", "nope"]),
                "argument --shapes: unknown shape ['nope']")


def test_failing_pipeline_is_recorded(monkeypatch):
    def broken(*_):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory (simulated)")

    monkeypatch.setattr(bench.pipelines, "resolve_impl", lambda name: (broken, None))
    shape = bench.QUICK_SHAPES["ep"]
    record = bench.measure.bench_one(shape, "ragged_dot", "fwd",
                                     bench.make_inputs(shape, jnp.float32),
                                     dtype_name="f32", warmup=0, repeats=1)
    assert record["status"] == "error"
    assert "RESOURCE_EXHAUSTED" in record["error"] and record["median_ms"] is None


def test_table_and_speedups():
    def rec(impl, ms, status="ok"):
        return {"shape": "ep", "impl": impl, "pass": "fwd", "median_ms": ms,
                "min_ms": ms, "tflops": 1.0 if ms else None, "status": status,
                "error": None if ms else "boom\nmore"}

    records = [rec("moe", 2.0), rec("ragged_dot", 5.0), rec("tokamax", None, "error")]
    bench.report.add_speedups(records)
    assert records[0]["mok_speedup"] is None
    assert records[1]["mok_speedup"] == pytest.approx(2.5)
    assert records[2]["mok_speedup"] is None
    table = bench.report.format_table(records)
    assert "2.50x" in table and "tokamax: error: boom" in table


class FakeClock:
    """A `time` module whose perf_counter advances only when a call says so: the
    timing helpers' arithmetic, without the machine's load in it."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_time_queued_is_per_call_time_of_each_batch(monkeypatch):
    clock, calls = FakeClock(), []
    monkeypatch.setattr(bench.measure, "time", clock)

    def compiled(x):
        calls.append(1)
        clock.sleep(0.02)
        return x

    times = bench.measure.time_queued(compiled, [jnp.zeros(2)], queue=3, repeats=2)
    assert len(calls) == 6
    # A batch is three calls of 20 ms: 20 ms a call after dividing by three, not 60.
    assert times == pytest.approx([20.0, 20.0], rel=1e-9)


def test_time_queued_lets_each_calls_outputs_go():
    """At most the call in flight and the one before it hold outputs (at the ep
    shape a batch of five weight-gradient sets would not fit an 80 GB GPU)."""
    live = weakref.WeakSet()
    held = []

    class Out:
        pass

    def compiled(x):
        held.append(len(live))
        out = Out()
        live.add(out)
        return out

    bench.measure.time_queued(compiled, [jnp.zeros(2)], queue=5, repeats=2)
    assert len(held) == 10 and max(held) <= 1, held
    assert len(live) == 0


def test_torch_queued_timing_synchronizes_once_per_batch(monkeypatch):
    from mok_jax.bench import _torch_moe  # pylint: disable=import-outside-toplevel
    clock, events = FakeClock(), []
    monkeypatch.setattr(_torch_moe, "time", clock)

    class FakeTorch:
        class cuda:  # noqa: N801  (torch.cuda's spelling)
            @staticmethod
            def synchronize():
                events.append("sync")

    def fn():
        events.append("call")
        clock.sleep(0.02)

    times = _torch_moe._time_queued(FakeTorch, fn, 3, 2)
    assert events == ["call"] * 3 + ["sync"] + ["call"] * 3 + ["sync"]
    assert times == pytest.approx([20.0, 20.0], rel=1e-9)


def test_torch_kernel_table_sums_per_name_and_per_call():
    from mok_jax.bench import _torch_moe  # pylint: disable=import-outside-toplevel
    # Two calls: gemm launched twice a call (300 + 100 and 300 + 100 us), copy once.
    events = [("gemm", 300.0), ("gemm", 100.0), ("copy", 50.0),
              ("gemm", 300.0), ("gemm", 100.0), ("copy", 70.0)]
    total, rows = _torch_moe.kernel_table(events, calls=2)
    assert [r["name"] for r in rows] == ["gemm", "copy"]  # most time first
    assert [r["ms"] for r in rows] == pytest.approx([0.4, 0.06])
    assert [r["launches"] for r in rows] == [2.0, 1.0]
    assert total == pytest.approx(0.46)


def test_queue_adds_queued_times_and_their_speedups(capsys):
    result = bench.main(["--quick", "--shapes", "ep", "--impls", "ragged_dot,dense_onehot",
                         "--passes", "fwd", "--repeats", "2", "--warmup", "0",
                         "--queue", "2"])
    for r in result["records"]:
        assert r["status"] == "ok" and r["queue"] == 2, r
        assert len(r["queued_times_ms"]) == 2 and r["queued_ms"] > 0, r
    out = capsys.readouterr().out
    assert "queued ms" in out and "queued speedup" in out

    def rec(impl, ms, queued_ms):
        return {"shape": "ep", "impl": impl, "pass": "fwd", "median_ms": ms,
                "min_ms": ms, "tflops": 1.0, "status": "ok", "error": None,
                "queued_ms": queued_ms}

    records = [rec("moe", 2.0, 1.0), rec("ragged_dot", 5.0, 4.0), rec("dense_onehot", 6.0, None)]
    bench.report.add_speedups(records)
    assert records[1]["mok_speedup_queued"] == pytest.approx(4.0)
    assert records[0]["mok_speedup_queued"] is None
    assert records[2]["mok_speedup_queued"] is None
    lines = bench.report.format_table(records).splitlines()
    assert lines[0].split()[-4:] == ["queued", "ms", "queued", "speedup"]
    assert lines[3].split()[-2:] == ["4.000", "4.00x"] and lines[4].split()[-2:] == ["-", "-"]
    assert_usage_error(capsys, lambda: bench.cli.parse_args(["--queue", "-1"]),
                "--warmup and --queue >= 0")


def test_check_reports_relative_errors():
    result = bench.main(["--quick", "--shapes", "ep", "--impls", "ragged_dot,dense_onehot",
                         "--repeats", "1", "--warmup", "0", "--check", "--dtype", "f32"])
    for r in result["records"]:
        assert r["status"] == "ok" and r["check_error"] is None, r
        assert r["check_reference"] == "mok_jax.reference.moe_reference", r
        assert set(r["rel_err"]) == set(bench.measure.OUTPUT_NAMES[r["pass"]])
        assert max(r["rel_err"].values()) < 1e-5, r["rel_err"]


@pytest.fixture(scope="module")
def ep_run():
    """One --ep 1,2,4 --exchange run (quick ep shape, fwd), shared by the EP tests."""
    return bench.main(["--quick", "--shapes", "ep", "--impls", "moe", "--passes", "fwd",
                       "--repeats", "1", "--warmup", "0", "--dtype", "f32",
                       "--ep", "1,2,4", "--exchange"])


def _fused_expected_status(record):
    """The fused EP transport on this machine: skipped on CPU (the reason mentions
    the GPU), else measured, or unavailable/error with the reason."""
    if jax.default_backend() == "cpu":
        assert record["status"] == "skipped" and record["median_ms"] is None, record
        assert "GPU" in record["error"], record
    else:
        assert (record["status"] == "ok" and record["median_ms"] > 0) or (
            record["status"] in ("unavailable", "error") and record["error"]), record


@pytest.mark.slow
def test_ep_mode_times_moe_on_meshes_of_each_size(ep_run):
    result = ep_run
    by_impl = {r["impl"]: r for r in result["records"]}
    # EP=1 is the plain record; each EP size adds its compute-only reference and
    # one record per exchange backend.
    assert set(by_impl) == {"moe"} | {f"moe_{name}" for n in (2, 4) for name in (
        f"compute_ep{n}", f"ep{n}_xla", f"ep{n}_fused")}
    assert [r["impl"] for r in result["records"]] == [
        "moe", "moe_compute_ep2", "moe_ep2_xla", "moe_ep2_fused",
        "moe_compute_ep4", "moe_ep4_xla", "moe_ep4_fused"]
    for size in (2, 4):
        compute = by_impl[f"moe_compute_ep{size}"]
        assert compute["status"] == "ok", compute["error"]
        assert compute["mok_speedup"] is None and "ep_size" not in compute
        for backend in bench.expert_parallel.EP_BACKENDS:
            ep = by_impl[f"moe_ep{size}_{backend}"]
            assert ep["ep_size"] == size and ep["backend"] == backend
            assert ep["experts_per_device"] == bench.QUICK_SHAPES["ep"].experts // size
            # Same per-device work, so the same FLOPs are credited to all three.
            assert ep["gemm_flops"] == compute["gemm_flops"] == by_impl["moe"]["gemm_flops"]
            # A time ratio to the compute-only record, never a speedup.
            assert not [key for key in ep if "speedup" in key], ep
            assert ep["ep_reference"] == f"moe_compute_ep{size}"
            assert ep["ep_reference_ms"] == compute["median_ms"]
            assert ep["one_device_ms"] == by_impl["moe"]["median_ms"]
            if backend == "fused":
                _fused_expected_status(ep)
            else:
                assert ep["status"] == "ok", ep["error"]
            if ep["status"] == "ok":
                assert ep["median_ms"] > 0
                assert ep["ep_time_ratio"] == pytest.approx(
                    ep["median_ms"] / compute["median_ms"])
                assert ep["ep_time_ratio_all_experts"] == pytest.approx(
                    ep["median_ms"] / by_impl["moe"]["median_ms"])
            else:
                assert ep["ep_time_ratio"] is None
    exchanges = {(r["ep_size"], r["exchange"]): r for r in result["exchange"]}
    assert set(exchanges) == {(n, k) for n in (2, 4) for k in bench.exchanges.EXCHANGES}
    backend = jax.default_backend()
    for (n, kind), r in exchanges.items():
        assert r["bytes_per_device"] > 0 and "gb_per_s" in r, r
        why = bench.pipelines.platform_skip(kind, backend)
        if why:
            # No CPU lowering: not attempted, recorded as skipped with the reason.
            assert r["status"] == "skipped" and r["gb_per_s"] is None, r
            assert r["error"] == why and "GPU" in r["error"]
        elif kind in bench.exchanges.NVLINK_EXCHANGES:
            _fused_expected_status(r)
        else:
            assert r["status"] == "ok" and r["gb_per_s"] > 0, r
        if r["status"] == "ok":
            assert r["gb_per_s"] == pytest.approx(
                r["bytes_per_device"] / (r["median_ms"] * 1e-3) / 1e9)


@pytest.mark.slow
def test_compute_only_record_is_one_ranks_work_with_e_over_p_experts(ep_run):
    shape = bench.QUICK_SHAPES["ep"]   # T=64, K=8, E=32
    for size in (2, 4):
        (compute,) = [r for r in ep_run["records"] if r["impl"] == f"moe_compute_ep{size}"]
        assert (compute["T"], compute["K"], compute["E"], compute["H"], compute["F"]) == (
            shape.tokens, shape.top_k, shape.experts // size, shape.hidden, shape.ffn)
        assert compute["compute_only_for_ep"] == size
        assert compute["experts_global"] == shape.experts
        assert compute["shape"] == "ep" and compute["pass"] == "fwd"
    # K > E/P: K' = E/P picks of T*K/K' tokens keep the T*K rows (and GEMM FLOPs).
    local = bench.expert_parallel.compute_only_shape(shape, 8)
    assert (local.tokens, local.top_k, local.experts) == (128, 4, 4)
    assert local.gemm_flops("fwd") == shape.gemm_flops("fwd")
    assert bench.expert_parallel.compute_only_shape(bench.FULL_SHAPES["ep"], 8) == bench.Shape(
        "ep", 4096, 8, 16, 7168, 2048)


def test_fused_ep_is_skipped_on_cpu_and_unavailable_without_the_build(monkeypatch):
    status, why = bench.expert_parallel.fused_skip("cpu")
    assert status == "skipped" and "GPU" in why and "fused" in why
    monkeypatch.setattr(bench.expert_parallel, "fused_unavailable",
                        lambda: "Missing: mok_jax was built without its fused EP transport")
    assert bench.expert_parallel.fused_skip("gpu") == (
        "unavailable", "Missing: mok_jax was built without its fused EP transport")
    monkeypatch.setattr(bench.expert_parallel, "fused_unavailable", lambda: None)
    assert bench.expert_parallel.fused_skip("gpu") is None
    if jax.default_backend() == "cpu":
        record = bench.expert_parallel.bench_ep(bench.QUICK_SHAPES["ep"], 2, "fwd",
                                                dtype=jnp.float32, dtype_name="f32", seed=0,
                                                warmup=0, repeats=1, backend="fused")
        assert record["impl"] == "moe_ep2_fused" and record["status"] == "skipped"
        assert "GPU" in record["error"]


def test_nvlink_pull_bytes_on_a_hand_made_routing():
    # P=2 ranks, T=3 tokens each, K=2, E=4: experts 0,1 on rank 0, experts 2,3 on rank 1.
    ids = np.array([[0, 1],    # t0 (rank 0): rank 0 only                  -> nothing
                    [1, 2],    # t1 (rank 0): rank 0 and rank 1            -> rank 1 pulls 1
                    [3, 2],    # t2 (rank 0): rank 1 twice, pulled once    -> rank 1 pulls 1
                    [0, 3],    # t3 (rank 1): rank 0 and rank 1            -> rank 0 pulls 1
                    [2, 0],    # t4 (rank 1): rank 1 and rank 0            -> rank 0 pulls 1
                    [1, 0]],   # t5 (rank 1): rank 0 twice, pulled once    -> rank 0 pulls 1
                   np.int32)
    hidden, itemsize = 5, 2
    np.testing.assert_array_equal(bench.exchanges.nvlink_pull_rows(ids, 2, 4), [3, 2])
    np.testing.assert_array_equal(bench.exchanges.nvlink_pull_bytes(ids, 2, 4, hidden, itemsize),
                                  [3 * 5 * 2, 2 * 5 * 2])
    # Ids outside [0, E) move nothing: t1 loses its pick of rank 1.
    ids[1, 1] = -1
    np.testing.assert_array_equal(bench.exchanges.nvlink_pull_rows(ids, 2, 4), [3, 1])


def test_nvlink_pull_rows_match_the_transports_own_route():
    """The byte count helper counts the remote entries NvlinkTransport.route lists
    (its route runs on CPU; only the dispatch needs a GPU)."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    shape = bench.Shape("tiny", 16, 3, 8, 8, 8)
    for ep_size in (2, 4):
        ids = bench.make_routing(dataclasses.replace(shape, tokens=16 * ep_size), 3)[0]
        mesh, _ = bench.expert_parallel.ep_mesh(ep_size)
        sharded = NamedSharding(mesh, P("ep"))
        route = jax.jit(jax.shard_map(bench.exchanges.nvlink_fns(ep_size, shape.experts)["route"],
                                      mesh=mesh, in_specs=(P("ep"),), out_specs=P("ep")))(
            jax.device_put(ids, sharded))
        entries = np.asarray(route.entries).reshape(ep_size, -1)   # src * T + t, -1: none
        remote = [int(np.sum((e >= 0) & (e // shape.tokens != r)))
                  for r, e in enumerate(entries)]
        np.testing.assert_array_equal(
            bench.exchanges.nvlink_pull_rows(np.asarray(ids), ep_size, shape.experts), remote)


def test_nvlink_exchanges_trace_to_the_fused_dispatch():
    """Both nvlink exchange functions build the ep_dispatch_p program (lowering it
    needs a GPU): the rows of every rank's possible pairs, [P*T*K, H] per device."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    ep_size, shape = 2, bench.QUICK_SHAPES["ep"]
    global_shape = dataclasses.replace(shape, tokens=shape.tokens * ep_size)
    mesh, _ = bench.expert_parallel.ep_mesh(ep_size)
    sharded = NamedSharding(mesh, P("ep"))
    fns = bench.exchanges.nvlink_fns(ep_size, shape.experts)
    x = jax.device_put(bench.make_tokens(global_shape, jnp.bfloat16), sharded)
    ids = jax.device_put(bench.make_routing(global_shape)[0], sharded)
    route = jax.jit(jax.shard_map(fns["route"], mesh=mesh, in_specs=(P("ep"),),
                                  out_specs=P("ep")))(ids)
    for kind, args in (("nvlink_pull", (x, ids)), ("nvlink_pull_prerouted", (x, *route))):
        fn = jax.jit(jax.shard_map(fns[kind], mesh=mesh, in_specs=(P("ep"),) * len(args),
                                   out_specs=P("ep")))
        assert "mok_ep_dispatch" in str(jax.make_jaxpr(fn)(*args)), kind
        out = jax.eval_shape(fn, *args)
        assert out.shape == (ep_size * ep_size * shape.tokens * shape.top_k, shape.hidden)


def test_ep_sizes_must_be_positive_integers(capsys):
    for bad, message in (("0", "EP sizes must be >= 1: '0'"),
                         ("2,x", "not a comma list of integers: '2,x'"),
                         ("-2", "EP sizes must be >= 1: '-2'")):
        assert_usage_error(capsys, lambda bad=bad: bench.cli.parse_args(["--ep", bad]), message)


def test_torch_baselines_are_recorded_even_when_unavailable():
    # bf16: the torch baselines time bf16 only (--torch --dtype f32 is refused).
    result = bench.main(["--quick", "--shapes", "ep", "--impls", "moe", "--passes", "fwd",
                         "--repeats", "1", "--warmup", "0", "--torch"])
    torch_recs = [r for r in result["records"] if r["impl"].startswith("torch_")]
    assert {r["impl"] for r in torch_recs} == set(bench.torch_baselines.TORCH_IMPLS)
    for r in torch_recs:
        if jax.default_backend() == "cpu":  # GPU-only: not attempted, with the reason
            assert r["status"] == "skipped" and r["median_ms"] is None, r
            assert r["error"] == bench.pipelines.platform_skip(r["impl"], "cpu")
            continue
        # Either measured (torch with CUDA here) or marked unavailable with a reason.
        assert (r["status"] == "ok" and r["median_ms"] > 0) or (
            r["status"] in ("unavailable", "error") and r["error"])


def _exchange_expected(sent: np.ndarray, ep_size: int, slots: int) -> np.ndarray:
    """What device d receives: block p of its output is block d of device p's input."""
    blocks = sent.reshape(ep_size, ep_size, slots, -1)      # [sender, receiver, slot, H]
    return blocks.transpose(1, 0, 2, 3).reshape(ep_size * ep_size * slots, -1)


def _run_exchange(kind: str, ep_size: int, rows: int, hidden: int, devices):
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((ep_size,), ("ep",), devices=devices[:ep_size])
    local_rows = rows * ep_size if kind == "all_to_all_slots" else rows
    sent = np.arange(ep_size * local_rows * hidden, dtype=np.float32).reshape(-1, hidden)
    args = [jax.device_put(sent, NamedSharding(mesh, P("ep")))]
    specs = (P("ep"),)
    if kind == "ragged_all_to_all":
        args.append(jax.device_put(np.zeros((ep_size * rows, hidden), np.float32),
                                   NamedSharding(mesh, P("ep"))))
        specs += (P("ep"),)
    fn = jax.shard_map(bench.exchanges.exchange_fn(kind, ep_size, rows, hidden), mesh=mesh,
                       in_specs=specs, out_specs=P("ep"))
    return sent, np.asarray(jax.jit(fn)(*args))


@pytest.mark.parametrize("kind", ["all_to_all_slots", "all_to_all_exact"])
def test_exchange_moves_block_p_of_each_device_to_device_p(kind):
    ep_size, rows, hidden = 4, 12, 3
    sent, got = _run_exchange(kind, ep_size, rows, hidden, jax.devices())
    slots = rows if kind == "all_to_all_slots" else rows // ep_size
    np.testing.assert_array_equal(got, _exchange_expected(sent, ep_size, slots))


def test_an_exact_exchange_of_rows_that_do_not_split_is_unavailable():
    """all_to_all_exact's slots hold T*K / P rows: 3 rows over 2 devices is a clear
    'unavailable' record, not a reshape error."""
    if jax.device_count() < 2:
        pytest.skip("needs two devices (the CPU tests have eight host devices)")
    shape = bench.shapes.custom_shape("odd=3,1,2,8,8")
    record = bench.exchanges.bench_exchange(shape, 2, "all_to_all_exact", dtype=jnp.float32,
                                            warmup=0, repeats=1)
    assert record["status"] == "unavailable"
    assert "do not split evenly over P = 2" in record["error"]
    even = bench.exchanges.bench_exchange(bench.shapes.custom_shape("even=4,1,2,8,8"), 2,
                                          "all_to_all_exact", dtype=jnp.float32, warmup=0,
                                          repeats=1)
    assert even["status"] == "ok" and even["median_ms"] > 0


@pytest.mark.multigpu
def test_ragged_exchange_matches_exact_all_to_all_on_gpus():
    gpus = jax.devices("gpu")
    rows, hidden = 16, 8
    sent, got = _run_exchange("ragged_all_to_all", 2, rows, hidden, gpus)
    np.testing.assert_array_equal(got, _exchange_expected(sent, 2, rows // 2))


def test_auto_skip_spares_gpu_runs_ragged_dot_backwards_that_did_not_compile():
    # Measured on an H200 (docs/performance.md): ragged_dot's backward failed to compile on
    # these three full shapes and compiled on mixtral-like.
    for name in ("small-experts", "deepseek-slice", "ep"):
        why = bench.pipelines.auto_skip(bench.FULL_SHAPES[name], "ragged_dot", "fwdbwd", "gpu")
        assert why and "GiB" in why and "--try-all" in why
    assert bench.pipelines.auto_skip(bench.FULL_SHAPES["mixtral-like"], "ragged_dot", "fwdbwd",
                                     "gpu") is None
    for impl, pass_name, backend in (("ragged_dot", "fwd", "gpu"), ("moe", "fwdbwd", "gpu"),
                                     ("ragged_dot", "fwdbwd", "cpu")):
        assert bench.pipelines.auto_skip(bench.FULL_SHAPES["ep"], impl, pass_name, backend) is None


def test_bad_skip_entries_and_exchange_without_ep_are_refused(capsys):
    for entry in ("ragged/fwdbwd", "ragged_dot/bwd", "ragged_dot/fwdbwd/deepseek",
                  "ragged_dot"):
        assert_usage_error(capsys, lambda entry=entry: bench.cli.parse_args(["--skip", entry]),
                    f"--skip entry {entry!r} is not IMPL/PASS[/SHAPE]")
    for argv in (["--exchange"], ["--exchange", "--ep", "1"]):
        assert_usage_error(capsys, lambda argv=argv: bench.cli.parse_args(argv),
                    "--exchange needs --ep with a size >= 2")
    args = bench.cli.parse_args(["--skip", "ragged_dot/fwdbwd/deepseek-slice,tokamax/fwd",
                                 "--exchange", "--ep", "1,2"])
    assert args.skip == ["ragged_dot/fwdbwd/deepseek-slice", "tokamax/fwd"]
    assert args.ep == [1, 2] and args.exchange


def test_xprof_stub_does_not_outlive_the_tokamax_import():
    import sys
    baselines.tokamax_available()
    stub = sys.modules.get("xprof")
    # Either the real xprof, or nothing: the empty stub was removed after the import.
    assert stub is None or getattr(stub, "__file__", None) is not None


# --------------------------------------------------------------------------------------
# The command line refuses what would time nothing
# --------------------------------------------------------------------------------------


def test_custom_shape_replaces_the_shape_list_unless_shapes_is_given():
    args = bench.cli.parse_args(["--shape", "4096,8,64,2048,1024"])
    assert args.shapes == []
    assert args.shape == [bench.Shape("T4096-K8-E64-H2048-F1024", 4096, 8, 64, 2048, 1024)]
    args = bench.cli.parse_args(["--shape", "mine=16,2,4,8,8", "--shape", "7,1,1,3,5",
                                 "--shapes", "ep"])
    assert args.shapes == ["ep"]
    assert [s.name for s in args.shape] == ["mine", "T7-K1-E1-H3-F5"]
    assert bench.cli.run_shapes(args, True) == [bench.QUICK_SHAPES["ep"], *args.shape]
    # The default EP shapes: the ep bench shape and every custom one.
    assert bench.cli.parse_args(["--shape", "mine=16,2,4,8,8", "--shapes", "ep",
                                 "--ep", "2"]).ep_shapes == ["ep", "mine"]


def test_custom_shape_is_benchmarked(tmp_path):
    path = tmp_path / "custom.json"
    result = bench.main(["--shape", "mine=24,2,4,16,8", "--impls", "moe,ragged_dot",
                         "--passes", "fwd", "--repeats", "1", "--warmup", "0",
                         "--dtype", "f32", "--json", str(path)])
    records = json.loads(path.read_text())["records"]
    assert [(r["shape"], r["impl"]) for r in records] == [("mine", "moe"),
                                                          ("mine", "ragged_dot")]
    for r in records:
        assert (r["T"], r["K"], r["E"], r["H"], r["F"]) == (24, 2, 4, 16, 8)
        assert r["gemm_flops"] == 6 * 24 * 2 * 16 * 8
        assert r["status"] == "ok" and r["median_ms"] > 0, r
    assert result["settings"]["custom_shapes"] == [
        {"name": "mine", "tokens": 24, "top_k": 2, "experts": 4, "hidden": 16, "ffn": 8}]


def test_a_run_stopped_while_writing_its_json_keeps_the_last_full_one(tmp_path, monkeypatch):
    """The JSON is rewritten after every record so that a run cut short keeps what it
    measured: a stop in the middle of a rewrite must leave the previous file whole."""
    path = tmp_path / "cut.json"
    real_dump, dumps = json.dump, []

    class Stopped(BaseException):
        pass

    def dump_then_stop(obj, f, **kwargs):
        dumps.append(len(obj["records"]))
        if len(dumps) == 2:
            f.write('{"records": [')  # part of the second file, then the stop
            raise Stopped
        real_dump(obj, f, **kwargs)

    monkeypatch.setattr(bench.cli.json, "dump", dump_then_stop)
    with pytest.raises(Stopped):
        bench.main(["--shape", "mine=24,2,4,16,8", "--impls", "moe,ragged_dot",
                    "--passes", "fwd", "--repeats", "1", "--warmup", "0",
                    "--dtype", "f32", "--json", str(path)])
    monkeypatch.undo()
    records = json.loads(path.read_text())["records"]
    assert [(r["impl"], r["status"]) for r in records] == [("moe", "ok")]


@pytest.mark.parametrize("bad, why", [
    ("1,2,3,4", "five comma-separated"),
    ("1,2,3,4,5,6", "five comma-separated"),
    ("a,1,1,1,1", "must be integers"),
    ("0,1,1,1,1", "T=0"),
    ("8,1,1,-3,1", "H=-3"),
    ("4,8,4,4,4", "K <= E"),
    ("=4,1,4,4,4", "empty NAME"),
    ("a/b=4,1,4,4,4", "may not contain"),
    ("ep=4,1,4,4,4", "bench shape"),
])
def test_bad_custom_shape_is_a_clear_error(bad, why, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.cli.parse_args(["--shape", bad])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --shape" in err and why in err, err


def _ep_record(ms, size=2, backend="xla"):
    return {"shape": "ep", "impl": f"moe_ep{size}_{backend}", "pass": "fwd",
            "median_ms": ms, "min_ms": ms, "tflops": 1.0, "status": "ok", "error": None,
            "ep_size": size, "backend": backend, "E": 32}


def _compute_record(ms, size=2):
    return {"shape": "ep", "impl": f"moe_compute_ep{size}", "pass": "fwd",
            "median_ms": ms, "min_ms": ms, "tflops": 2.0, "status": "ok", "error": None,
            "compute_only_for_ep": size, "E": 32 // size, "experts_global": 32}


def test_ep_rows_are_time_ratios_to_compute_only_never_speedups():
    one = {"shape": "ep", "impl": "moe", "pass": "fwd", "median_ms": 0.5, "min_ms": 0.5,
           "tflops": 2.0, "status": "ok", "error": None}
    # EP=2 xla 1.9x slower than the compute-only time (the case that used to read
    # "speedup 1.90x"), EP=2 fused 1.5x; EP=4 failed.
    records = [one, _compute_record(1.0), _ep_record(1.9), _ep_record(1.5, backend="fused"),
               _compute_record(0.5, size=4), _ep_record(None, size=4)]
    records[-1].update(status="error", error="boom")
    bench.report.add_speedups(records)
    slow, fused = records[2], records[3]
    assert slow["ep_time_ratio"] == pytest.approx(1.9)
    assert slow["ep_reference_ms"] == 1.0 and slow["ep_reference"] == "moe_compute_ep2"
    assert slow["one_device_ms"] == 0.5
    assert slow["ep_time_ratio_all_experts"] == pytest.approx(1.9 / 0.5)
    assert fused["ep_time_ratio"] == pytest.approx(1.5)
    assert records[-1]["ep_time_ratio"] is None
    assert records[-1]["ep_reference_ms"] == 0.5  # its own size's compute-only record
    assert records[1]["mok_speedup"] is None  # compute-only: not a baseline of moe
    for r in records[2:4] + records[5:]:
        assert not [key for key in r if "speedup" in key], r
    text = bench.report.format_table(records)
    assert "1.90x" in text and "3.80x" in text and "1.50x" in text
    header = text.splitlines()[0].split("  ")
    header = [h.strip() for h in header if h.strip()]
    assert header[-1] == "EP/compute"
    rows = {tuple(line.split()[:2]): line.split() for line in text.splitlines()}
    row = rows[("ep", "moe_ep2_xla")]
    assert row[header.index("mok speedup")] == "-" and row[-1] == "1.90x"
    assert rows[("ep", "moe_compute_ep2")][-1] == "(ref)"
    for line in text.splitlines():
        if "moe_ep" in line or "EP=" in line:
            assert "speedup" not in line, line


def test_ep_summary_and_progress_lines_name_the_recipe(capsys):
    def moe(ms, recipe):
        return {"shape": "ep", "impl": "moe", "pass": "fwd", "median_ms": ms, "min_ms": ms,
                "tflops": 1.0, "status": "ok", "error": None, "recipe": recipe}

    records = [moe(0.5, "native"), moe(0.4, "fp8")]
    for recipe, compute_ms, ep_ms in (("native", 1.0, 1.9), ("fp8", 0.5, 1.5)):
        records += [dict(_compute_record(compute_ms), recipe=recipe),
                    dict(_ep_record(ep_ms), recipe=recipe)]
    bench.report.add_speedups(records)
    text = bench.report.format_table(records)
    summary = text.split("EP against compute-only")[1].splitlines()[1:]
    assert len(summary) == 2 and summary[0] != summary[1], summary
    (fp8_line,) = [line for line in summary if "compute-only: 3.00x" in line]
    assert "moe_ep2_xla [fp8]" in fp8_line, summary
    (native_line,) = [line for line in summary if "compute-only: 1.90x" in line]
    assert "[fp8]" not in native_line, summary
    for record in records[:2]:
        bench.cli._print_progress(record)
    progress = capsys.readouterr().err.splitlines()
    assert progress[0].startswith("  ep moe fwd:"), progress
    assert progress[1].startswith("  ep moe [fp8] fwd:"), progress


def test_a_json_path_that_cannot_be_written_is_refused_before_timing(tmp_path, capsys):
    """The JSON is written after each record, the first one after a measurement that
    can take minutes: a path it cannot write is a usage error up front."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("")
    for path, why in ((tmp_path, "is a directory"),
                      (a_file / "out.json", "is not a writable directory"),
                      (a_file / "deeper" / "out.json", "is not a writable directory")):
        with pytest.raises(SystemExit) as exit_info:
            bench.cli.parse_args(["--json", str(path)])
        assert exit_info.value.code == 2
        assert why in capsys.readouterr().err
    args = bench.cli.parse_args(["--json", str(tmp_path / "new" / "dir" / "out.json")])
    assert args.json.endswith("out.json")  # a directory to be made is fine
    assert not (tmp_path / "new" / "dir" / "out.json").exists()  # the check leaves no file
    # A directory that is writable but a name it cannot hold; an empty path.
    with pytest.raises(SystemExit) as exit_info:
        bench.cli.parse_args(["--json", str(tmp_path / ("a" * 300 + ".json"))])
    assert exit_info.value.code == 2
    assert "cannot be written: File name too long" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        bench.cli.parse_args(["--json", ""])
    assert exit_info.value.code == 2
    assert "--json needs the path of a file" in capsys.readouterr().err
    existing = tmp_path / "old.json"
    existing.write_text("kept")
    bench.cli.parse_args(["--json", str(existing)])
    assert existing.read_text() == "kept"  # the check writes nothing into it


@pytest.mark.parametrize("argv, why", [
    # EP runs only on --ep-shapes (default: ep and the --shape ones) within the shapes.
    (["--ep", "2", "--shapes", "small-experts"], "would time nothing"),
    (["--ep", "2", "--shapes", "ep", "--ep-shapes", "small-experts"],
     "not among this run's shapes"),
    (["--ep", "2", "--shape", "16,2,4,8,8", "--ep-shapes", "ep"],
     "not among this run's shapes"),
    (["--ep-shapes", "ep"], "there is no --ep N"),
    (["--ep", "2", "--shapes", "ep", "--ep-shapes", ""], "--ep-shapes names no shape"),
    (["--ep", "2", "--shapes", "ep", "--ep-shapes", " , "], "--ep-shapes names no shape"),
    (["--ep", "1"], "EP=1 is the one-device moe record"),
    (["--ep", "2", "--shapes", "ep", "--impls", "ragged_dot"], "has no moe"),
    (["--ep", "2", "--shapes", "ep", "--skip", "moe/fwd"], "the one-device record"),
    (["--exchange"], "--exchange needs --ep"),
    # --skip entries that match nothing in this run.
    (["--impls", "moe", "--skip", "tokamax/fwd"], "tokamax is not in --impls"),
    (["--passes", "fwd", "--skip", "moe/fwdbwd"], "fwdbwd is not in --passes"),
    (["--shapes", "small-experts", "--skip", "moe/fwd/ep"], "ep is not among"),
    (["--impls", "ragged_dot", "--passes", "fwd", "--skip", "ragged_dot/fwd"],
     "nothing to time"),
    # Flags that change nothing, or contradict each other.
    (["--quick", "--full-on-cpu"], "contradict"),
    (["--quick", "--shape", "16,2,4,8,8"], "timed as given"),
    (["--torch", "--dtype", "f32"], "bf16 only"),
    (["--recipe", "fp8", "--impls", "ragged_dot,dense_onehot"], "has none"),
    (["--shape", "16,2,4,8,8", "--shape", "16,2,4,8,8"], "given twice"),
])
def test_flags_that_select_nothing_are_refused(argv, why, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.cli.parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert why in err, err


@pytest.mark.parametrize("argv, platform, why", [
    (["--impls", "tokamax"], ("cpu", 8), "nothing to time on cpu"),
    (["--impls", "tokamax", "--torch"], ("cpu", 8), "nothing to time on cpu"),
    (["--ep", "16", "--shapes", "ep"], ("cpu", 8), "--ep 16 needs 16 devices"),
    (["--ep", "2", "--shapes", "ep"], ("gpu", 1), "--ep 2 needs 2 devices"),
    (["--ep", "3", "--shapes", "ep"], ("cpu", 8), "do not split evenly"),
    (["--try-all"], ("cpu", 8), "--try-all changes nothing"),
    (["--try-all", "--shapes", "mixtral-like"], ("gpu", 1), "--try-all changes nothing"),
    (["--full-on-cpu"], ("gpu", 1), "changes nothing on gpu"),
    # Inputs past the machine's memory: refused before anything is allocated.
    (["--shape", "huge=1000000000,8,128,8192,2048", "--impls", "moe"], ("cpu", 8),
     "GiB for its bf16 inputs alone"),
    (["--shape", "ovf=99999999999999999999,2,4,32,16", "--impls", "moe"], ("cpu", 8),
     "GiB for its bf16 inputs alone"),
    (["--impls", "ragged_dot", "--passes", "fwdbwd", "--shapes", "ep"], ("gpu", 1),
     "--try-all attempts it"),
])
def test_flags_that_select_nothing_on_this_platform_are_refused(argv, platform, why,
                                                                 capsys):
    bench.cli.parse_args(argv)  # fine before the devices are known ...
    with pytest.raises(SystemExit) as exit_info:
        bench.cli.parse_args(argv, platform)  # ... refused once they are
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert why in err, err


def test_platform_checks_accept_what_the_platform_runs():
    assert bench.cli.parse_args(["--impls", "tokamax"], ("gpu", 1)).impls == ["tokamax"]
    assert bench.cli.parse_args(["--try-all"], ("gpu", 1)).try_all
    args = bench.cli.parse_args(["--ep", "2,8", "--shapes", "ep"], ("cpu", 8))
    assert args.ep == [2, 8] and args.ep_shapes == ["ep"]
    args = bench.cli.parse_args(["--ep", "2", "--shapes", "small-experts",
                                 "--ep-shapes", "small-experts"], ("cpu", 8))
    assert args.ep_shapes == ["small-experts"]


def test_the_input_bytes_bound():
    """x and dy [T, H], both weight stacks (E, H, 3F together), the routing's int32 ids
    and f32 weights [T, K]: 2*T*H*b + 3*E*H*F*b + 8*T*K bytes."""
    shape = bench.shapes.custom_shape("s=10,2,3,4,5")
    assert bench.cli.input_bytes(shape, 2) == 2 * 10 * 4 * 2 + 3 * 3 * 4 * 5 * 2 + 8 * 10 * 2


def test_a_shape_whose_inputs_cannot_be_made_is_an_error_record(monkeypatch, tmp_path):
    """Inputs that fail to allocate (out of device memory, typically) make that shape's
    measurements errors with the reason; the run goes on with the next shape."""
    make = bench.cli.make_inputs

    def failing(shape, *a, **k):
        if shape.name == "big":
            raise MemoryError("out of memory allocating 28672000000 bytes")
        return make(shape, *a, **k)

    monkeypatch.setattr(bench.cli, "make_inputs", failing)
    out = tmp_path / "r.json"
    result = bench.main(["--shape", "big=64,2,4,32,16", "--shape", "ok=64,2,4,32,16",
                         "--impls", "moe", "--passes", "fwd", "--repeats", "1",
                         "--warmup", "0", "--json", str(out)])
    by_shape = {r["shape"]: r for r in result["records"]}
    assert by_shape["big"]["status"] == "error"
    assert "inputs could not be made: MemoryError: out of memory" in by_shape["big"]["error"]
    assert by_shape["ok"]["status"] == "ok" and by_shape["ok"]["median_ms"] > 0
    saved = json.loads(out.read_text())
    assert {r["shape"] for r in saved["records"]} == {"big", "ok"}
    assert saved["settings"]["quick"] is None  # no bench shapes: neither quick nor full


def test_too_many_ep_devices_is_refused_before_anything_runs(monkeypatch, capsys):
    def must_not_run(*_, **__):
        raise AssertionError("ran before the --ep device check")

    for name in ("make_inputs", "bench_one", "bench_ep", "torch_records"):
        monkeypatch.setattr(bench.cli, name, must_not_run)
    too_many = jax.device_count() + 1
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--shapes", "ep", "--impls", "moe", "--ep", f"2,{too_many}"])
    assert exit_info.value.code == 2
    assert f"--ep {too_many} needs {too_many} devices" in capsys.readouterr().err


def test_gpu_only_baselines_are_skipped_on_cpu_with_a_note(monkeypatch, capsys, tmp_path):
    if jax.default_backend() != "cpu":
        pytest.skip("checks how a CPU backend skips the GPU-only baselines; on a GPU they "
                    "are attempted, so there is nothing to check")
    assert bench.pipelines.platform_skip("tokamax", "gpu") is None
    for name in ("tokamax", *bench.torch_baselines.TORCH_IMPLS, "ragged_all_to_all"):
        assert "GPU" in bench.pipelines.platform_skip(name, "cpu")
    resolve, run = bench.pipelines.resolve_impl, subprocess.run

    def resolve_no_tokamax(name):
        assert name != "tokamax", "tokamax attempted on CPU"
        return resolve(name)

    def run_no_torch(cmd, *a, **kw):
        assert not any("_torch_moe" in str(c) for c in cmd), "torch attempted on CPU"
        return run(cmd, *a, **kw)

    monkeypatch.setattr(bench.pipelines, "resolve_impl", resolve_no_tokamax)
    monkeypatch.setattr(subprocess, "run", run_no_torch)
    path = tmp_path / "cpu.json"
    bench.main(["--quick", "--shapes", "ep", "--impls", "ragged_dot,tokamax", "--passes",
                "fwd", "--torch", "--repeats", "1", "--warmup", "0", "--json", str(path)])
    captured = capsys.readouterr()
    records = {r["impl"]: r for r in json.loads(path.read_text())["records"]}
    assert set(records) == {"ragged_dot", "tokamax", *bench.torch_baselines.TORCH_IMPLS}
    assert records["ragged_dot"]["status"] == "ok"
    for name in ("tokamax", *bench.torch_baselines.TORCH_IMPLS):
        assert records[name]["status"] == "skipped", records[name]
        assert records[name]["error"] == bench.pipelines.platform_skip(name, "cpu")
        assert f"note: {name} is not attempted on cpu" in captured.err
        assert f"{name}: skipped: needs a CUDA GPU" in captured.out  # the table's note


def test_recipe_fp8_reaches_moe_only_and_is_recorded(tmp_path, capsys):
    path = tmp_path / "fp8.json"
    result = bench.main(["--shape", "mine=24,2,4,16,8", "--impls", "moe,ragged_dot",
                         "--passes", "fwd", "--repeats", "1", "--warmup", "0",
                         "--recipe", "fp8", "--check", "--json", str(path)])
    assert result["settings"]["recipe"] == "fp8"
    records = json.loads(path.read_text())["records"]
    assert [(r["impl"], r["recipe"]) for r in records] == [("moe", "fp8"),
                                                           ("ragged_dot", None)]
    moe, ragged = records
    assert moe["status"] == "ok", moe
    # fp8 against the dense bf16 reference: the recipe's few percent, well above
    # the bf16 pipelines' rounding
    assert moe["rel_err"]["y"] > 2 * ragged["rel_err"]["y"]
    assert "moe [fp8]" in capsys.readouterr().out


def test_recipes_run_in_one_process_and_fp8_rows_compare_with_native(tmp_path):
    path = tmp_path / "both.json"
    bench.main(["--shape", "mine=24,2,4,16,8", "--impls", "moe,ragged_dot",
                "--passes", "fwd", "--repeats", "1", "--warmup", "0",
                "--recipe", "native,fp8", "--json", str(path)])
    records = json.loads(path.read_text())["records"]
    assert [(r["impl"], r["recipe"]) for r in records] == [
        ("moe", "native"), ("moe", "fp8"), ("ragged_dot", None)]
    native, fp8, ragged = records
    assert fp8["recipe_speedup"] == pytest.approx(native["median_ms"] / fp8["median_ms"])
    assert fp8["mok_speedup"] is None
    # the baselines compare with the native moe
    assert ragged["mok_speedup"] == pytest.approx(ragged["median_ms"] / native["median_ms"])


def test_a_baseline_of_a_recipe_compares_with_moe_of_that_recipe():
    def rec(impl, ms, recipe=None, queued_ms=None):
        return {"shape": "ep", "impl": impl, "pass": "fwd", "median_ms": ms, "min_ms": ms,
                "tflops": 1.0, "status": "ok", "error": None, "recipe": recipe,
                "queued_ms": queued_ms}

    records = [rec("moe", 4.0, "native"), rec("moe", 2.0, "fp8"),
               rec("torch_grouped_mm", 3.0), rec("torch_scaled_grouped_mm", 1.0, "fp8")]
    bench.report.add_speedups(records)
    assert records[1]["recipe_speedup"] == pytest.approx(2.0)
    assert records[2]["mok_speedup"] == pytest.approx(3.0 / 4.0)
    assert records[3]["mok_speedup"] == pytest.approx(1.0 / 2.0)
    # no moe of the baseline's recipe measured: nothing to compare with
    alone = [rec("moe", 4.0, "native"), rec("torch_scaled_grouped_mm", 1.0, "fp8")]
    bench.report.add_speedups(alone)
    assert alone[1]["mok_speedup"] is None


def test_queued_times_compare_a_recipe_with_the_native_moe():
    """With --queue the fp8 row's queued speedup is the native moe's queued median
    over its own (not the blocked ratio), in the record and in the table's queued
    speedup column; none where the native moe has no queued time."""
    def rec(impl, ms, queued_ms, recipe):
        return {"shape": "ep", "impl": impl, "pass": "fwd", "median_ms": ms, "min_ms": ms,
                "tflops": 1.0, "status": "ok", "error": None, "recipe": recipe,
                "queued_ms": queued_ms}

    records = [rec("moe", 4.0, 3.0, "native"), rec("moe", 2.0, 1.2, "fp8")]
    bench.report.add_speedups(records)
    assert records[1]["recipe_speedup"] == pytest.approx(2.0)
    assert records[1]["recipe_speedup_queued"] == pytest.approx(2.5)
    assert records[1]["mok_speedup_queued"] is None
    lines = bench.report.format_table(records).splitlines()
    assert lines[3].split()[-3:] == ["2.00x", "1.200", "2.50x"], lines
    assert lines[2].split()[-2:] == ["3.000", "-"], lines
    unqueued = [rec("moe", 4.0, None, "native"), rec("moe", 2.0, 1.2, "fp8")]
    bench.report.add_speedups(unqueued)
    assert unqueued[1]["recipe_speedup_queued"] is None


@pytest.mark.parametrize("recipes", ["fp8,fp8", "fp4", ""])
def test_recipe_list_rejects_unknown_or_repeated_names(recipes, capsys):
    assert_usage_error(capsys, lambda: bench.main(["--shape", "mine=24,2,4,16,8", "--impls", "moe",
                                            "--recipe", recipes]),
                f"--recipe takes distinct names of native, fp8, comma-separated; got {recipes!r}")


def test_torch_records_ask_for_kernels_and_keep_them(monkeypatch):
    """kernels=N reaches the subprocess as --kernels N; a measured record keeps the
    kernel table it sent back, one without it gets none."""
    seen = {}
    table = [{"name": "gemm", "ms": 0.4, "launches": 2.0}]

    def fake_run(cmd, *a, **kw):
        seen["cmd"] = cmd
        shape = [64, 8, 32, 448, 128]
        recs = [{"name": "ep", "shape": shape, "impl": i, "pass": "fwd", "status": "ok",
                 "error": None, "times_ms": [1.0]} for i in bench.torch_baselines.TORCH_IMPLS]
        recs[0].update(kernel_ms=0.4, kernels=table)
        return subprocess.CompletedProcess(cmd, 0, json.dumps({"records": recs}) + "\n", "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    records = bench.torch_baselines.torch_records([bench.QUICK_SHAPES["ep"]], ["fwd"],
                                                  warmup=0, repeats=1, kernels=7)
    assert seen["cmd"][seen["cmd"].index("--kernels") + 1] == "7"
    first, *rest = records
    assert first["impl"] == bench.torch_baselines.TORCH_IMPLS[0]
    assert first["kernel_ms"] == 0.4 and first["kernels"] == table
    assert all("kernels" not in r for r in rest)


def test_recipe_fp8_needs_bf16(capsys):
    assert_usage_error(capsys, lambda: bench.main(["--shape", "mine=24,2,4,16,8", "--impls", "moe",
                                            "--recipe", "fp8", "--dtype", "f32"]),
                "--recipe fp8 takes bfloat16 inputs: use --dtype bf16")


@pytest.mark.parametrize("seed", ["-1", str(2**63)])
def test_a_seed_numpy_refuses_is_a_usage_error(seed, capsys):
    """It was an OverflowError from numpy after the first shape's setup."""
    with pytest.raises(SystemExit) as exit_info:
        bench.cli.parse_args(["--shape", "mine=24,2,4,16,8", f"--seed={seed}"])
    assert exit_info.value.code == 2
    assert "--seed must be an integer in [0, 2^63)" in capsys.readouterr().err


def test_skip_names_a_torch_baseline(monkeypatch, capsys):
    """--skip takes the --torch baselines too: the skipped one is not run (the
    subprocess is told so) and is recorded as skipped; without --torch it is refused."""
    assert_usage_error(capsys, lambda: bench.cli.parse_args(["--impls", "moe", "--skip",
                                                      "torch_pipeline/fwd"]),
                "torch_pipeline runs only with --torch")
    args = bench.cli.parse_args(["--impls", "moe", "--torch", "--skip",
                                 "torch_pipeline/fwdbwd/ep"])
    assert args.skip == ["torch_pipeline/fwdbwd/ep"]

    seen = {}

    def fake_run(cmd, *a, **kw):
        seen["cmd"] = cmd
        shape = [64, 8, 32, 448, 128]
        recs = [{"name": "ep", "shape": shape, "impl": i, "pass": p, "status": "ok",
                 "error": None, "times_ms": [1.0]}
                for i in bench.torch_baselines.TORCH_IMPLS for p in bench.pipelines.PASSES]
        return subprocess.CompletedProcess(cmd, 0, json.dumps({"records": recs}) + "\n", "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    records = bench.torch_baselines.torch_records([bench.QUICK_SHAPES["ep"]],
                                                  bench.pipelines.PASSES, warmup=0, repeats=1,
                                                  skip=args.skip)
    assert seen["cmd"][seen["cmd"].index("--skip") + 1] == "torch_pipeline/fwdbwd/ep"
    assert seen["cmd"].count("--skip") == 1
    status = {(r["impl"], r["pass"]): r["status"] for r in records}
    assert status.pop(("torch_pipeline", "fwdbwd")) == "skipped"
    assert set(status.values()) == {"ok"}


def test_the_seed_reaches_the_torch_subprocess(monkeypatch):
    """--seed chose the JAX inputs only: the torch baselines drew from fixed seeds
    whatever it said. main hands it to torch_records, which passes it on."""
    seen = {}

    def fake_records(shapes, passes, **kw):
        seen.update(kw)
        return []

    monkeypatch.setattr(bench.cli, "torch_records", fake_records)
    bench.main(["--shape", "s=16,2,4,16,8", "--impls", "moe", "--passes", "fwd", "--torch",
                "--seed", str(2**40 + 3), "--repeats", "1", "--warmup", "0"])
    assert seen["seed"] == 2**40 + 3

    def fake_run(cmd, *a, **kw):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 0, json.dumps({"records": []}) + "\n", "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    bench.torch_baselines.torch_records([bench.QUICK_SHAPES["ep"]], ["fwd"], warmup=0,
                                        repeats=1, seed=2**40 + 3)
    assert seen["cmd"][seen["cmd"].index("--seed") + 1] == str(2**40 + 3)


class _AnyTensor:
    """Whatever _torch_moe asks of torch and its tensors: every attribute, call,
    index and operator gives this object back (int() 16: a row count)."""

    __version__ = "stand-in"

    def __getattr__(self, name):
        return self

    def __call__(self, *_, **__):
        return self

    def __getitem__(self, _):
        return self

    def __setitem__(self, *_):
        pass

    def __iter__(self):  # a, b = torch.topk(...)
        return iter((self, self))

    def __int__(self):
        return 16

    def __enter__(self):
        return self

    def __exit__(self, *_):
        return False


for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow"):
    setattr(_AnyTensor, f"__{_op}__", _AnyTensor.__call__)
    setattr(_AnyTensor, f"__r{_op}__", _AnyTensor.__call__)
for _op in ("ge", "gt", "le", "lt", "neg"):
    setattr(_AnyTensor, f"__{_op}__", _AnyTensor.__call__)


def _torch_subprocess_in_process(monkeypatch):
    """subprocess.run for torch_records: _torch_moe.main on the command's arguments,
    in this process, with a stand-in for torch (_AnyTensor) and every timing the
    next integer, so that each measurement's time is its own. Returns the commands
    run."""
    import contextlib  # pylint: disable=import-outside-toplevel
    import io  # pylint: disable=import-outside-toplevel
    import itertools  # pylint: disable=import-outside-toplevel
    from mok_jax.bench import _torch_moe  # pylint: disable=import-outside-toplevel

    monkeypatch.setitem(sys.modules, "torch", _AnyTensor())
    ticks = itertools.count(1)
    monkeypatch.setattr(_torch_moe, "_time", lambda torch, fn, warmup, repeats:
                        [float(next(ticks))] * repeats)
    commands = []

    def run(cmd, *a, **kw):
        assert cmd[1].endswith("_torch_moe.py")
        commands.append(cmd)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = _torch_moe.main(cmd[2:])
        return subprocess.CompletedProcess(cmd, code, out.getvalue(), "")

    monkeypatch.setattr(subprocess, "run", run)
    return commands


def test_torch_records_know_shapes_by_name(monkeypatch):
    """The torch side knew a shape by its five numbers: a --shape NAME=T,K,E,H,F of a
    bench shape's dimensions took that shape's --skip entries (its baseline was not
    run) and their records got one another's times. By name, each its own."""
    commands = _torch_subprocess_in_process(monkeypatch)
    ep = bench.QUICK_SHAPES["ep"]
    twin = f"twin={ep.tokens},{ep.top_k},{ep.experts},{ep.hidden},{ep.ffn}"
    args = bench.cli.parse_args(["--shapes", "ep", "--shape", twin, "--impls", "moe",
                                 "--torch", "--passes", "fwd", "--skip",
                                 "torch_pipeline/fwd/ep"])
    twin = args.shape[0]
    records = bench.torch_baselines.torch_records([ep, twin], ["fwd"], warmup=0, repeats=2,
                                                  skip=args.skip)
    assert len(commands) == 1
    got = {(r["shape"], r["impl"]): r for r in records}
    assert len(got) == 2 * len(bench.torch_baselines.TORCH_IMPLS)
    assert got[("ep", "torch_pipeline")]["status"] == "skipped"
    assert got[("twin", "torch_pipeline")]["status"] == "ok"
    for impl in bench.torch_baselines.TORCH_IMPLS[1:]:
        mine, other = got[("ep", impl)], got[("twin", impl)]
        assert mine["status"] == other["status"] == "ok", (mine, other)
        # ep ran first: every one of its times is below the twin's
        assert mine["median_ms"] < other["median_ms"], impl
    assert got[("twin", "torch_pipeline")]["median_ms"] > max(
        got[("ep", impl)]["median_ms"] for impl in bench.torch_baselines.TORCH_IMPLS[1:])


def test_the_torch_script_refuses_a_name_twice_and_a_skip_of_no_shape(capsys):
    from mok_jax.bench import _torch_moe  # pylint: disable=import-outside-toplevel
    with pytest.raises(SystemExit):
        _torch_moe.main(["--shape", "a=16,2,4,16,8", "--shape", "a=32,2,4,16,8"])
    assert "--shape names a more than once" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # shapes go by name, not by their numbers
        _torch_moe.main(["--shape", "a=16,2,4,16,8", "--skip", "torch_pipeline/fwd/16,2,4,16,8"])
    assert "is not IMPL/PASS/NAME with NAME a --shape's name (a)" in capsys.readouterr().err


class _Drawn(Exception):
    """Stops a fake torch at its first random draw."""


def _fake_torch(seeded):
    """A stand-in for the torch module, enough for _torch_moe up to its first draw:
    each generator's (device, seed) goes to `seeded`, then randn stops the run."""
    class Generator:
        def __init__(self, device):
            self.device = device

        def manual_seed(self, seed):
            seeded.append((self.device, seed))
            return self

    def randn(*_, **__):
        raise _Drawn

    class cuda:  # noqa: N801  (torch.cuda's spelling)
        @staticmethod
        def is_available():
            return True

    return type("FakeTorch", (), {"Generator": Generator, "randn": staticmethod(randn),
                                  "cuda": cuda, "bfloat16": "bf16", "__version__": "fake"})


def test_torch_baselines_draw_from_the_seed(monkeypatch):
    """_torch_moe seeds its routing (CPU) and input (CUDA) generators from --seed:
    every seed, and each of the two roles, its own generator seed within torch's
    [0, 2^64); seed 0 keeps the seeds the baselines always used (0 and 1)."""
    from mok_jax.bench import _torch_moe  # pylint: disable=import-outside-toplevel

    def seeds_of(seed):
        seeded = []
        torch = _fake_torch(seeded)
        with pytest.raises(_Drawn):
            _torch_moe._routing(torch, 16, 2, 4, 16, 8, "cuda", seed)
        real_routing = _torch_moe._routing
        monkeypatch.setattr(_torch_moe, "_routing", lambda *a: (None, None, None, None, 16))
        with pytest.raises(_Drawn):
            _torch_moe.bench_shape(torch, (16, 2, 4, 16, 8), ["fwd"], 0, 1, seed=seed)
        monkeypatch.setattr(_torch_moe, "_routing", real_routing)
        assert [device for device, _ in seeded] == ["cpu", "cuda"]
        return [s for _, s in seeded]

    assert seeds_of(0) == [0, 1]
    drawn = [s for seed in (0, 1, 2, 2**32, 2**32 + 1, 2**63 - 1) for s in seeds_of(seed)]
    assert len(set(drawn)) == len(drawn), drawn
    assert all(0 <= s < 2**64 for s in drawn)

    # The command line: --seed reaches bench_shape; one outside [0, 2^63) is refused.
    got = []
    monkeypatch.setitem(sys.modules, "torch", _fake_torch([]))
    monkeypatch.setattr(_torch_moe, "bench_shape",
                        lambda torch, shape, *a, **kw: got.append((a, kw)) or [])
    _torch_moe.main(["--shape", "16,2,4,16,8", "--seed", str(2**40 + 3)])
    assert len(got) == 1 and 2**40 + 3 in (*got[0][0], *got[0][1].values())
    for bad in ("-1", str(2**63)):
        with pytest.raises(SystemExit):
            _torch_moe.main(["--shape", "16,2,4,16,8", "--seed", bad])
