"""The corpus (the standard library's Python sources, as bytes) and the batches
drawn from it."""

from __future__ import annotations

import os
import sysconfig
import zlib
from typing import NamedTuple

import numpy as np

from moe_lm.config import Config


class Corpus(NamedTuple):
    """The corpus as `load_corpus` splits it: training and held-out bytes (files
    joined with a NUL byte), where it was read, and how many files each holds."""

    train: np.ndarray   # [N] uint8
    eval: np.ndarray    # [M] uint8
    root: str
    train_files: int
    eval_files: int


EVAL_FRACTION_PERCENT = 5


def stdlib_root() -> str:
    """The running Python's standard library directory: the default corpus."""
    return sysconfig.get_paths()["stdlib"]


def load_corpus(root: str | None = None) -> Corpus:
    """Every ``*.py`` under ``root`` (default: the stdlib; site-packages and
    caches skipped), sorted by relative path. A file is held out for evaluation
    when ``crc32(relative path) % 100 < 5``: the split does not move when files
    are added elsewhere. Files are joined with a NUL byte. Stops (SystemExit naming
    the path) where ``root`` is not a directory or a file cannot be read."""
    root = os.path.abspath(root or stdlib_root())
    if not os.path.isdir(root):
        raise SystemExit(f"corpus: {root} is not a directory")
    skip = {"site-packages", "dist-packages", "__pycache__"}
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
                paths.append(rel)
    paths.sort()
    train, held_out = [], []
    for rel in paths:
        try:
            with open(os.path.join(root, rel), "rb") as f:
                data = f.read()
        except OSError as err:
            raise SystemExit(f"corpus: cannot read {os.path.join(root, rel)} "
                             f"({err.strerror})") from None
        split = held_out if zlib.crc32(rel.encode()) % 100 < EVAL_FRACTION_PERCENT else train
        split.append(data)
    if not train or not held_out:
        raise SystemExit(f"corpus at {root} has too few .py files ({len(paths)}) to split")
    join = lambda parts: np.frombuffer(b"\0".join(parts), np.uint8)  # noqa: E731
    return Corpus(join(train), join(held_out), root, len(train), len(held_out))


def batch_at(data: np.ndarray, step: int, cfg: Config, *, stream: int = 0) -> np.ndarray:
    """The batch of ``step``: ``[batch, seq + 1]`` int32 windows at positions drawn
    from ``(seed, stream, step)`` alone, so that a resumed run sees the same data.
    A window starts anywhere in ``[0, len(data) - seq - 1]``: it ends at the last
    byte at the latest, and every byte but the first can be a target."""
    rng = np.random.default_rng([cfg.seed, stream, step])
    starts = rng.integers(0, len(data) - cfg.seq, size=cfg.batch)  # high excluded
    return np.stack([data[s:s + cfg.seq + 1] for s in starts]).astype(np.int32)


def check_seq(seq: int, corpus: Corpus, *, held_out: bool = True) -> None:
    """Stops the run (SystemExit naming ``--seq``) where `batch_at`'s windows of
    ``seq + 1`` bytes do not fit the corpus's training part, or, with ``held_out``,
    its held-out part, whichever is shorter."""
    parts = ([("held-out", len(corpus.eval))] if held_out else []) + [
        ("training", len(corpus.train))]
    name, size = min(parts, key=lambda part: part[1])  # ties: the first
    if seq + 1 > size:  # batch_at draws a window's start from [0, size - seq - 1]
        longest = f": --seq {size - 1} at most" if size > 1 else ""
        raise SystemExit(f"--seq {seq} needs windows of seq + 1 bytes, and the {name} part "
                         f"of the corpus has {size} bytes{longest}")


EVAL_STREAM = 1
