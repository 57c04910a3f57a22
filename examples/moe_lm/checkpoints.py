"""Checkpoints (orbax) and the identity a resumed run must share with the run
that wrote them."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax

from moe_lm.config import Config
from moe_lm.data import Corpus
from moe_lm.report import write_json
from moe_lm.training import TrainState, weight_copies


# Config fields a resumed run may change: how it runs and reports, not what it
# computes (the attention implementations and MoE backends compute the same
# function; weight copies and the gradient-reduce lag give the same bits).
RESUMABLE_CHANGES = frozenset({"attention", "moe_backend", "grad_reduce_lag", "weight_copies",
                               "eval_every", "eval_batches", "log_every", "ckpt_every"})


def run_identity(cfg: Config, corpus: Corpus) -> dict:
    """What a run resuming a checkpoint must share with the run that wrote it: every
    Config field that changes the model, the data or the schedule, and the corpus.
    Written next to the checkpoints (``ckpt/run.json``) when a run starts."""
    return {"config": {k: v for k, v in dataclasses.asdict(cfg).items()
                       if k not in RESUMABLE_CHANGES},
            "corpus": {"root": corpus.root, "train_bytes": int(corpus.train.size),
                       "eval_bytes": int(corpus.eval.size)}}


def identity_differences(want: dict, got: dict) -> list[str]:
    """The fields where ``got`` (e.g. a log's config and corpus) differs from the
    identity ``want``, as "section.field: want -> got"."""
    out = []
    for section, fields in want.items():
        other = got.get(section) or {}
        for key, value in fields.items():
            if other.get(key, value) != value:
                out.append(f"{section}.{key}: {value!r} -> {other.get(key)!r}")
    return out


def checkpoint_manager(directory: str):
    """An orbax CheckpointManager over ``directory`` (created if missing) that keeps
    the two newest checkpoints."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def save_checkpoint(manager, state: TrainState) -> None:
    """Saves everything but ``copies``, which `restore_checkpoint` derives."""
    import orbax.checkpoint as ocp

    saved = {k: v for k, v in state._asdict().items() if k != "copies"}
    manager.save(int(state.step), args=ocp.args.StandardSave(saved))


def restore_checkpoint(manager, step: int, like: TrainState, shardings: TrainState) -> TrainState:
    """The state saved at ``step``, in ``shardings``, shaped like ``like``; its
    ``copies`` (not saved) are derived from the restored masters."""
    import orbax.checkpoint as ocp

    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          like._asdict(), shardings._asdict())
    del target["copies"]
    restored = manager.restore(step, args=ocp.args.StandardRestore(target))
    dtypes = {a.dtype for a in jax.tree.leaves(like.copies)}
    copies = like.copies
    if dtypes:  # derived from the restored masters, as the train step derives them
        copies = jax.jit(lambda p: weight_copies(p, dtypes.pop()),
                         out_shardings=shardings.copies)(restored["params"])
    return TrainState(**restored, copies=copies)


def _read_json(path: str, advice: str):
    """The JSON at `path`, or a SystemExit naming the file and what to do."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise SystemExit(f"--resume: cannot read {path} ({err}); {advice}") from None


def start_or_resume(ckpt_dir: str, log_path: str, identity: dict, state: TrainState,
                    shardings: TrainState, *, save: bool, resume: bool, overwrite: bool):
    """Opens a run's checkpoints: ``(manager, state, log)``.

    ``manager`` saves into ``ckpt_dir`` (None when ``save`` is off). With ``resume`` and a
    checkpoint there, ``state`` is the latest checkpoint's and ``log`` the log at
    ``log_path`` cut at its step (None if there is none); otherwise ``state`` is
    the given one and ``log`` None, and a new run's ``identity`` (`run_identity`)
    is written to ``ckpt_dir/run.json``. Refuses (SystemExit) to resume from a run
    with another identity, and to start over where checkpoints are unless
    ``overwrite`` (which removes them), a run that saves none included: it would
    replace their run's log. Checkpoints without ``run.json`` (an older version's)
    resume with a warning, and ``identity`` is written there: the warning comes
    once, at the first resume."""
    manager = checkpoint_manager(ckpt_dir) if save or os.path.isdir(ckpt_dir) else None
    latest = None if manager is None else manager.latest_step()
    if not save and manager is not None:  # opened only to look for checkpoints
        manager.close()
        manager = None
    identity_path = os.path.join(ckpt_dir, "run.json")
    # Written for a new run, and for a resumed one without it (once restored), so
    # that a missing identity is warned about once and checked from then on.
    write_identity = save
    log = None
    if resume and latest is not None:
        if os.path.exists(log_path):
            log = _read_json(log_path, "move it away to start a new log from the checkpoint")
        # Checked before anything is restored: another model would fail deep inside
        # orbax, another schedule, batch or corpus would not fail at all.
        if os.path.exists(identity_path):
            saved = _read_json(identity_path, "the run's identity is unknown: start a new "
                               "run in another --out")
            diffs = identity_differences(saved, identity)
            if diffs:
                raise SystemExit(
                    f"--resume: this command line differs from the run that wrote "
                    f"{ckpt_dir} in {'; '.join(diffs)}. A resumed run continues that run "
                    "(same model, data and schedule): repeat its flags, or start a new run "
                    "in another --out")
            foreign = [] if log is None else identity_differences(saved, log)
            if foreign:
                raise SystemExit(
                    f"--resume: {log_path} is not the log of the run that wrote {ckpt_dir} "
                    f"({'; '.join(foreign)}); move it away to start a new log from the "
                    "checkpoint")
            write_identity = False
        else:
            print(f"warning: {identity_path} is missing (a checkpoint of an older version): "
                  "cannot check that this command line continues the same run; its model, "
                  "data and schedule are written there, and later resumes are checked "
                  "against them")
        state = restore_checkpoint(manager, latest, state, shardings)
        if log is not None:
            for key in ("train", "eval", "throughput"):
                log[key] = [r for r in log[key] if r["step"] <= latest]
        print(f"resumed from {ckpt_dir} at step {latest}")
    elif latest is not None:
        if not overwrite:
            advice = ("pass --resume to continue or --overwrite to start over" if save else
                      "this run saves none but would replace their run's log: pass "
                      "--overwrite to start over (it removes them) or use another --out")
            raise SystemExit(f"{ckpt_dir} holds checkpoints (latest step {latest}): {advice}")
        if manager is not None:
            manager.close()
        shutil.rmtree(ckpt_dir)
        manager = checkpoint_manager(ckpt_dir) if save else None
    elif resume:
        print(f"no checkpoint in {ckpt_dir}: starting from step 0")
    if write_identity:
        write_json(identity_path, identity)
    return manager, state, log
