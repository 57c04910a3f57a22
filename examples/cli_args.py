"""Argument types shared by the example scripts (no JAX import: mesh_experiments.py
parses its arguments before JAX starts)."""

import argparse


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1, else a usage error naming the value."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value
