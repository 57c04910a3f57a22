"""Train a byte-level MoE transformer on the Python standard library's source.

    python examples/train_moe_lm.py                     # tiny preset: CPU, ~1.5 min
    python examples/train_moe_lm.py --preset h200       # sized for one H200 (bf16)
    python examples/train_moe_lm.py --dp 4 --ep 2       # over 8 devices (tokens on all)
    python examples/train_moe_lm.py --host-devices 8 --dp 8    # 8 CPU devices
    python examples/train_moe_lm.py --resume            # continue from OUT/ckpt

The corpus is every ``*.py`` file of the running Python's standard library
(``sysconfig.get_paths()['stdlib']``, site-packages excluded), read as bytes in
sorted path order; about 5% of the files (chosen by a hash of their path) are
held out for evaluation. The model is a decoder-only transformer (RMSNorm,
causal self-attention with RoPE, a `mok_jax.nn.MoE` feed-forward in every
block), trained with AdamW, linear warm-up and cosine decay under one
``jax.jit`` step. Parameters are sharded by their logical axes: experts over
``ep``, everything else replicated; tokens over ``dp`` and ``ep``.

Writes to ``--out`` (default ``runs/<preset>``): ``log.json`` (config, every
step's losses, eval losses, tokens/s, MFU), ``loss.png`` and orbax checkpoints
under ``ckpt/``. A run continued with ``--resume`` is bitwise identical to an
uninterrupted one (batches depend only on the seed and the step); it must be the
same run (``ckpt/run.json``: model, data and schedule), or it is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mok_jax import nn as mnn

from cli_args import positive_float, positive_int, seed, writable_dir  # examples/, on sys.path
from moe_lm.checkpoints import run_identity, save_checkpoint, start_or_resume
from moe_lm.config import PRESETS, Config, describe, flops_per_token, param_counts
from moe_lm.data import EVAL_STREAM, Corpus, batch_at, check_seq, load_corpus
from moe_lm.report import plot_losses, write_json
from moe_lm.training import (TrainState, batch_sharding, init_state, make_eval_step,
                             make_mesh, make_optimizer, make_train_step, shard_over_data,
                             trace_only)


def config_from_args(args) -> Config:
    """The preset's Config with the flags given on the command line; a shorter
    ``--steps`` shortens the warm-up to a tenth of it (at most the preset's)."""
    cfg = PRESETS[args.preset]
    overrides = {name: getattr(args, name) for name in
                 ("steps", "batch", "seq", "lr", "seed", "balance", "eval_every", "ckpt_every",
                  "log_every", "eval_batches", "attention", "dtype", "moe_backend", "recipe",
                  "norm",
                  "grad_reduce_lag", "weight_copies")
                 if getattr(args, name, None) is not None}
    if overrides.get("steps") is not None:
        overrides.setdefault("warmup", min(cfg.warmup, max(1, overrides["steps"] // 10)))
    return dataclasses.replace(cfg, **overrides)


def parse_args(argv=None):
    """The command line (``argv``, default sys.argv), with the combinations that
    cannot run refused."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:8]))
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--steps", type=positive_int,
                        help="total optimizer steps (the schedule's length)")
    parser.add_argument("--batch", type=positive_int, help="sequences per step (global)")
    parser.add_argument("--seq", type=positive_int, help="bytes per sequence")
    parser.add_argument("--lr", type=positive_float, help="peak learning rate")
    parser.add_argument("--seed", type=seed,
                        help="seed of the initial parameters and the batches: an integer "
                             "in [0, 2^63), each its own run (default 0)")
    parser.add_argument("--balance", choices=["aux", "bias", "none"],
                        help="load balancing: aux loss, DeepSeek-V3 bias, or none")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="computation dtype")
    parser.add_argument("--attention", choices=["auto", "xla", "cudnn"],
                        help="jax.nn.dot_product_attention implementation (default auto: "
                             "cudnn on a GPU in bfloat16, else xla)")
    parser.add_argument("--norm", choices=["auto", "fused", "nnx"],
                        help="residual adds and RMSNorms (default auto: fused, mok_jax.add_rms_norm, "
                             "on a GPU; nnx: an add and nnx.RMSNorm, on a CPU)")
    parser.add_argument("--moe-backend", choices=["auto", "fused", "xla"],
                        help="mok_jax.moe's backend (default auto: under --ep on GPUs of one "
                             "process, the fused NVLink transport; xla: XLA's all_to_all)")
    parser.add_argument("--recipe", choices=["native", "fp8"],
                        help="the expert GEMMs' numeric recipe (default native: in the "
                             "computation dtype; fp8: float8_e4m3fn with block scales, "
                             "needs --dtype bfloat16)")
    parser.add_argument("--grad-reduce-lag", type=int, metavar="N",
                        help="data parallelism: finish layer i's expert-gradient all-reduce "
                             "before the backward of layer i-N-1 starts (an optimization "
                             "barrier; default 1 when dp > 1 and ep = 1 without "
                             "--shard-optimizer, else -1: off, XLA places the all-reduces)")
    parser.add_argument("--no-weight-copies", dest="weight_copies", action="store_false",
                        default=None,
                        help="do not keep the expert stacks in the computation dtype between "
                             "steps (saves 2 bytes per expert parameter, 2.4 GB for the h200 "
                             "preset; each forward then casts the f32 masters)")
    parser.add_argument("--pgle", action="store_true",
                        help="profile-guided latency estimation: JAX profiles the first steps "
                             "and XLA recompiles the step with the measured costs (with "
                             "--grad-reduce-lag, how dp overlaps its gradient all-reduces)")
    parser.add_argument("--eval-every", type=positive_int)
    parser.add_argument("--eval-batches", type=positive_int)
    parser.add_argument("--log-every", type=positive_int)
    parser.add_argument("--ckpt-every", type=positive_int)
    parser.add_argument("--out", help="output directory (default runs/<preset>)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in OUT/ckpt")
    parser.add_argument("--overwrite", action="store_true",
                        help="delete OUT/ckpt's checkpoints and start from step 0")
    parser.add_argument("--no-checkpoint", action="store_true",
                        help="save no checkpoint (throughput runs; the h200 preset's state "
                             "is ~15 GB)")
    parser.add_argument("--stop-after", type=positive_int, metavar="N",
                        help="stop (with a checkpoint) after N steps of this invocation, as if "
                             "interrupted; the schedule still runs to --steps")
    parser.add_argument("--dp", type=positive_int,
                        help="data-parallel mesh axis (default: devices / ep)")
    parser.add_argument("--ep", type=positive_int, default=1, help="expert-parallel mesh axis")
    parser.add_argument("--shard-optimizer", action="store_true",
                        help="split the optimizer state and update over dp (ZeRO stage 1): "
                        "1/dp of the moments per GPU; slower on the h200 preset (the "
                        "parameters' all-gather is not overlapped, docs/training.md)")
    parser.add_argument("--host-devices", type=positive_int, metavar="N",
                        help="run on N CPU devices (sets jax_num_cpu_devices; CPU only)")
    parser.add_argument("--peak-tflops", type=positive_float,
                        help="per-device peak for MFU (default 989 on GPU, H200 bf16 dense)")
    parser.add_argument("--data-dir", help="train on the *.py files under this directory "
                                           "instead of the standard library")
    parser.add_argument("--trace-only", action="store_true",
                        help="build the model and trace one train step (jax.eval_shape), "
                             "print sizes and FLOPs, exit; nothing runs")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    parser.add_argument("--profile", metavar="DIR",
                        help="trace --profile-steps steps (after 3 warm ones) with jax.profiler "
                             "into DIR and write the step-time breakdown by part of the model "
                             "to DIR/breakdown.json (GPU kernels; see examples/step_profile.py); "
                             "turns XLA's CUDA graphs off for the run")
    parser.add_argument("--profile-steps", type=positive_int, metavar="N",
                        help="steps --profile traces (default 5)")
    args = parser.parse_args(argv)
    if args.trace_only and (args.dp is not None or args.ep != 1 or args.host_devices
                            or args.shard_optimizer):
        parser.error("--trace-only traces the one-device step (jax.eval_shape, no mesh): "
                     "--dp, --ep, --host-devices and --shard-optimizer are not used there")
    if args.trace_only and (args.resume or args.out or args.profile or args.overwrite
                            or args.data_dir or args.stop_after or args.pgle
                            or args.peak_tflops):
        parser.error("--trace-only runs nothing and writes nothing: --resume, --out, "
                     "--overwrite, --profile, --data-dir, --stop-after, --pgle and "
                     "--peak-tflops are not used there")
    if args.recipe == "fp8" and (args.dtype or PRESETS[args.preset].dtype) != "bfloat16":
        parser.error("--recipe fp8 runs the expert GEMMs from bfloat16 operands: add "
                     "--dtype bfloat16")
    if args.grad_reduce_lag is not None and args.grad_reduce_lag < -1:
        parser.error(f"--grad-reduce-lag must be -1 (off) or a lag >= 0, got "
                     f"{args.grad_reduce_lag}")
    if args.resume and args.overwrite:
        parser.error("--resume continues the run in --out and --overwrite starts it over: "
                     "give one")
    if args.no_checkpoint and (args.resume or args.stop_after):
        parser.error("--no-checkpoint cannot be combined with --resume or --stop-after")
    if args.profile_steps is not None and not args.profile:
        parser.error(f"--profile-steps {args.profile_steps} needs --profile DIR: it sets how "
                     "many steps --profile traces")
    if args.profile_steps is None:
        args.profile_steps = 5
    if args.profile and (args.pgle or jax.config.jax_enable_pgle):
        parser.error("--profile cannot be combined with PGLE (--pgle, JAX_ENABLE_PGLE): the "
                     "breakdown names kernels through a compile of the step without PGLE's "
                     "profile, which is not the program that ran")
    return args


def use_host_devices(n: int) -> None:
    """N CPU devices; must run before JAX initializes its backends."""
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def default_grad_reduce_lag(dp: int, ep: int, shard_optimizer: bool) -> int | None:
    """The reduce barrier's lag when --grad-reduce-lag is not given: 1 where it was
    measured to help (dp > 1, ep = 1, a replicated optimizer; docs/ledger.md,
    2026-11-30), else None (the preset's value, off)."""
    return 1 if dp > 1 and ep == 1 and not shard_optimizer else None


def train(args) -> dict:
    """Runs training as configured by ``args`` (from `parse_args`); returns the log."""
    if args.host_devices:
        use_host_devices(args.host_devices)
    if args.pgle:
        jax.config.update("jax_enable_pgle", True)
    if args.profile and "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
        # Kernels replayed from a CUDA graph carry the graph's HLO op, not their own:
        # the profiled run launches them one by one so that each is attributed (the
        # throughput it reports is then a little lower than without --profile).
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_gpu_enable_command_buffer=").strip()
    cfg = config_from_args(args)
    platform = jax.devices()[0].platform
    for flag, value, gpu_only in (("--attention", cfg.attention, "cudnn"),
                                  ("--moe-backend", cfg.moe_backend, "fused")):
        if value == gpu_only and platform != "gpu":
            raise SystemExit(f"{flag} {gpu_only} needs a GPU; this run's devices are "
                             f"{platform} (use auto)")
    if args.trace_only:
        info = trace_only(cfg)
        print(f"preset {args.preset}: {describe(cfg)}")
        print(f"traced one step: {info['params']:,} parameters, "
              f"{info['flops_per_token'] / 1e9:.3f} GFLOP per token; metrics {info['metrics']}")
        return {"trace": info}

    devices = jax.devices()
    ep = args.ep
    dp = args.dp if args.dp is not None else max(1, len(devices) // ep)
    mesh = make_mesh(dp, ep, devices)
    if cfg.batch % (dp * ep):
        raise SystemExit(f"--batch {cfg.batch} must be a multiple of dp*ep = {dp * ep}")
    if cfg.n_experts % ep:
        raise SystemExit(f"--ep {ep} must divide the preset's {cfg.n_experts} experts")
    lag = default_grad_reduce_lag(dp, ep, args.shard_optimizer)
    if args.grad_reduce_lag is None and lag is not None:
        cfg = dataclasses.replace(cfg, grad_reduce_lag=lag)
    if cfg.grad_reduce_lag >= cfg.n_layers:
        raise SystemExit(f"--grad-reduce-lag {cfg.grad_reduce_lag} must be below the preset's "
                         f"{cfg.n_layers} layers (a lag past the last layer ties no "
                         "all-reduce), or -1 (off)")
    peak = args.peak_tflops or (989.0 if platform == "gpu" else None)

    corpus = load_corpus(args.data_dir)
    check_seq(cfg.seq, corpus)

    # Where the run writes, checked (and created) before anything is built or
    # trained, and after every check above: a command line that cannot run leaves
    # no directory behind. The log and run.json (OUT), the checkpoints (OUT/ckpt),
    # the trace (--profile).
    out = args.out or os.path.join("runs", args.preset)
    writes = [("--out", out)]
    if not args.no_checkpoint:
        writes.append(("--out", os.path.join(out, "ckpt")))
    if args.profile:
        writes.append(("--profile", args.profile))
    for flag, path in writes:
        writable_dir(flag, path)

    # Everything traced from here on sees the mesh (so that mok_jax.moe partitions
    # itself over it) and the logical axis rules (so that Flax's eager sharding of
    # new variables agrees with the shardings computed by named_shardings).
    with jax.set_mesh(mesh), nnx.logical_axis_rules(mnn.logical_axis_rules(mesh.axis_names)):
        return _train_on_mesh(args, cfg, mesh, corpus, out, peak)


def profile_step(args, cfg: Config, train_step, state, batch, wall_s: float) -> dict:
    """The breakdown of the traced steps (examples/step_profile.py), printed and
    written to <profile dir>/breakdown.json."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import step_profile  # pylint: disable=import-outside-toplevel

    hlo = train_step.lower(state, batch).compile().as_text()
    result = step_profile.breakdown(args.profile, hlo, steps=args.profile_steps, wall_s=wall_s,
                                    n_layers=cfg.n_layers)
    write_json(os.path.join(args.profile, "breakdown.json"), result)
    print(step_profile.table(result), flush=True)
    print(step_profile.top_table(result), flush=True)
    print(step_profile.gap_table(result), flush=True)
    return result


def check_finite(log: dict, step: int, since: int = 0) -> None:
    """Stops the run when a logged step after `since` has a loss or gradient norm
    that is not finite (the first such step is named), or the newest eval loss is
    not: the run has diverged (a loss is computed before its step's update, so a
    finite loss beside a NaN gradient norm still means a NaN update), and nothing
    after it (in particular no checkpoint) is worth keeping."""
    new_rows = []  # newest first
    for row in reversed(log["train"]):
        if row["step"] <= since:
            break
        new_rows.append(row)
    checks = [(what, row, key) for row in reversed(new_rows)  # the first bad step is named
              for what, key in (("train loss", "loss"), ("train grad norm", "grad_norm"))]
    checks += [("eval loss", row, "loss") for row in log["eval"][-1:]]
    for what, row, key in checks:
        if key in row and not math.isfinite(row[key]):
            raise SystemExit(f"step {step}: the {what} is {row[key]} (step {row['step']}); "
                             "stopping without saving a checkpoint")


def untimed_steps() -> int:
    """Steps at the start of a run that throughput leaves out: the first (it
    compiles) and, with PGLE on (`--pgle` or JAX_ENABLE_PGLE), the rest of JAX's
    profiled runs (the first is the compiling step) and the step that recompiles
    with their measurements."""
    runs = jax.config.jax_pgle_profiling_runs
    return 1 + (runs if jax.config.jax_enable_pgle and runs > 0 else 0)


def _train_on_mesh(args, cfg: Config, mesh: Mesh, corpus: Corpus, out: str, peak) -> dict:
    ckpt_dir = os.path.join(out, "ckpt")
    log_path = os.path.join(out, "log.json")
    dp, ep = mesh.shape["dp"], mesh.shape["ep"]
    platform = mesh.devices.flat[0].platform
    device_kind = mesh.devices.flat[0].device_kind
    tx, schedule = make_optimizer(cfg)
    graphdef, state, shardings = init_state(cfg, mesh, tx, shard_optimizer=args.shard_optimizer)
    manager, state, log = start_or_resume(
        ckpt_dir, log_path, run_identity(cfg, corpus), state, shardings,
        save=not args.no_checkpoint, resume=args.resume, overwrite=args.overwrite)

    mesh_desc = f"dp={dp} ep={ep} on {dp * ep} {platform} device(s)"
    if log is None:
        log = {"preset": args.preset, "train": [], "eval": [], "throughput": []}
    log.update({
        "config": dataclasses.asdict(cfg), "mesh": {"dp": dp, "ep": ep}, "mesh_desc": mesh_desc,
        "platform": platform, "device_kind": device_kind, "jax": jax.__version__,
        "corpus": {"root": corpus.root, "train_files": corpus.train_files,
                   "eval_files": corpus.eval_files, "train_bytes": int(corpus.train.size),
                   "eval_bytes": int(corpus.eval.size)},
        "param_counts": param_counts(cfg), "flops_per_token": flops_per_token(cfg),
    })
    print(f"preset {args.preset}: {describe(cfg)}")
    print(f"mesh {mesh_desc}; corpus {corpus.root}: {corpus.train_files} train files "
          f"({corpus.train.size / 1e6:.1f} MB), {corpus.eval_files} held out "
          f"({corpus.eval.size / 1e6:.1f} MB)")

    tokens_sharding = batch_sharding(mesh)
    metric_sharding = NamedSharding(mesh, P())
    update_shardings = None
    if args.shard_optimizer and dp > 1:
        update_shardings = shard_over_data(shardings.params, state.params, mesh)
    train_step = jax.jit(make_train_step(cfg, graphdef, tx, schedule,
                                         update_shardings=update_shardings,
                                         param_shardings=shardings.params),
                         in_shardings=(shardings, tokens_sharding),
                         out_shardings=(shardings, metric_sharding), donate_argnums=(0,))
    eval_step = jax.jit(make_eval_step(graphdef),
                        in_shardings=(shardings.params, shardings.bias, tokens_sharding),
                        out_shardings=metric_sharding)
    eval_set = [batch_at(corpus.eval, i, cfg, stream=EVAL_STREAM)
                for i in range(cfg.eval_batches)]

    def evaluate(state: TrainState) -> float:
        losses = [eval_step(state.params, state.bias, jax.device_put(b, tokens_sharding))
                  for b in eval_set]
        return float(np.mean([float(v) for v in losses]))

    start = int(state.step)
    stop = cfg.steps if args.stop_after is None else min(cfg.steps, start + args.stop_after)
    # The first eval: a fresh run's at step 0, or a resumed run's whose log is lost
    # (a resume at a step the schedule does not evaluate adds nothing a straight run
    # lacks).
    if not log["eval"]:
        log["eval"].append({"step": start, "loss": evaluate(state),
                            "batches": cfg.eval_batches})
        print(f"step {start}: eval loss {log['eval'][-1]['loss']:.4f}")

    progress = None
    if not args.no_progress:
        from tqdm.auto import tqdm

        progress = tqdm(total=cfg.steps, initial=start, unit="step", dynamic_ncols=True,
                        desc=args.preset)
    tokens_per_step = cfg.batch * cfg.seq
    pending: list[tuple[int, dict]] = []
    t_run = time.perf_counter()
    # Throughput is timed between completed steps: t_mark is when step mark_step was
    # known to be done (None: no mark yet), and an interval's rate is its steps over
    # the time between two such moments.
    t_mark, mark_step, compile_s = None, start, None

    def flush(upto=None):
        """Moves the metrics of steps <= upto (all when None) to the log; waits for them."""
        ready = [(s, m) for s, m in pending if upto is None or s <= upto]
        for step_done, metrics in jax.device_get(ready):
            log["train"].append({"step": step_done, **{k: float(v) for k, v in metrics.items()}})
        pending[:] = pending[len(ready):]

    def mark(step_done, when=None):
        nonlocal t_mark, mark_step
        t_mark, mark_step = time.perf_counter() if when is None else when, step_done

    untimed = untimed_steps()
    profile_from = start + untimed + 2 if args.profile else None
    profile_to = None if profile_from is None else profile_from + args.profile_steps
    if profile_to is not None and profile_to > stop:
        raise SystemExit(f"--profile needs {profile_to - start} steps to run, this run has "
                         f"{stop - start}")

    def log_interval(upto):
        """The log line of step `upto`: waits for it (only for it: a later step may
        already be queued, so the GPU does not idle while the host logs)."""
        nonlocal checked
        flush(upto)
        now = time.perf_counter()
        profiled = profile_from is not None and mark_step < profile_to and upto > profile_from
        timed = t_mark is not None and upto > mark_step and not profiled
        if timed:
            dt = (now - t_mark) / (upto - mark_step)
            row = {"step": upto, "steps": upto - mark_step, "step_time_s": dt,
                   "tokens_per_s": tokens_per_step / dt, "mesh": {"dp": dp, "ep": ep}}
            if peak:
                row["mfu"] = row["tokens_per_s"] * flops_per_token(cfg) / (peak * 1e12 * dp * ep)
            log["throughput"].append(row)
        check_finite(log, upto, since=checked)
        checked = log["train"][-1]["step"] if log["train"] else checked
        last = log["train"][-1]
        tps = log["throughput"][-1]["tokens_per_s"] if log["throughput"] else float("nan")
        if progress is not None:
            progress.set_postfix(loss=f"{last['ce']:.3f}", tok_s=f"{tps:,.0f}", refresh=False)
        else:  # no bar: one line per log interval
            rate = f", {tps:,.0f} tokens/s" if timed else ""
            mfu = (f", MFU {100 * log['throughput'][-1]['mfu']:.1f}%"
                   if timed and "mfu" in log["throughput"][-1] else "")
            print(f"step {upto}: train loss {last['ce']:.4f}{rate}{mfu}", flush=True)
        if args.no_checkpoint:  # no checkpoint saves to carry the log: write it now
            write_json(log_path, log)
        # The next interval starts when this step was done (the host's logging above
        # ran while the next step was already on the GPU).
        mark(upto, now)

    deferred = None  # a log step whose line waits until the next step is dispatched
    checked = start  # the train rows up to this step have been checked for divergence
    # A run that stops early (a diverged step, an error, Ctrl-C) still finishes
    # writing the checkpoints it saved: they are written in the background, and
    # the log already names them.
    try:
        for step in range(start, stop):
            batch = jax.device_put(batch_at(corpus.train, step, cfg), tokens_sharding)
            if step == profile_from:
                if deferred is not None:  # its interval must not time the tracer's start
                    log_interval(deferred)
                    deferred = None
                jax.block_until_ready(state)
                jax.profiler.start_trace(args.profile)
                t_profile = time.perf_counter()
            state, metrics = train_step(state, batch)
            done = step + 1
            pending.append((done, metrics))
            if deferred is not None:  # step `done` is queued: now wait for `deferred`
                log_interval(deferred)
                deferred = None
            if done == profile_to:
                jax.block_until_ready((state, metrics))
                profile_wall = time.perf_counter() - t_profile
                jax.profiler.stop_trace()
                log["profile"] = profile_step(args, cfg, train_step, state, batch, profile_wall)
                mark(done)  # profiling is not training
            if done - start <= untimed:  # compiling steps: time them apart
                jax.block_until_ready(metrics)
                if compile_s is None:
                    compile_s = time.perf_counter() - t_run
                mark(done)
            evaluating = done % cfg.eval_every == 0 or done == cfg.steps
            saving = not args.no_checkpoint and (done % cfg.ckpt_every == 0 or done == stop)
            if done % cfg.log_every == 0 or done == stop:
                if done == stop or evaluating or saving:
                    log_interval(done)  # waits anyway
                else:
                    deferred = done
            if progress is not None:
                progress.update(1)
            if evaluating:
                flush()
                log["eval"].append({"step": done, "loss": evaluate(state),
                                    "batches": cfg.eval_batches})
                msg = f"step {done}: eval loss {log['eval'][-1]['loss']:.4f}"
                (progress.write if progress is not None else print)(msg)
                mark(done)  # evaluating is not training
            if saving:
                flush()
                # a diverged state must not replace a good checkpoint
                check_finite(log, done, since=checked)
                checked = done
                save_checkpoint(manager, state)
                write_json(log_path, log)
                mark(done)  # nor is saving
        flush()
    finally:
        if progress is not None:
            progress.close()
        if manager is not None:
            manager.wait_until_finished()
            manager.close()

    wall = time.perf_counter() - t_run
    # A run resumed on another mesh holds both meshes' intervals: the summary is this
    # mesh's (the one log["mesh"] names), as is its MFU's device count.
    rates = [r["tokens_per_s"] for r in log["throughput"]
             if r.get("mesh") == {"dp": dp, "ep": ep}]
    summary = {"steps": int(state.step), "wall_s_this_run": wall, "compile_s": compile_s,
               "initial_eval_loss": log["eval"][0]["loss"],
               "final_eval_loss": log["eval"][-1]["loss"],
               "final_eval_step": log["eval"][-1]["step"],
               # Over how many held-out batches each was measured: --resume may
               # change --eval-batches, and losses over other batches do not compare.
               "eval_batches": [log["eval"][0].get("batches"), log["eval"][-1].get("batches")],
               "tokens_per_s": statistics.median(rates) if rates else None}
    if peak and rates:
        summary["model_tflops_per_s"] = summary["tokens_per_s"] * flops_per_token(cfg) / 1e12
        summary["mfu"] = summary["model_tflops_per_s"] / (peak * dp * ep)
        summary["peak_tflops_per_device"] = peak
    log["summary"] = summary
    write_json(log_path, log)
    plot_losses(log, os.path.join(out, "loss.png"))

    line = (f"done: step {summary['steps']}, eval loss {summary['initial_eval_loss']:.4f} -> "
            f"{summary['final_eval_loss']:.4f} ({summary['final_eval_loss'] / math.log(2):.3f} "
            f"bits/byte) at step {summary['final_eval_step']} in {wall:.1f} s")
    first_batches, last_batches = summary["eval_batches"]
    if first_batches != last_batches:
        line += (f" (the two eval losses over {first_batches} and {last_batches} held-out "
                 "batches: not comparable)")
    if summary["tokens_per_s"]:
        line += f", {summary['tokens_per_s']:,.0f} tokens/s"
    if "mfu" in summary:
        line += (f", {summary['model_tflops_per_s']:.1f} model TFLOP/s, "
                 f"MFU {100 * summary['mfu']:.1f}% of {peak:g} TFLOP/s x {dp * ep}")
    print(line)
    print(f"wrote {log_path}, {os.path.join(out, 'loss.png')}"
          + ("" if args.no_checkpoint else f", checkpoints in {ckpt_dir}"))
    return log


def main(argv=None) -> dict:
    """Parses ``argv`` and trains; returns the run's log."""
    return train(parse_args(argv))


if __name__ == "__main__":
    main()
