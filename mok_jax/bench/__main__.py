"""`python -m mok_jax.bench`: see mok_jax.bench (and --help)."""

from mok_jax.bench.cli import main

main()
