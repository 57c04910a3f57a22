"""Argument types and checks shared by the example scripts (no JAX import: mesh_experiments.py
parses its arguments before JAX starts)."""

import argparse
import math
import os
import tempfile


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1, else a usage error naming the value."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0, else a usage error naming the value."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def seed(text: str) -> int:
    """argparse type: an integer in [0, 2^63) (numpy's seeds, and the 64-bit keys of
    mok_jax._src.seeds.seed_key), else a usage error naming the value."""
    value = int(text)
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2^63), got {value}")
    return value


def writable_dir(flag: str, path: str) -> None:
    """Creates directory ``path`` if need be and checks that a file can be written
    in it; stops the run (SystemExit naming ``flag``) if not."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise SystemExit(f"{flag}: {path} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise SystemExit(f"{flag}: cannot write in {path} ({err.strerror})") from None
