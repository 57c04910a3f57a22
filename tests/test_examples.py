"""The examples: train_moe_lm.py (training falls, logs, plot, checkpoints, bitwise
resume, the h200 preset traces) and mesh_experiments.py (every mesh agrees), from
their command lines and in process."""

import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mok_jax import nn as mnn

from conftest import assert_bitwise, assert_close, assert_usage_error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, EXAMPLES)

import moe_lm as lm  # noqa: E402  (the model, its data, step and checkpoints)
import train_moe_lm  # noqa: E402  (the command line and the run)

# The examples' dependencies (the `examples` extra) are required, not skipped on:
# a missing one fails here, by name.
import matplotlib  # noqa: E402,F401
import optax  # noqa: E402,F401
import orbax.checkpoint  # noqa: E402,F401
import tqdm  # noqa: E402,F401

# A short tiny-preset run: 8 x 64 bytes per step on one device. Tests that run
# main() in-process use these steps and sizes where they can (--stop-after for a
# shorter run): the same train and eval programs, loaded from the session's
# compilation cache instead of compiled again.
STEPS = 20
STOP = 15  # the resumed run's first part: a checkpoint step, not an eval step
SMALL = ["--batch", "8", "--seq", "64", "--eval-batches", "4", "--log-every", "5",
         "--ckpt-every", "5", "--dp", "1", "--no-progress"]


def _run_script(name, *args, timeout=240):
    # The environment as it is: the scripts import whichever mok_jax this session
    # would (the installed package in CI, never the uncompiled source tree).
    return subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    log = train_moe_lm.main(["--steps", str(STEPS), "--eval-every", "10", "--out", str(out),
                             *SMALL])
    return out, log


def _resumed_common(out):
    return ["--steps", str(STEPS), "--eval-every", "10", "--out", str(out), *SMALL]


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """STOP steps, then --resume to STEPS; the resume logs every step (how a run
    reports may change between its parts)."""
    out = tmp_path_factory.mktemp("resumed")
    first = train_moe_lm.main([*_resumed_common(out), "--stop-after", str(STOP)])
    log = train_moe_lm.main([*_resumed_common(out), "--resume", "--log-every", "1"])
    return out, first, log


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("warmup,steps", [(1, 1), (4, 10), (40, 400)])
def test_schedule_warms_up_from_the_first_step(warmup, steps):
    """lr * (s + 1) / warmup over the warm-up (the first step learns: --steps 1
    trains), lr at step warmup - 1, lr * min_lr_ratio at --steps."""
    cfg = lm.Config(lr=1e-3, warmup=warmup, steps=steps, min_lr_ratio=0.1)
    tx, schedule = lm.make_optimizer(cfg)
    for s in range(warmup):
        np.testing.assert_allclose(float(schedule(s)), 1e-3 * (s + 1) / warmup, rtol=1e-5)
    np.testing.assert_allclose(float(schedule(steps)), 1e-4, rtol=1e-5)
    assert all(float(schedule(s)) <= 1e-3 * (1 + 1e-6) for s in range(steps + 1))
    w = {"w": jnp.ones((2, 2))}
    updates, _ = tx.update({"w": jnp.full((2, 2), 0.5)}, tx.init(w), w)
    assert float(jnp.abs(updates["w"]).min()) > 0  # the first update moves the weights


@pytest.mark.slow
def test_tiny_training_eval_loss_falls(straight_run):
    _, log = straight_run
    evals = log["eval"]
    assert [e["step"] for e in evals] == [0, 10, 20]
    initial, final = evals[0]["loss"], evals[-1]["loss"]
    assert abs(initial - math.log(256)) < 1.0, initial  # starts near uniform over bytes
    assert final < 0.8 * initial, (initial, final)
    assert log["summary"]["final_eval_loss"] == final
    assert log["summary"]["steps"] == STEPS


@pytest.mark.slow  # the module's trained run (14 s), shared with the slow tests
def test_log_json_and_loss_png(straight_run):
    out, log = straight_run
    with open(out / "log.json") as f:
        on_disk = json.load(f)
    assert on_disk["train"] == log["train"] and on_disk["eval"] == log["eval"]
    assert [r["step"] for r in on_disk["train"]] == list(range(1, STEPS + 1))
    for r in on_disk["train"]:
        assert all(math.isfinite(r[k]) for k in ("loss", "ce", "aux", "z", "grad_norm", "lr"))
        assert r["load_max"] >= 1.0 and r["dropped"] == 0
    # Warm-up (its first step learns) then cosine decay.
    lrs = [r["lr"] for r in on_disk["train"]]
    peak = int(np.argmax(lrs))
    assert 0.0 < lrs[0] < lrs[peak] and 0 < peak < STEPS - 1 and lrs[-1] < lrs[peak]
    assert on_disk["throughput"] and all(r["tokens_per_s"] > 0 for r in on_disk["throughput"])
    assert on_disk["summary"]["tokens_per_s"] > 0
    corpus = on_disk["corpus"]
    assert corpus["train_files"] > 10 * corpus["eval_files"] > 0
    assert on_disk["param_counts"] == lm.param_counts(lm.Config(**on_disk["config"]))
    with open(out / "loss.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(out / "loss.png") > 10_000


@pytest.mark.slow
def test_resume_is_bitwise_identical(straight_run, resumed_run):
    straight_out, straight = straight_run
    resumed_out, first, resumed = resumed_run
    assert first["summary"]["steps"] == STOP
    assert [r["step"] for r in first["eval"]] == [0, 10]
    # The stopped part's final eval loss is step 10's, and says so.
    assert first["summary"]["final_eval_step"] == 10
    assert first["summary"]["final_eval_loss"] == first["eval"][-1]["loss"]
    assert [r["step"] for r in resumed["train"]] == list(range(1, STEPS + 1))
    # Every logged metric of every step, and every eval, is the same number (the
    # resume adds no eval at STOP, which the schedule does not evaluate).
    assert resumed["train"] == straight["train"]
    assert resumed["eval"] == straight["eval"]
    # And the final parameters and optimizer state are the same bits.
    cfg = lm.Config(**straight["config"])
    mesh = lm.make_mesh(1, 1, jax.devices()[:1])
    tx, _ = lm.make_optimizer(cfg)
    _, like, shardings = lm.init_state(cfg, mesh, tx)
    states = []
    for out in (straight_out, resumed_out):
        manager = lm.checkpoint_manager(os.path.join(out, "ckpt"))
        assert manager.latest_step() == STEPS
        states.append(lm.restore_checkpoint(manager, STEPS, like, shardings))
        manager.close()
    a, b = states
    assert int(a.step) == int(b.step) == STEPS
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b) > 10
    for x, y in zip(leaves_a, leaves_b):
        assert_bitwise(x, y, "final state, straight vs resumed")


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.slow),
                                   "bfloat16"])
@pytest.mark.slow
def test_checkpoint_round_trip_is_bitwise(tmp_path, dtype):
    """Every leaf comes back; in bf16 the expert stacks' copies are not saved but
    derived from the restored masters (not taken from ``like``)."""
    cfg = lm.Config(balance="bias", dtype=dtype)  # with BalanceBias state too
    mesh = lm.make_mesh(2, 1, jax.devices()[:2])
    tx, _ = lm.make_optimizer(cfg)
    _, like, shardings = lm.init_state(cfg, mesh, tx)
    # Make the optimizer state non-trivial, the step non-zero and the parameters new.
    params = jax.tree.map(lambda a: a * 1.5 + 0.25, like.params)
    copies = lm.weight_copies(params, cfg.dtype) if dtype == "bfloat16" else like.copies
    opt = jax.tree.map(lambda a: a + jnp.asarray(3, a.dtype), like.opt)
    state = like._replace(step=jnp.int32(7), opt=opt, params=params, copies=copies)
    assert jax.tree.leaves(state.bias)
    assert len(jax.tree.leaves(state.copies)) == (2 * cfg.n_layers if dtype == "bfloat16" else 0)
    manager = lm.checkpoint_manager(str(tmp_path / "ckpt"))
    lm.save_checkpoint(manager, state)
    manager.wait_until_finished()
    assert sorted(manager.item_metadata(7).keys()) == ["bias", "opt", "params", "step"]
    restored = lm.restore_checkpoint(manager, 7, like, shardings)
    manager.close()
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for x, y, s in zip(jax.tree.leaves(restored), jax.tree.leaves(state),
                       jax.tree.leaves(shardings)):
        assert_bitwise(x, y, "restored checkpoint")
        assert x.sharding == s


def _two_steps(step, state, cfg, mesh):
    """``step`` on two random batches (seeds 0 and 1) split over ``mesh``'s batch
    axes, as the example feeds them: the last state and both steps' metrics."""
    metrics = []
    for i in range(2):
        batch = jax.device_put(jnp.asarray(np.random.default_rng(i).integers(
            0, 256, (cfg.batch, cfg.seq + 1)), jnp.int32), lm.batch_sharding(mesh))
        state, m = step(state, batch)
        metrics.append(m)
    return state, metrics


@pytest.mark.slow
def test_sharded_optimizer_state_and_step(tmp_path):
    """--shard-optimizer (ZeRO stage 1): the moments of every matrix are split over
    dp (on a dimension not split already), scalars stay whole, and two steps give
    the losses and parameters of the replicated optimizer to float rounding."""
    from jax.sharding import PartitionSpec as P
    cfg = lm.Config(steps=2, batch=4, seq=32)
    mesh = lm.make_mesh(2, 1, jax.devices()[:2])
    tx, schedule = lm.make_optimizer(cfg)
    runs = []
    for shard in (False, True):
        graphdef, state, shardings = lm.init_state(cfg, mesh, tx, shard_optimizer=shard)
        update = lm.shard_over_data(shardings.params, state.params, mesh) if shard else None
        step = jax.jit(lm.make_train_step(cfg, graphdef, tx, schedule, update_shardings=update,
                                          param_shardings=shardings.params),
                       in_shardings=(shardings, lm.batch_sharding(mesh)),
                       out_shardings=(shardings, None), donate_argnums=(0,))
        state, metrics = _two_steps(step, state, cfg, mesh)
        runs.append(([float(m["loss"]) for m in metrics], state))
    specs = [a.sharding.spec for a in jax.tree.leaves(runs[1][1].opt) if a.ndim >= 2]
    assert specs and all("dp" in jax.tree.leaves(tuple(s)) for s in specs), specs
    assert all(a.sharding.spec == P() for a in jax.tree.leaves(runs[1][1].opt) if a.ndim == 0)
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(runs[1][1].params), jax.tree.leaves(runs[0][1].params)):
        assert "dp" not in jax.tree.leaves(tuple(a.sharding.spec))  # gathered back
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_reduce_barrier_adds_a_barrier_per_tied_layer_and_keeps_the_step():
    """--grad-reduce-lag ties layer i's expert weights to layer i-lag's input: the
    backward gains one optimization barrier per tied layer (what pins each
    data-parallel all-reduce inside the backward). Lags 0 and 1 in f32 on dp, and
    lag 1 in bf16 (where the weights are tied in the layer's compute dtype) on
    dp x ep (where the tied weights are split over ep). The step's loss, gradient
    norm and new parameters are those without it, to the contract's tolerances:
    the two are different XLA programs, whose summation order XLA chooses (on a
    CPU it removes the barriers before fusing, and the bits have been the same;
    that is XLA's choice, not mok_jax's)."""
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 33)), jnp.int32)
    results = {}
    cases = [((2, 1), "float32", -1), ((2, 1), "float32", 0), ((2, 1), "float32", 1),
             ((2, 2), "bfloat16", -1), ((2, 2), "bfloat16", 1)]
    for (dp, ep), dtype, lag in cases:
        mesh = lm.make_mesh(dp, ep, jax.devices()[:dp * ep])
        cfg = lm.Config(steps=2, batch=4, seq=32, n_layers=2, dtype=dtype, grad_reduce_lag=lag)
        tx, schedule = lm.make_optimizer(cfg)
        rules = mnn.logical_axis_rules(mesh.axis_names)
        with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):  # as the example runs
            graphdef, state, shardings = lm.init_state(cfg, mesh, tx)
            step = jax.jit(lm.make_train_step(cfg, graphdef, tx, schedule),
                           in_shardings=(shardings, lm.batch_sharding(mesh)),
                           out_shardings=(shardings, None))
            text = str(jax.make_jaxpr(step)(state, batch))
            results[dp, ep, dtype, lag] = step(state, jax.device_put(batch,
                                                                     lm.batch_sharding(mesh)))
        # Each layer's qkv projection has one barrier of its own (lm.qkv_projection).
        barriers = text.count("optimization_barrier") - cfg.n_layers
        assert barriers == (0 if lag < 0 else cfg.n_layers - lag), (dtype, lag, barriers)
    for (dp, ep), dtype, lag in cases:
        if lag < 0:
            continue
        (state, metrics), (ref_state, ref) = (results[dp, ep, dtype, lag],
                                              results[dp, ep, dtype, -1])
        where = f"mesh ({dp}, {ep}), {dtype}, lag {lag}"
        for name in ("loss", "grad_norm"):
            assert_close(metrics[name], ref[name], jnp.dtype(dtype), what=f"{where}: {name}")
        for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
            assert_close(a, b, jnp.dtype(dtype), what=f"{where}: parameters")


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape, shard_optimizer", [((2, 1), True), ((2, 2), False)])
def test_weight_copies_give_the_same_steps(mesh_shape, shard_optimizer):
    """Config.weight_copies (bf16): the train state keeps the expert stacks in bf16,
    written by the update, and the forward takes them. Two steps give the losses,
    gradient norms, parameters and optimizer state of casting in the forward, to
    the contract's bf16 tolerance (two XLA programs: the bits have been the same,
    but their summation order is XLA's choice); the copies are exactly the masters
    cast (a cast rounds one way); f32 keeps none. Two meshes: dp with the sharded
    optimizer (expert stacks whole on each device) and dp x ep with the replicated
    one (a replicated update); one device and dp with the replicated optimizer
    combine these layouts and are left out."""
    dp, ep = mesh_shape
    mesh = lm.make_mesh(dp, ep, jax.devices()[:dp * ep])
    rules = mnn.logical_axis_rules(mesh.axis_names)
    runs = {}
    for dtype, copies in (("bfloat16", True), ("bfloat16", False), ("float32", True)):
        cfg = lm.Config(steps=2, batch=4, seq=32, n_layers=2, dtype=dtype, weight_copies=copies)
        tx, schedule = lm.make_optimizer(cfg)
        with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):  # as the example runs
            graphdef, state, shardings = lm.init_state(cfg, mesh, tx,
                                                       shard_optimizer=shard_optimizer)
            if dtype == "float32":  # the steps keep the state's structure: no steps needed
                runs[dtype, copies] = (state, None)
                continue
            update = (lm.shard_over_data(shardings.params, state.params, mesh)
                      if shard_optimizer else None)
            step = jax.jit(lm.make_train_step(cfg, graphdef, tx, schedule,
                                              update_shardings=update,
                                              param_shardings=shardings.params),
                           in_shardings=(shardings, lm.batch_sharding(mesh)),
                           out_shardings=(shardings, None))
            state, metrics = _two_steps(step, state, cfg, mesh)
        runs[dtype, copies] = (state, metrics)
    (state, metrics), (ref_state, ref_metrics) = runs["bfloat16", True], runs["bfloat16", False]
    assert len(jax.tree.leaves(state.copies)) == 4 and not jax.tree.leaves(ref_state.copies)
    assert not jax.tree.leaves(runs["float32", True][0].copies)
    for m, r in zip(metrics, ref_metrics):
        for name in ("loss", "grad_norm"):
            assert_close(m[name], r[name], jnp.bfloat16, what=name)
    for what in ("params", "opt"):
        for a, b in zip(jax.tree.leaves(getattr(state, what)),
                        jax.tree.leaves(getattr(ref_state, what))):
            assert a.dtype == b.dtype and a.shape == b.shape, what
            assert_close(a, b, jnp.bfloat16, what=what)
    want = lm.weight_copies(state.params, jnp.bfloat16)
    for (path, a), (_, b) in zip(nnx.to_flat_state(state.copies),
                                 nnx.to_flat_state(want)):
        assert a.dtype == jnp.bfloat16 and path[-1] in lm.EXPERT_STACKS
        assert_bitwise(a, b, f"copy {path}")


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape, lag", [((2, 1), 1), ((2, 2), -1)])
def test_fused_norms_are_the_same_model(mesh_shape, lag):
    """--norm fused (mok_jax.add_rms_norm: each residual add with the norm after it,
    the blocks passing the FFN output on) against --norm nnx (the add, then
    nnx.RMSNorm): the same parameters from the same seed, and two f32 steps on dp
    with the reduce barrier (which then ties the pending branch too) and on dp x ep
    give the same losses and parameters up to the order of f32 sums. (One device
    adds no case of its own: the norms act on each device's tokens alone.)"""
    dp, ep = mesh_shape
    mesh = lm.make_mesh(dp, ep, jax.devices()[:dp * ep])
    rules = mnn.logical_axis_rules(mesh.axis_names)
    runs = {}
    for impl in ("nnx", "fused"):
        cfg = lm.Config(steps=2, batch=4, seq=32, n_layers=2, norm=impl, grad_reduce_lag=lag)
        tx, schedule = lm.make_optimizer(cfg)
        with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):  # as the example runs
            graphdef, state, shardings = lm.init_state(cfg, mesh, tx)
            init = state.params
            step = jax.jit(lm.make_train_step(cfg, graphdef, tx, schedule),
                           in_shardings=(shardings, lm.batch_sharding(mesh)),
                           out_shardings=(shardings, None))
            text = str(jax.make_jaxpr(step)(state, jnp.zeros((4, 33), jnp.int32)))
            state, metrics = _two_steps(step, state, cfg, mesh)
        # 2 norms a block plus the final one; the first block's first has nothing to add
        assert text.count("mok_add_rms_norm_fwd") == (4 if impl == "fused" else 0), impl
        runs[impl] = (init, state, metrics)
    (init, state, metrics), (ref_init, ref_state, ref_metrics) = runs["fused"], runs["nnx"]
    for a, b in zip(jax.tree.leaves(init), jax.tree.leaves(ref_init)):
        assert_bitwise(a, b, "initial parameters")
    for m, r in zip(metrics, ref_metrics):
        for name in ("loss", "grad_norm"):
            np.testing.assert_allclose(m[name], r[name], rtol=1e-5, err_msg=name)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # two compiled training steps (8 s)
def test_weight_copies_state_and_step_must_agree():
    cfg = lm.Config(steps=2, batch=4, seq=32, n_layers=2, dtype="bfloat16")
    mesh = lm.make_mesh(1, 1, jax.devices()[:1])
    tx, schedule = lm.make_optimizer(cfg)
    graphdef, state, _ = lm.init_state(cfg, mesh, tx)
    batch = jax.ShapeDtypeStruct((cfg.batch, cfg.seq + 1), jnp.int32)
    off = dataclasses.replace(cfg, weight_copies=False)
    with pytest.raises(ValueError, match="state holds the expert stacks' copies but the step "
                       "was built with weight_copies=False"):
        jax.eval_shape(lm.make_train_step(off, graphdef, tx, schedule), state, batch)
    _, bare, _ = lm.init_state(off, mesh, tx)
    with pytest.raises(ValueError, match="state lacks the expert stacks' copies"):
        jax.eval_shape(lm.make_train_step(cfg, graphdef, tx, schedule), bare, batch)


@pytest.mark.slow
def test_reduce_barrier_leaves_the_model_unchanged():
    """The tied weights run in a copy of the block: calling the model (eagerly, or
    closed over by jax.jit) neither changes its parameters nor fails."""
    cfg = lm.Config(batch=2, seq=16, n_layers=3, dtype="bfloat16", grad_reduce_lag=1)
    model = lm.MoELM(cfg, rngs=nnx.Rngs(0))

    def params():
        return {path: (v[...].dtype, np.asarray(v[...]))
                for path, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)}

    before = params()
    tokens = jnp.zeros((2, 16), jnp.int32)
    eager, _ = model(tokens)
    jitted, _ = jax.jit(lambda t: model(t))(tokens)
    after = params()
    assert before.keys() == after.keys() and len(before) > 0
    for path, (dtype, value) in before.items():
        assert after[path][0] == dtype == jnp.float32, path
        np.testing.assert_array_equal(after[path][1], value, err_msg=str(path))
    np.testing.assert_allclose(np.asarray(jitted, np.float32), np.asarray(eager, np.float32),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.slow
def test_bench_model_parts_candidates_compute_the_same_function():
    """examples/bench_model_parts.py: every candidate form of the router, of the
    attention block and of the norm gives the example's outputs and gradients (to
    f32 rounding; on a CPU the router's dot algorithms run in f32, so only a GPU
    run checks their bf16 passes), and each candidate is timed."""
    import bench_model_parts

    rows = bench_model_parts.run(small=True, warmup=0, repeats=1)
    names = {(r["part"], r["candidate"]) for r in rows}
    assert names == {("router", n) for n in bench_model_parts.ROUTER} | {
        ("attention", n) for n in ("current", "sliced_weights", "rotate_half")} | {
        ("norm", n) for n in ("current", "custom_vjp", "fused")}
    for r in rows:
        assert "error" not in r and r["max_rel_diff"] < 1e-5, r
        assert r["median_ms"] > 0


@pytest.mark.slow
def test_pgle_untimed_steps_are_the_profiled_and_recompiling_ones(tmp_path):
    """With PGLE on, JAX compiles at the first call, profiles it and the next
    runs - 1 calls, and recompiles at call runs + 1: `untimed_steps` is that last
    compiling call (observed here through JAX's compile events), and --pgle's
    throughput rows time only the steps after it. With dp > 1 the lag is 1."""
    from jax._src import monitoring

    calls, compiles = [0], []

    def on_event(event, duration, **kwargs):
        del duration, kwargs
        if "backend_compile" in event and calls[0]:
            compiles.append(calls[0])

    f = jax.jit(lambda x: jnp.sin(x) @ x)
    x = jnp.ones((32, 32))
    runs = jax.config.jax_pgle_profiling_runs
    monitoring.register_event_duration_secs_listener(on_event)
    try:
        jax.config.update("jax_enable_pgle", True)
        for call in range(1, runs + 4):
            calls[0] = call
            jax.block_until_ready(f(x))
        calls[0] = 0
        untimed = train_moe_lm.untimed_steps()
        log = train_moe_lm.main(["--steps", "10", "--eval-every", "10", "--pgle", "--out",
                                 str(tmp_path / "run"), "--no-checkpoint", *SMALL, "--dp", "2",
                                 "--log-every", "10"])
    finally:
        jax.config.update("jax_enable_pgle", False)
        monitoring.unregister_event_duration_listener(on_event)
    assert compiles == [1, runs + 1] and untimed == max(compiles), (compiles, untimed)
    assert train_moe_lm.untimed_steps() == 1  # PGLE off
    timed = {r["step"]: r["steps"] for r in log["throughput"]}
    assert timed == {10: 10 - untimed}, timed
    assert log["config"]["grad_reduce_lag"] == 1 and log["mesh"] == {"dp": 2, "ep": 1}


@pytest.mark.slow
def test_resume_on_another_mesh_summarizes_that_mesh(tmp_path):
    """A run resumed on another mesh logs each throughput interval with its mesh;
    the summary's tokens/s (and MFU's device count) are the last mesh's, the one
    log["mesh"] names, not a median over both meshes' intervals."""
    common = ["--steps", "10", "--eval-every", "10", "--out", str(tmp_path), *SMALL,
              "--log-every", "1"]
    train_moe_lm.main([*common, "--stop-after", "5"])  # SMALL: --dp 1
    log = train_moe_lm.main([*common, "--resume", "--dp", "2"])
    meshes = {r["step"]: r["mesh"] for r in log["throughput"]}
    assert {m["dp"] for s, m in meshes.items() if s <= 5} == {1}
    assert {m["dp"] for s, m in meshes.items() if s > 5} == {2} and log["mesh"]["dp"] == 2
    last = [r["tokens_per_s"] for r in log["throughput"] if r["step"] > 5]
    assert log["summary"]["tokens_per_s"] == statistics.median(last)


@pytest.mark.slow
def test_log_lines_wait_only_for_their_own_step(tmp_path, monkeypatch):
    """A log line of a step that neither evaluates nor saves is written after the
    next step has been dispatched: the host waits for the logged step only, and
    the GPU has the next one queued (a log line used to drain the pipeline). The
    throughput rows still cover every timed step once, and every step's losses
    are logged in order."""
    events = []
    batch_at = lm.batch_at

    def dispatching(data, step, cfg, **kw):
        if kw.get("stream", 0) == 0:  # training batches (the eval set has its own stream)
            events.append(("dispatch", step + 1))
        return batch_at(data, step, cfg, **kw)

    def printing(*args, **kw):
        events.append(("print", " ".join(map(str, args))))

    monkeypatch.setattr(train_moe_lm, "batch_at", dispatching)
    monkeypatch.setattr(train_moe_lm, "print", printing, raising=False)
    log = train_moe_lm.main(["--steps", str(STEPS), "--stop-after", "12", "--eval-every", "12",
                             "--out", str(tmp_path / "run"), *SMALL, "--log-every", "3",
                             "--ckpt-every", "12"])
    printed = {int(m.group(1)): i for i, (kind, text) in enumerate(events)
               if kind == "print" and (m := re.match(r"step (\d+): train loss", text))}
    assert sorted(printed) == [3, 6, 9, 12]
    assert [e for e in events if e[0] == "dispatch"] == [("dispatch", s) for s in range(1, 13)]
    for step in (3, 6, 9):  # step 12 evaluates: the pipeline drains there anyway
        assert printed[step] > events.index(("dispatch", step + 1)), (step, events)
    assert [r["step"] for r in log["train"]] == list(range(1, 13))
    rows = log["throughput"]
    assert [r["step"] for r in rows] == [3, 6, 9, 12]
    assert sum(r["steps"] for r in rows) == 12 - train_moe_lm.untimed_steps()


def usage_error(capsys, argv, message):
    """train_moe_lm's command line `argv` is a usage error (status 2) saying `message`."""
    assert_usage_error(capsys, lambda: train_moe_lm.parse_args(argv), message)


def test_profile_refuses_pgle(capsys):
    message = "--profile cannot be combined with PGLE (--pgle, JAX_ENABLE_PGLE)"
    usage_error(capsys, ["--profile", "p", "--pgle"], message)
    try:
        jax.config.update("jax_enable_pgle", True)  # as JAX_ENABLE_PGLE sets it
        usage_error(capsys, ["--profile", "p"], message)
    finally:
        jax.config.update("jax_enable_pgle", False)
    assert train_moe_lm.parse_args(["--profile", "p"]).profile == "p"


def test_profile_steps_needs_profile(capsys):
    """--profile-steps only sets how many steps --profile traces: alone it is a usage
    error, not a flag accepted and ignored."""
    usage_error(capsys, ["--profile-steps", "3"], "--profile-steps 3 needs --profile")
    assert train_moe_lm.parse_args(["--profile", "p", "--profile-steps", "3"]).profile_steps == 3
    assert train_moe_lm.parse_args(["--profile", "p"]).profile_steps == 5


def test_divergence_inside_a_log_interval_stops_the_run():
    """Every step logged since the last check is checked, not only the newest: a
    gradient norm of inf at step 7 of an interval ending at 10 stops the run and is
    named, though step 10's row is finite; rows up to `since` are not checked again."""
    rows = [{"step": s, "loss": 2.0, "grad_norm": 1.0} for s in range(1, 11)]
    rows[6]["grad_norm"] = math.inf
    log = {"train": rows, "eval": []}
    with pytest.raises(SystemExit, match=r"train grad norm is inf \(step 7\)"):
        train_moe_lm.check_finite(log, 10, since=5)
    train_moe_lm.check_finite(log, 10, since=7)  # step 7 was checked before
    rows[3]["loss"] = math.nan
    with pytest.raises(SystemExit, match=r"train loss is nan \(step 4\)"):
        train_moe_lm.check_finite(log, 10, since=0)
    log["eval"].append({"step": 10, "loss": math.nan})
    with pytest.raises(SystemExit, match=r"eval loss is nan"):
        train_moe_lm.check_finite(log, 10, since=10)


def test_dp_default_lag_only_where_measured():
    """The barrier's default (lag 1) is for dp > 1 with ep = 1 and a replicated
    optimizer, what was measured; elsewhere it stays off unless asked for. (That
    main() applies it: test_pgle_untimed_steps_... runs --dp 2 and finds lag 1.)"""
    assert train_moe_lm.default_grad_reduce_lag(dp=2, ep=1, shard_optimizer=False) == 1
    assert train_moe_lm.default_grad_reduce_lag(dp=8, ep=1, shard_optimizer=False) == 1
    for dp, ep, shard in ((2, 2, False), (2, 1, True), (1, 1, False), (1, 2, False)):
        assert train_moe_lm.default_grad_reduce_lag(dp=dp, ep=ep, shard_optimizer=shard) is None
    assert lm.Config().grad_reduce_lag == -1 == lm.PRESETS["tiny"].grad_reduce_lag  # off


@pytest.mark.slow
def test_resume_refuses_another_run_and_a_foreign_log(resumed_run, capsys):
    """--resume continues the run that wrote the checkpoints: a command line that
    changes its model, data or schedule is refused before anything is restored (it
    used to continue silently, with the log's config rewritten), and so is a
    log.json of another run; how the run reports may change (the resumed run of
    test_resume_is_bitwise_identical logs every step)."""
    out, _, resumed = resumed_run
    common = _resumed_common(out)
    identity = json.loads((out / "ckpt" / "run.json").read_text())
    assert identity["config"]["lr"] == lm.PRESETS["tiny"].lr
    assert "log_every" not in identity["config"] and identity["corpus"]["train_bytes"] > 0
    assert resumed["config"]["log_every"] == 1 and resumed["summary"]["steps"] == STEPS
    for flag, value, field in (("--lr", "1e-2", "config.lr"),
                               ("--steps", str(2 * STEPS), "config.steps"),
                               ("--seed", "3", "config.seed"), ("--seq", "32", "config.seq"),
                               ("--balance", "bias", "config.balance")):
        with pytest.raises(SystemExit, match=rf"differs from the run that wrote .* in "
                                             rf"{re.escape(field)}: "):
            train_moe_lm.main([*common, "--resume", flag, value])
    log_text = (out / "log.json").read_text()
    log = json.loads(log_text)
    (out / "log.json").write_text(json.dumps(dict(log, config=dict(log["config"], seed=7))))
    try:
        with pytest.raises(SystemExit, match=r"is not the log of the run .*config\.seed: 0 -> 7"):
            train_moe_lm.main([*common, "--resume"])
    finally:
        (out / "log.json").write_text(log_text)
    # A log or identity that is not JSON (a run killed while writing): a message
    # naming the file, before anything is restored.
    for name in ("log.json", "ckpt/run.json"):
        text = (out / name).read_text()
        (out / name).write_text(text[:len(text) // 2])
        try:
            with pytest.raises(SystemExit, match=rf"--resume: cannot read .*{re.escape(name)}"):
                train_moe_lm.main([*common, "--resume"])
        finally:
            (out / name).write_text(text)
    usage_error(capsys, ["--resume", "--overwrite"],
                "--resume continues the run in --out and --overwrite starts it over")


@pytest.mark.slow  # a model's state saved and restored twice
def test_a_resume_without_run_json_warns_once(tmp_path, capsys):
    """Checkpoints without ckpt/run.json (an older version's) cannot be checked
    against the command line: the first resume says so, and records its own
    identity there; the resumes after it are checked against that one and do not
    warn again."""
    cfg = lm.Config()
    mesh = lm.make_mesh(1, 1, jax.devices()[:1])
    tx, _ = lm.make_optimizer(cfg)
    _, state, shardings = lm.init_state(cfg, mesh, tx)
    corpus = lm.Corpus(np.zeros(1000, np.uint8), np.zeros(100, np.uint8), "r", 1, 1)
    identity = lm.run_identity(cfg, corpus)
    ckpt = tmp_path / "ckpt"
    manager = lm.checkpoint_manager(str(ckpt))
    lm.save_checkpoint(manager, state._replace(step=jnp.int32(3)))
    manager.wait_until_finished()
    manager.close()
    assert not (ckpt / "run.json").exists()

    def resume(identity):
        manager, restored, _ = lm.start_or_resume(
            str(ckpt), str(tmp_path / "log.json"), identity, state, shardings, save=True,
            resume=True, overwrite=False)
        manager.close()
        assert int(restored.step) == 3
        return capsys.readouterr().out

    outputs = [resume(identity) for _ in range(3)]
    assert [o.count("run.json is missing") for o in outputs] == [1, 0, 0], outputs
    assert json.loads((ckpt / "run.json").read_text()) == json.loads(json.dumps(identity))
    other = lm.run_identity(dataclasses.replace(cfg, lr=2 * cfg.lr), corpus)
    with pytest.raises(SystemExit, match=r"differs from the run that wrote .* in config\.lr: "):
        resume(other)


@pytest.mark.slow
def test_a_resume_with_other_eval_batches_says_its_losses_do_not_compare(tmp_path, capsys):
    """--eval-batches may change on resume; the eval losses the summary compares are
    then over different held-out batches, and it says so."""
    common = ["--steps", "10", "--eval-every", "5", "--out", str(tmp_path / "run"), *SMALL]
    train_moe_lm.main([*common, "--stop-after", "5"])
    log = train_moe_lm.main([*common, "--resume", "--eval-batches", "2"])
    assert [e["batches"] for e in log["eval"]] == [4, 4, 2]
    assert log["summary"]["eval_batches"] == [4, 2]
    assert "over 4 and 2 held-out batches: not comparable" in capsys.readouterr().out


@pytest.mark.parametrize("steps, every", [(8, 1), (2, 2)])
@pytest.mark.slow
def test_a_diverged_run_stops_without_a_checkpoint(tmp_path, steps, every):
    """A non-finite train loss or gradient norm ends the run before the next
    checkpoint: a diverged state would otherwise push the good checkpoints out (two
    are kept). A step's loss is computed before its update: at --lr 1e30 the second
    step's loss is still finite while its gradient norm, and so its update, are not,
    and with a checkpoint due at that step (steps 2) nothing of it may be saved."""
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"the (train loss|train grad norm|eval loss) is "
                                         r"(nan|inf|-inf) .*without saving"):
        train_moe_lm.main(["--steps", str(steps), "--eval-every", str(steps), "--out", str(out),
                           *SMALL, "--lr", "1e30", "--log-every", str(every),
                           "--ckpt-every", str(steps)])
    assert not (out / "ckpt" / str(steps)).exists()


@pytest.mark.slow  # a command-line run (20 s)
def test_a_stopped_run_keeps_the_checkpoint_it_saved(tmp_path):
    """Checkpoints are written in the background: a run that stops (here: diverged
    at step 2, its first step's checkpoint saved the step before) finishes writing
    the checkpoints it saved before it exits. Its log names step 1, so step 1 must be
    on disk, complete, for --resume."""
    out = tmp_path / "run"
    proc = _run_script("train_moe_lm.py", "--steps", "8", "--eval-every", "8", "--out", str(out),
                       *SMALL, "--lr", "1e30", "--log-every", "1", "--ckpt-every", "1")
    assert proc.returncode != 0 and "without saving a checkpoint" in proc.stderr, proc.stderr
    log = json.loads((out / "log.json").read_text())
    saved = max(r["step"] for r in log["train"])
    assert saved >= 1
    names = sorted(p.name for p in (out / "ckpt").iterdir() if p.name != "run.json")
    assert names and all(n.isdigit() for n in names), (names, proc.stderr)
    manager = lm.checkpoint_manager(str(out / "ckpt"))
    try:
        assert manager.latest_step() == saved
    finally:
        manager.close()


@pytest.mark.slow  # the module's trained run (14 s), shared with the slow tests
def test_refuses_to_overwrite_checkpoints_without_flag(straight_run):
    out, _ = straight_run
    with pytest.raises(SystemExit, match="--resume"):
        train_moe_lm.main(["--steps", "2", "--out", str(out), *SMALL])


def test_corpus_split_is_by_file_and_deterministic():
    a, b = lm.load_corpus(), lm.load_corpus()
    assert np.array_equal(a.train, b.train) and np.array_equal(a.eval, b.eval)
    assert a.root == lm.stdlib_root()
    # The held-out text does not occur in the training text (split by whole files).
    probe = bytes(a.eval[1000:1400])
    assert probe not in bytes(a.train)
    cfg = lm.Config(batch=4, seq=32)
    np.testing.assert_array_equal(lm.batch_at(a.train, 5, cfg), lm.batch_at(a.train, 5, cfg))
    assert not np.array_equal(lm.batch_at(a.train, 5, cfg), lm.batch_at(a.train, 6, cfg))
    assert lm.batch_at(a.train, 5, cfg).shape == (4, 33)


def _small_data_dir(path, text="x = 1\n" * 30):
    """A --data-dir of three files, one of them held out (crc32 of its path < 5 %)."""
    import zlib

    names = [f"f{i}.py" for i in range(200)]
    held = [n for n in names if zlib.crc32(n.encode()) % 100 < 5][:1]
    kept = [n for n in names if zlib.crc32(n.encode()) % 100 >= 5][:2]
    path.mkdir()
    for name in held + kept:
        (path / name).write_text(text)
    return held[0], kept


def test_data_dir_mistakes_are_messages_naming_the_path(tmp_path):
    """A --data-dir that is missing or a file, and a .py in it that cannot be read
    (a dangling link): a message naming the path (they were "too few .py files
    (0)" and a FileNotFoundError traceback)."""
    data = tmp_path / "data"
    held, _ = _small_data_dir(data)
    corpus = lm.load_corpus(str(data))
    assert (corpus.train_files, corpus.eval_files) == (2, 1)
    for bad in (tmp_path / "missing", data / held):
        with pytest.raises(SystemExit, match=rf"{re.escape(str(bad))} is not a directory"):
            lm.load_corpus(str(bad))
    (data / "gone.py").symlink_to(tmp_path / "nowhere.py")
    with pytest.raises(SystemExit, match=r"cannot read .*gone\.py"):
        lm.load_corpus(str(data))


def test_a_seq_too_long_for_the_corpus_says_the_longest_that_fits():
    """check_seq's message names the longest --seq that `batch_at` can draw from the
    shorter part: a window is seq + 1 bytes, so 10 bytes fit --seq 9."""
    corpus = lm.Corpus(np.arange(1000, dtype=np.uint8), np.arange(10, dtype=np.uint8), "r", 1, 1)
    with pytest.raises(SystemExit, match=r"held-out part of the corpus has 10 bytes.*"
                                         r"--seq 9 at most"):
        lm.check_seq(10, corpus)
    lm.check_seq(9, corpus)
    windows = lm.batch_at(corpus.eval, 0, lm.Config(batch=4, seq=9))
    assert windows.shape == (4, 10) and (np.diff(windows, axis=1) == 1).all()
    with pytest.raises(SystemExit, match=r"held-out part of the corpus has 1 bytes$"):
        lm.check_seq(1, corpus._replace(eval=corpus.eval[:1]))


def test_every_byte_after_the_first_is_a_target():
    """`batch_at`'s windows cover the whole part they are drawn from: every byte but
    the first is some window's target (the last byte never was: the starts stopped
    one short), no window reads past the end, and a batch depends only on (seed,
    stream, step)."""
    data = np.arange(20, dtype=np.uint8)  # a byte's value is its position
    cfg = lm.Config(batch=16, seq=8)
    targets = set()
    for step in range(50):
        windows = lm.batch_at(data, step, cfg)
        assert windows.shape == (16, 9) and (np.diff(windows, axis=1) == 1).all()
        targets.update(windows[:, 1:].ravel().tolist())
        np.testing.assert_array_equal(windows, lm.batch_at(data, step, cfg))
    assert targets == set(range(1, 20))
    assert not np.array_equal(lm.batch_at(data, 0, cfg), lm.batch_at(data, 0, cfg, stream=1))
    # A part of exactly seq + 1 bytes holds one window: itself.
    lm.check_seq(19, lm.Corpus(data, data, "r", 1, 1))
    np.testing.assert_array_equal(lm.batch_at(data, 0, lm.Config(batch=2, seq=19)),
                                  np.stack([data, data]))


@pytest.mark.parametrize("preset", ["h200", "olmoe"])
def test_gpu_presets_trace(preset):
    cfg = lm.PRESETS[preset]
    info = lm.trace_only(cfg)
    assert info["params"] == lm.param_counts(cfg)["total"]
    assert 1e9 < info["params"] < 2e9
    assert info["metrics"]["loss"] == ((), "float32")
    # Model FLOPs per token: 6 * active matmul weights + attention.
    n = cfg.n_layers * (4 * cfg.d_model ** 2 + cfg.d_model * cfg.n_experts
                        + cfg.top_k * 3 * cfg.d_model * cfg.expert_ffn) + cfg.d_model * 256
    assert info["flops_per_token"] == 6 * n + 12 * cfg.n_layers * cfg.d_model * cfg.seq


def test_param_counts_match_the_model():
    from flax import nnx

    cfg = lm.Config(shared_ffn=32)
    model = lm.abstract_model(cfg)
    n = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == lm.param_counts(cfg)["total"]


def _initial_params(cfg: "lm.Config") -> list[np.ndarray]:
    """init_state's parameters for ``cfg`` on one device, as numpy arrays."""
    tx, _ = lm.make_optimizer(cfg)
    _, state, _ = lm.init_state(cfg, lm.make_mesh(1, 1, jax.devices()[:1]), tx)
    return [np.asarray(a) for a in jax.tree.leaves(state.params)]


def test_seeds_2_to_the_32_apart_start_from_different_parameters():
    """nnx.Rngs(seed) keeps a seed's low 32 bits (jax_enable_x64 off): --seed 1 and
    --seed 2^32 + 1 started from the same parameters. Now each seed of [0, 2^63) has
    its own; one seed twice gives the same ones."""
    small = lm.Config(d_model=32, n_layers=1, n_heads=2, n_experts=4, expert_ffn=16)
    args = train_moe_lm.parse_args(["--seed", str(2**32 + 1)])
    cfg = train_moe_lm.config_from_args(args)
    assert cfg.seed == 2**32 + 1  # the command line keeps every bit
    first, again = (_initial_params(dataclasses.replace(small, seed=1)) for _ in range(2))
    high = _initial_params(dataclasses.replace(small, seed=2**32 + 1))
    top = _initial_params(dataclasses.replace(small, seed=2**63 - 1))
    low = _initial_params(dataclasses.replace(small, seed=2**32 - 1))
    assert len(first) == len(high) > 0
    for a, b in zip(first, again):
        assert_bitwise(a, b, "one seed twice")
    for other, seed in ((high, "2^32 + 1"), (top, "2^63 - 1"), (low, "2^32 - 1")):
        assert all(a.shape == b.shape for a, b in zip(first, other))
        # every random matrix differs (the norms' scales start at 1 whatever the seed)
        random = [(a, b) for a, b in zip(first, other) if np.unique(a).size > 1]
        assert random and not any(np.array_equal(a, b) for a, b in random), seed


def test_seed_key_is_the_64_bit_jax_key():
    """The key the example's parameters come from is ``jax.random.key(seed)`` as JAX
    makes it with 64-bit integers on, and, below 2^32, the key it makes without
    them (what nnx.Rngs(seed) used): a run of such a seed keeps its parameters."""
    from mok_jax._src.seeds import seed_key
    for seed in (0, 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**40 + 5, 2**63 - 1):
        with jax.enable_x64(True):
            want = np.asarray(jax.random.key_data(jax.random.key(seed)))
        np.testing.assert_array_equal(jax.random.key_data(seed_key(seed)), want, str(seed))
        if seed < 2**32:
            np.testing.assert_array_equal(jax.random.key_data(jax.random.key(seed)), want)
    for bad in (-1, 2**63):
        with pytest.raises(ValueError, match=rf"seed must be an integer in \[0, 2\^63\), "
                                             rf"got {bad}"):
            seed_key(bad)
    with pytest.raises(TypeError):
        seed_key(1.5)


def test_a_config_seed_out_of_range_is_refused_before_init():
    """A Config built in code (no command line) with a negative seed built a model
    from jax.random.key(-1) and failed later in numpy's batch draw."""
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\^63\), got -1"):
        _initial_params(lm.Config(d_model=32, n_layers=1, n_heads=2, n_experts=4,
                                  expert_ffn=16, seed=-1))


# --------------------------------------------------------------------------------------
# Command lines
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("script", ["train_moe_lm.py", "mesh_experiments.py"])
def test_help(script):
    proc = _run_script(script, "--help", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout
    for flag in {"train_moe_lm.py": ["--preset", "--resume", "--dp", "--ep", "--out"],
                 "mesh_experiments.py": ["--host-devices", "--mode", "--out"]}[script]:
        assert flag in proc.stdout


@pytest.mark.parametrize("flag", ["--steps", "--batch", "--seq", "--ep", "--dp", "--log-every",
                                  "--eval-every", "--eval-batches", "--host-devices",
                                  "--profile-steps"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_train_refuses_a_count_below_one_as_a_usage_error(flag, value, capsys):
    """A count below 1 is a usage error naming the flag (was a ZeroDivisionError for
    --ep 0, a numpy traceback for --batch 0)."""
    with pytest.raises(SystemExit) as exit_info:
        train_moe_lm.parse_args([flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and f"must be a positive integer, got {value}" in err


@pytest.mark.parametrize("flag, value, why", [
    ("--lr", "-3e-3", "must be a finite number above 0"), ("--lr", "nan", "above 0"),
    ("--peak-tflops", "0", "above 0"), ("--peak-tflops", "inf", "above 0"),
    ("--seed", "-1", r"must be an integer in \[0, 2\^63\)"),
    ("--seed", str(2**63), r"\[0, 2\^63\)"),
    ("--grad-reduce-lag", "-7", r"must be -1 \(off\) or a lag >= 0")])
def test_train_refuses_bad_numbers_as_usage_errors(flag, value, why, capsys):
    """A negative or NaN learning rate trained (ascent, or a NaN checkpoint) and
    exited 0; a seed numpy refuses was a traceback after the model's init."""
    with pytest.raises(SystemExit) as exit_info:
        train_moe_lm.parse_args([f"{flag}={value}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and re.search(why, err), err


def test_train_refuses_what_cannot_run_before_building(tmp_path):
    """An --out that is a file, a GPU-only backend on CPU devices and a --seq longer
    than the corpus: one message each, before any model is built."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    common = [*SMALL, "--no-progress", "--no-checkpoint"]
    with pytest.raises(SystemExit, match=r"--out: .*a_file is a file, not a directory"):
        train_moe_lm.main([*common, "--out", str(a_file)])
    with pytest.raises(SystemExit, match=r"--profile: .*a_file is a file, not a directory"):
        train_moe_lm.main([*common, "--profile", str(a_file), "--out", str(tmp_path / "p")])
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "ckpt").write_text("")  # where the checkpoints go
    with pytest.raises(SystemExit, match=r"--out: .*ckpt is a file, not a directory"):
        train_moe_lm.main([*SMALL, "--no-progress", "--out", str(tmp_path / "d")])
    for flag, value in (("--attention", "cudnn"), ("--moe-backend", "fused")):
        with pytest.raises(SystemExit, match=rf"{flag} {value} needs a GPU; .* are cpu"):
            train_moe_lm.main([*common, flag, value, "--out", str(tmp_path / "b")])
    with pytest.raises(SystemExit, match=r"--seq 100000000 needs windows of seq \+ 1 bytes"):
        train_moe_lm.main([*common, "--seq", "100000000", "--out", str(tmp_path / "c")])
    with pytest.raises(SystemExit, match=r"--grad-reduce-lag 2 must be below the preset's 2 "):
        train_moe_lm.main([*common, "--grad-reduce-lag", "2", "--out", str(tmp_path / "e")])
    # --trace-only checks the same before tracing (it had failed deep in the trace).
    for flag, value in (("--attention", "cudnn"), ("--moe-backend", "fused")):
        with pytest.raises(SystemExit, match=rf"{flag} {value} needs a GPU; .* are cpu"):
            train_moe_lm.main(["--trace-only", flag, value])


def test_a_refused_mesh_leaves_no_out_behind(tmp_path):
    """A --dp/--ep that cannot run (more devices than visible, a batch that dp*ep
    does not split, an ep that does not divide the experts), like a --seq or a
    --grad-reduce-lag that cannot, is refused before anything is written: a new
    --out (and the folder above it) is not created, and an existing one keeps what
    it held, nothing added."""
    cases = [(["--dp", "4", "--ep", "4"], r"--dp 4 --ep 4 needs 16 devices; 8 visible"),
             (["--dp", "3"], r"--batch 8 must be a multiple of dp\*ep = 3"),
             (["--dp", "1", "--ep", "3", "--batch", "3"], r"--ep 3 must divide the preset's 8"),
             (["--seq", "100000000"], r"--seq 100000000 needs windows of seq \+ 1 bytes"),
             (["--grad-reduce-lag", "2"], r"--grad-reduce-lag 2 must be below")]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("kept")
    for i, (flags, message) in enumerate(cases):
        for out in (tmp_path / f"new{i}" / "run", mine):
            with pytest.raises(SystemExit, match=message):
                train_moe_lm.main([*SMALL, *flags, "--out", str(out)])
            assert not (tmp_path / f"new{i}").exists(), flags
            assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"], flags
    assert (mine / "notes.txt").read_text() == "kept"


@pytest.mark.slow  # one 2-step run with a checkpoint
def test_a_run_without_checkpoints_keeps_another_runs_log(tmp_path):
    """A --no-checkpoint run into an --out that holds a run's checkpoints would
    replace that run's log.json, after which the run cannot resume: refused unless
    --overwrite, which then removes the checkpoints, as a fresh run's does."""
    out = tmp_path / "run"
    common = [*SMALL, "--no-progress", "--eval-every", "2", "--out", str(out)]
    train_moe_lm.main([*common, "--steps", "2"])
    log_text = (out / "log.json").read_text()
    assert sorted(p.name for p in (out / "ckpt").iterdir() if p.name.isdigit()) == ["2"]
    with pytest.raises(SystemExit, match=r"ckpt holds checkpoints \(latest step 2\): this run "
                                         r"saves none but would replace their run's log"):
        train_moe_lm.main([*common, "--steps", "1", "--no-checkpoint"])
    assert (out / "log.json").read_text() == log_text
    log = train_moe_lm.main([*common, "--steps", "1", "--no-checkpoint", "--overwrite"])
    assert log["summary"]["steps"] == 1 and not (out / "ckpt").exists()


def test_train_mesh_mistakes_are_messages_not_tracebacks(tmp_path, capsys):
    """--ep that does not divide the experts, and --trace-only (one device, no mesh)
    with mesh flags: a message before anything is built."""
    with pytest.raises(SystemExit, match=r"--ep 3 must divide the preset's 8 experts"):
        train_moe_lm.main(["--ep", "3", "--dp", "1", "--batch", "3", "--out",
                           str(tmp_path / "a"), *SMALL[4:-3], "--no-progress"])
    for flags in (["--dp", "2"], ["--ep", "2"], ["--host-devices", "4"],
                  ["--shard-optimizer"]):
        usage_error(capsys, ["--trace-only", *flags], "--trace-only traces the one-device step")
    # It reads, runs and writes nothing either: flags about what a run reads, how it
    # runs and where it writes are refused, not ignored.
    for flags in (["--resume"], ["--out", str(tmp_path)], ["--profile", str(tmp_path)],
                  ["--overwrite"], ["--data-dir", str(tmp_path)], ["--stop-after", "3"],
                  ["--pgle"], ["--peak-tflops", "500"]):
        usage_error(capsys, ["--trace-only", *flags],
                    "--trace-only runs nothing and writes nothing")


@pytest.mark.slow  # subprocesses that each import jax
def test_mesh_experiments_refuses_more_devices_than_visible(tmp_path):
    proc = _run_script("mesh_experiments.py", "--host-devices", "2", "--devices", "3",
                       "--out", str(tmp_path), timeout=120)
    assert proc.returncode != 0 and "--devices 3: only 2 visible" in proc.stderr, proc.stderr
    proc = _run_script("mesh_experiments.py", "--repeats", "0", timeout=120)
    assert proc.returncode == 2 and "must be a positive integer, got 0" in proc.stderr
    proc = _run_script("bench_model_parts.py", "--small", "--repeats", "0", timeout=120)
    assert proc.returncode == 2 and "must be a positive integer, got 0" in proc.stderr
    # An --out it cannot write, and a --seq longer than the corpus: refused before
    # any mesh runs.
    (tmp_path / "a_file").write_text("")
    proc = _run_script("mesh_experiments.py", "--host-devices", "2", "--out",
                       str(tmp_path / "a_file"), timeout=120)
    assert proc.returncode != 0 and "a_file is a file, not a directory" in proc.stderr, proc.stderr
    proc = _run_script("mesh_experiments.py", "--host-devices", "2", "--seq", "100000000",
                       "--out", str(tmp_path / "b"), timeout=120)
    assert proc.returncode != 0 and "--seq 100000000 needs windows" in proc.stderr, proc.stderr
    proc = _run_script("mesh_experiments.py", "--host-devices", "2", "--batch", "3",
                       "--out", str(tmp_path / "c" / "d"), timeout=120)
    assert proc.returncode != 0 and "--batch 3 must be a multiple" in proc.stderr, proc.stderr
    # A refused command line creates nothing.
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_quickstart_refuses_a_capacity_factor_that_is_not_positive(capsys):
    import quickstart  # noqa: PLC0415  (examples/, on sys.path)
    for value in ("0", "-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            quickstart.main(["--capacity-factor", value])
        assert "must be a finite number above 0" in capsys.readouterr().err


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
@pytest.mark.slow
def test_quickstart_agrees_with_the_reference(dtype, tol, capsys):
    """examples/quickstart.py as the README lists it: every relative error against
    the reference within the contract's tolerance of its dtype."""
    import quickstart

    errors = quickstart.main(["--tokens", "64", "--experts", "4", "--hidden", "32", "--ffn",
                              "48", "--dtype", dtype, "--capacity-factor", "1.0"])
    assert set(errors) == {"y", "dx", "dexpert_weights", "dw_gate_up", "dw_down"}
    assert all(0 <= e < tol for e in errors.values()), errors
    for bad, message in ((["--top-k", "5", "--experts", "4"], "--top-k 5 exceeds --experts 4"),
                         (["--tokens", "0"], "must be a positive integer, got 0")):
        with pytest.raises(SystemExit):
            quickstart.main(bad)
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_train_smoke_command_line(tmp_path):
    proc = _run_script("train_moe_lm.py", "--host-devices", "2", "--dp", "2", "--steps", "4",
                       "--batch", "4", "--seq", "32", "--eval-every", "4", "--eval-batches", "1",
                       "--log-every", "2", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dp=2 ep=1 on 2 cpu device(s)" in proc.stdout
    assert "done: step 4" in proc.stdout
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["mesh"] == {"dp": 2, "ep": 1} and len(log["train"]) == 4
    assert (tmp_path / "loss.png").exists() and (tmp_path / "ckpt" / "4").exists()


@pytest.mark.slow
def test_mesh_experiments_smoke(tmp_path, capsys):
    """mesh_experiments.py on two of this process's host devices (its command line
    is test_help's and test_mesh_experiments_refuses_more_devices_than_visible's),
    in its shard_map mode: the ep mesh against the dp baseline, the report, table
    and plot. (Its jit mode is left out: the model's loss and gradients under
    plain jit on dp and dp x ep meshes are inside the train steps of
    test_reduce_barrier_... and test_weight_copies_....)"""
    import mesh_experiments

    result = mesh_experiments.main(["--devices", "2", "--batch", "4", "--seq", "32",
                                    "--repeats", "1", "--mode", "shard_map",
                                    "--out", str(tmp_path)])
    stdout = capsys.readouterr().out
    assert result["ok"], stdout
    report = json.loads((tmp_path / "mesh.json").read_text())
    assert report["devices"] == 2
    rows = report["rows"]
    assert [(r["mode"], r["dp"], r["ep"]) for r in rows] == [
        ("shard_map", 2, 1), ("shard_map", 1, 2)]
    assert [(r["status"], r["vs"]) for r in rows] == [("ok", "baseline"), ("ok", "(2,1)")]
    for r in rows:
        assert r["step_s"] > 0 and math.isfinite(r["loss"])
        if r["vs"] != "baseline":
            # Same tokens on every device: only the experts move. Loss and logits are
            # the same bits; gradients agree to summation order at least.
            assert r["outputs_bitwise"], r
            assert r["max_rel_diff"] < 1e-5, r
    assert "| mode | dp | ep |" in stdout
    assert (tmp_path / "mesh.png").stat().st_size > 5_000


def test_factorisations():
    import mesh_experiments

    assert mesh_experiments.factorisations(8) == [(8, 1), (4, 2), (2, 4), (1, 8)]
    assert mesh_experiments.factorisations(6) == [(6, 1), (3, 2), (2, 3), (1, 6)]
    assert mesh_experiments.factorisations(1) == [(1, 1)]


def test_mesh_experiments_fails_a_mesh_whose_gradient_is_not_finite():
    """A row fails when its largest relative difference from the baseline exceeds
    GRAD_RTOL. A gradient with a NaN or an inf where the baseline's is finite (or
    the other way round) is such a difference, whichever leaf it is in; a row that
    differs only in summation order is not."""
    import mesh_experiments

    rng = np.random.default_rng(0)
    base = {"loss": np.float32(2.5), "logits": rng.normal(size=(2, 3)).astype(np.float32),
            "grad/a": rng.normal(size=(4, 4)).astype(np.float32),
            "grad/b": rng.normal(size=(8,)).astype(np.float32)}
    rounding = dict(base, **{"grad/a": np.nextafter(base["grad/a"], np.float32(np.inf))})
    row = {}
    mesh_experiments.compare(row, rounding, base)
    assert row["differ"] == ["grad/a"] and row["outputs_bitwise"]
    assert 0 < row["max_rel_diff"] <= mesh_experiments.GRAD_RTOL
    for leaf in ("grad/a", "grad/b"):
        for bad in (np.nan, np.inf):
            broken = dict(rounding, **{leaf: rounding[leaf].copy()})
            broken[leaf][1] = bad
            for result, baseline in ((broken, base), (base, broken)):
                row = {}
                mesh_experiments.compare(row, result, baseline)
                assert row["outputs_bitwise"] and not row["grads_bitwise"]
                # what run() fails a row on
                assert row["max_rel_diff"] > mesh_experiments.GRAD_RTOL, (leaf, bad, row)


@pytest.mark.slow
def test_profile_attributes_the_step_to_the_parts_of_the_model(tmp_path, monkeypatch):
    """--profile: the traced steps' device time goes to the model's parts through the
    name scopes, not to "other"; the MoE, attention and norm rows have per-layer
    times; the shares and the host gap add up to the step."""
    prof = tmp_path / "prof"
    # --profile adds a flag to XLA_FLAGS for the process; keep it to this test. (In
    # this process the backend is already up, so XLA's CUDA graphs stay on: on a GPU
    # the graph-replayed kernels then count as "other".)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    log = train_moe_lm.main(["--steps", "10", "--eval-every", "10", "--out",
                             str(tmp_path / "run"), "--no-checkpoint", "--profile", str(prof),
                             "--profile-steps", "4", *SMALL])
    result = json.loads((prof / "breakdown.json").read_text())
    assert log["profile"] == result and result["steps"] == 4 and result["kernels"] > 0
    rows = {r["part"]: r for r in result["rows"]}
    parts = (("MoE layer (mok_jax)", "attention", "norms", "residual adds", "optimizer",
              "embedding + loss", "router + aux losses") if jax.default_backend() == "cpu"
             else ("MoE layer (mok_jax)",))  # FFI calls never run inside CUDA graphs
    for part in parts:
        assert rows[part]["ms_per_step"] > 0, part
    assert rows["MoE layer (mok_jax)"]["ms_per_layer"] == pytest.approx(
        rows["MoE layer (mok_jax)"]["ms_per_step"] / lm.PRESETS["tiny"].n_layers)
    if jax.default_backend() == "cpu":
        assert rows.get("other", {"share": 0})["share"] < 0.05, rows.get("other")
        assert result["kernels_without_op_name"] < 0.1 * result["kernels"]
    busy_share = result["busy_ms_per_step"] / result["step_ms"]
    assert rows["host gap (no kernel running)"]["share"] == pytest.approx(1 - busy_share, abs=1e-6)
    # Throughput leaves the traced steps out (steps 4-7 here: step 1 compiles, 2 and 3
    # warm up, then four are traced): no rate for the interval ending inside them,
    # and the next interval times only the steps after them (8, 9, 10).
    timed = {r["step"]: r["steps"] for r in log["throughput"]}
    assert 5 not in timed and timed[10] == 3, timed


def test_profile_names_a_fusion_without_metadata_by_the_computation_it_calls():
    """XLA:CPU's YNNPACK fusions carry no metadata on their own line: the profile
    takes the op_name of the fused computation's ROOT, or else its most common
    one, so that their time goes to the model's part and not to "other"."""
    import step_profile

    hlo = """HloModule jit_train_step
%fused_computation.17 (param_0.32: f32[], param_1.32: f32[128,384]) -> f32[4,12] {
  %param_1.32 = f32[128,384]{1,0} parameter(1)
  %square.8 = f32[128,384]{1,0} multiply(%param_1.32, %param_1.32), metadata={op_name="jit(train_step)/optimizer/square"}
  %param_0.32 = f32[] parameter(0)
  ROOT %reduce-window.33 = f32[4,12]{1,0} reduce-window(%square.8, %param_0.32), window={size=32x32 stride=32x32}, to_apply=%region_60.74
}

%fused_computation.3 (p0: f32[8,128], p1: f32[8,128]) -> f32[8,128] {
  %p0 = f32[8,128]{1,0} parameter(0)
  %p1 = f32[8,128]{1,0} parameter(1)
  %m = f32[8,128]{1,0} multiply(%p0, %p1), metadata={op_name="jit(train_step)/norm/mul"}
  ROOT %a = f32[8,128]{1,0} add(%m, %p1), metadata={op_name="jit(train_step)/residual/add"}
}

ENTRY %main.9 (x: f32[128,384], y: f32[8,128]) -> (f32[4,12], f32[8,128]) {
  %x = f32[128,384]{1,0} parameter(0)
  %y = f32[8,128]{1,0} parameter(1)
  %constant.166 = f32[] constant(0)
  %ynn_fusion.17 = f32[4,12]{1,0} fusion(%constant.166, %x), kind=kCustom, calls=%fused_computation.17, backend_config={"fusion_config":{"kind":"__ynn_fusion"}}
  %add_fusion = f32[8,128]{1,0} fusion(%y, %y), kind=kLoop, calls=%fused_computation.3
  %dot.1 = f32[8,128]{1,0} dot(%y, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(train_step)/attention/dot_general"}
  ROOT %tuple = (f32[4,12]{1,0}, f32[8,128]{1,0}) tuple(%ynn_fusion.17, %add_fusion)
}
"""
    names = step_profile.op_names(hlo)
    assert names["ynn_fusion.17"] == "jit(train_step)/optimizer/square"  # the only one inside
    assert names["add_fusion"] == "jit(train_step)/residual/add"  # its ROOT's
    assert names["dot.1"] == "jit(train_step)/attention/dot_general"  # its own
    assert "constant.166" not in names and "tuple" not in names
    assert step_profile.part_of("ynn_fusion.17", names["ynn_fusion.17"], "") == "optimizer"
    assert step_profile.part_of("add_fusion", names["add_fusion"], "") == "residual adds"


def test_profile_times_are_per_device():
    """A data-parallel trace holds every GPU's kernels: the parts are each device's
    milliseconds (here two devices ran the same kernels, shifted in time, so the
    parts equal one device's), and the busy time is per device, not the union over
    both GPUs' timelines."""
    import step_profile

    names = {"fusion.1": "jit(train_step)/attention/dot", "cc.2": "jit(train_step)/mok_jax/moe"}
    one = [(0.0, 3e6, "k1", "fusion.1"), (3e6, 8e6, "k2", "cc.2")]  # 3 ms, 5 ms
    kernels = [(s, e, k, op, "/device:GPU:0") for s, e, k, op in one]
    kernels += [(s + 1e6, e + 1e6, k, op, "/device:GPU:1") for s, e, k, op in one]
    result = step_profile.aggregate(kernels, names, steps=1, wall_s=0.010, n_layers=1)
    rows = {r["part"]: r for r in result["rows"]}
    assert result["devices"] == 2
    assert rows["attention"]["ms_per_step"] == pytest.approx(3.0)
    assert rows["MoE layer (mok_jax)"]["ms_per_step"] == pytest.approx(5.0)
    assert result["busy_ms_per_step"] == pytest.approx(8.0)  # not 9 (the union)
    assert rows["host gap (no kernel running)"]["ms_per_step"] == pytest.approx(2.0)
    alone = step_profile.aggregate(kernels[:2], names, steps=1, wall_s=0.010, n_layers=1)
    assert {r["part"]: r["ms_per_step"] for r in alone["rows"]} == pytest.approx(
        {r["part"]: r["ms_per_step"] for r in result["rows"]})


def test_profile_shows_an_imbalance_between_devices():
    """Two devices with different MoE loads (an expert-parallel step): each part's
    row keeps every device's milliseconds, the mean is their mean, and the table
    prints the range."""
    import step_profile

    names = {"fusion.1": "jit(train_step)/attention/dot", "cc.2": "jit(train_step)/mok_jax/moe"}
    kernels = [(0.0, 3e6, "k1", "fusion.1", "/device:GPU:0"),
               (3e6, 5e6, "k2", "cc.2", "/device:GPU:0"),       # MoE 2 ms on GPU 0
               (0.0, 3e6, "k1", "fusion.1", "/device:GPU:1"),
               (3e6, 9e6, "k2", "cc.2", "/device:GPU:1")]       # MoE 6 ms on GPU 1
    result = step_profile.aggregate(kernels, names, steps=1, wall_s=0.010, n_layers=1)
    rows = {r["part"]: r for r in result["rows"]}
    assert result["device_names"] == ["/device:GPU:0", "/device:GPU:1"]
    assert rows["MoE layer (mok_jax)"]["ms_per_step_by_device"] == pytest.approx([2.0, 6.0])
    assert rows["MoE layer (mok_jax)"]["ms_per_step"] == pytest.approx(4.0)
    assert rows["attention"]["ms_per_step_by_device"] == pytest.approx([3.0, 3.0])
    assert result["busy_ms_per_step_by_device"] == pytest.approx([5.0, 9.0])
    gap = rows["host gap (no kernel running)"]
    assert gap["ms_per_step_by_device"] == pytest.approx([5.0, 1.0])
    assert gap["ms_per_step"] == pytest.approx(3.0)
    assert "| MoE layer (mok_jax) | 4.00 | 40.0% | 4.00 | 2.00-6.00 |" in step_profile.table(result)
    single = step_profile.aggregate(kernels[:2], names, steps=1, wall_s=0.010, n_layers=1)
    assert "min-max" not in step_profile.table(single)


def test_profile_lists_the_kernels_that_take_the_most_time():
    """`top_kernels` sums each kernel's launches by part, per step and per device,
    longest first, and `top_table` prints them."""
    import step_profile

    names = {"fusion.1": "jit(train_step)/norm/mul", "cc.2": "jit(train_step)/mok_jax/moe"}
    gemm = "cutlass_" + "x" * 200 + "_instance_A"  # long names differ at the end
    one = [(0.0, 1e6, "norm_k", "fusion.1"), (1e6, 2e6, "norm_k", "fusion.1"),
           (2e6, 5e6, gemm, "cc.2"), (5e6, 5.5e6, "plan_k", "cc.2")]
    kernels = [(s, e, k, op, "/device:GPU:0") for s, e, k, op in one]
    # A second device ran the same kernels, one of them twice as long.
    kernels += [(s, e + (1e6 if k == "norm_k" else 0.0), k, op, "/device:GPU:1")
                for s, e, k, op in one]
    result = step_profile.aggregate(kernels, names, steps=2, wall_s=0.020, n_layers=1)
    top = [(k["part"], k["kernel"], k["ms_per_step"], k["launches_per_step"])
           for k in result["top_kernels"]]
    assert top == [("norms", "norm_k", pytest.approx(1.5), 1.0),
                   ("MoE layer (mok_jax)", gemm, pytest.approx(1.5), 0.5),
                   ("MoE layer (mok_jax)", "plan_k", pytest.approx(0.25), 0.5)]
    table = step_profile.top_table(result, n=2)
    assert "| norms | norm_k | 1.500 | 1 |" in table
    assert "_instance_A | 1.500 | 0.5 |" in table and "x" * 100 not in table
    assert "plan_k" not in table


def test_attention_auto_is_cudnn_only_on_a_gpu_in_16_bits():
    on_gpu = jax.default_backend() == "gpu"
    assert lm.attention_implementation("auto", jnp.bfloat16) == ("cudnn" if on_gpu else "xla")
    assert lm.attention_implementation("auto", jnp.float32) == "xla"
    assert lm.attention_implementation("xla", jnp.bfloat16) == "xla"
    assert lm.attention_implementation("auto", jnp.bfloat16, head_dim=12) == "xla"
    assert lm.attention_implementation("auto", jnp.bfloat16, head_dim=256) == "xla"


def test_profile_attributes_idle_time_to_the_kernels_around_it():
    """`gaps` sums the intervals in which no kernel runs by the kernel that ended
    last before them and the one that ends them (overlapping kernels leave no
    gap), per step, longest total first, and `gap_table` prints them."""
    import step_profile

    names = {"fusion.1": "jit(train_step)/norm/mul", "cc.2": "jit(train_step)/mok_jax/moe",
             "cc.3": "jit(train_step)/mok_jax/moe"}
    one = [(0.0, 1e6, "norm_k", "fusion.1"),
           (1.2e6, 2e6, "moe_a", "cc.2"),     # 0.2 ms after the norm
           (1.5e6, 3e6, "moe_b", "cc.3"),     # overlaps moe_a: no gap, and ends last
           (2.5e6, 2.8e6, "moe_a", "cc.2"),   # inside moe_b: no gap
           (3.5e6, 4e6, "norm_k", "fusion.1"),  # 0.5 ms after moe_b, not after moe_a
           (4.1e6, 5e6, "moe_a", "cc.2")]     # 0.1 ms after the norm
    kernels = [(s, e, k, op, "/device:GPU:0") for s, e, k, op in one]
    result = step_profile.aggregate(kernels, names, steps=2, wall_s=0.020, n_layers=1)
    gaps = [(g["before"], g["after"], g["ms_per_step"], g["gaps_per_step"], g["longest_us"])
            for g in result["gaps"]]
    assert gaps == [
        ("MoE layer (mok_jax): cc.3", "norms: fusion.1", pytest.approx(0.25), 0.5,
         pytest.approx(500.0)),
        ("norms: fusion.1", "MoE layer (mok_jax): cc.2", pytest.approx(0.15), 1.0,
         pytest.approx(200.0))]
    assert result["idle_ms_per_step"] == pytest.approx((0.2 + 0.5 + 0.1) / 2)
    table = step_profile.gap_table(result)
    assert "| MoE layer (mok_jax): cc.3 | norms: fusion.1 | 0.250 | 0.5 | 500.0 |" in table
    assert "idle between kernels: 0.40 ms a step" in table


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.slow
def test_rope_and_qkv_projection_compute_the_textbook_functions(dtype):
    """The attention's RoPE (a flip of each head's halves) and qkv projection (two
    GEMMs forward, a backward of its own) against their textbook forms, the
    halves split and concatenated and one ``x @ kernel`` split in three: the same
    values and gradients. Each pair is two different XLA programs (a flip against
    a split, two GEMMs and a custom backward against one GEMM and autodiff), whose
    summation order and FMA contraction XLA chooses: equal to the contract's
    tolerances, not bitwise (the kernel's gradient differed in its last bits on
    AVX-512 CPUs)."""
    def rope_textbook(x, base=10000.0):
        _, seq, _, dim = x.shape
        inv_freq = base ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
        angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]
        cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x.dtype)

    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (2, 16, 4, 32), dtype)
    ct = jax.random.normal(keys[1], x.shape, dtype)
    got, vjp = jax.vjp(lm.rope, x)
    want, vjp_want = jax.vjp(rope_textbook, x)
    assert_close(got, want, dtype, what="rope")
    assert_close(vjp(ct)[0], vjp_want(ct)[0], dtype, what="rope's gradient")
    # rotation: each head's halves as a complex number times e^{i angle}
    x1, x2 = np.split(np.asarray(x, np.float64), 2, axis=-1)
    angle = np.arange(16)[:, None] * 10000.0 ** (-np.arange(0, 32, 2) / 32)
    z = (x1 + 1j * x2) * np.exp(1j * angle)[None, :, None, :]
    np.testing.assert_allclose(np.asarray(got, np.float64), np.concatenate([z.real, z.imag], -1),
                               rtol=0, atol=1e-5 if dtype == jnp.float32 else 0.05)

    h = jax.random.normal(keys[2], (2, 16, 64), dtype)
    kernel = jax.random.normal(keys[3], (64, 3 * 48), dtype)
    cts = (jax.random.normal(keys[1], (2, 16, 96), dtype),
           jax.random.normal(keys[0], (2, 16, 48), dtype))

    def textbook(h, kernel):
        q, k, v = jnp.split(h @ kernel, 3, axis=-1)
        return jnp.concatenate([q, k], -1), v

    got, vjp = jax.vjp(lm.qkv_projection, h, kernel)
    want, vjp_want = jax.vjp(textbook, h, kernel)
    for a, b, what in zip(got + vjp(cts), want + vjp_want(cts), ("qk", "v", "dx", "dkernel")):
        assert a.dtype == b.dtype == dtype, (what, a.dtype, b.dtype)
        assert_close(a, b, dtype, what=f"qkv_projection {what}")


def test_recipe_flag_reaches_the_moe_layers(capsys):
    import mok_jax
    from flax import nnx
    usage_error(capsys, ["--recipe", "fp8"],  # the tiny preset computes in float32
                "--recipe fp8 runs the expert GEMMs from bfloat16 operands")
    cfg = train_moe_lm.config_from_args(
        train_moe_lm.parse_args(["--recipe", "fp8", "--dtype", "bfloat16"]))
    assert cfg.recipe == "fp8" and lm.Config().recipe == "native"
    block = lm.Block(cfg, rngs=nnx.Rngs(0))
    assert block.moe.recipe is mok_jax.Recipe.FP8


def test_bench_preset_shape_is_the_h200_presets_moe_layer():
    """`python -m mok_jax.bench --shapes preset` times the MoE layer the h200 preset
    trains: T = batch * seq tokens, its K, E, d_model and expert FFN."""
    from mok_jax import bench
    c = lm.PRESETS["h200"]
    s = bench.FULL_SHAPES["preset"]
    assert (s.tokens, s.top_k, s.experts, s.hidden, s.ffn) == (
        c.batch * c.seq, c.top_k, c.n_experts, c.d_model, c.expert_ffn)
    assert "preset" not in bench.DEFAULT_SHAPES
