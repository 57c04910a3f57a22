"""A small MoE forward and gradient on the persistent forward, for compute-sanitizer.

    compute-sanitizer --tool memcheck --kernel-name kns=moe_forward_persistent \\
        python scripts/persistent_small_case.py [--chain]

T=100, K=2, E=4, H=136, F=200: rows past a 64-row block, H and F not multiples of
the 64-wide tiles (the loads' zero fill and the epilogues' bounds). `--chain` runs
the kernel chain instead (`PersistentMode.OFF`), for the same case under the tools.
"""

import argparse

import jax
import jax.numpy as jnp

import mok_jax
from mok_jax import _mok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chain", action="store_true", help="the kernel chain instead")
    args = parser.parse_args()
    _mok.set_persistent_forward(_mok.PersistentMode.OFF if args.chain
                                else _mok.PersistentMode.ALWAYS)
    ks = jax.random.split(jax.random.key(0), 4)
    T, K, E, H, F = 100, 2, 4, 136, 200
    x = jax.random.normal(ks[0], (T, H)).astype(jnp.bfloat16)
    w, ids = jax.lax.top_k(jax.nn.softmax(jax.random.normal(ks[1], (T, E))), K)
    ids = ids.astype(jnp.int32)
    wgu = (jax.random.normal(ks[2], (E, H, 2 * F)) * H**-0.5).astype(jnp.bfloat16)
    wd = (jax.random.normal(ks[3], (E, F, H)) * F**-0.5).astype(jnp.bfloat16)
    y = jax.block_until_ready(mok_jax.moe(x, ids, w, wgu, wd))

    def loss(x, w):
        return mok_jax.moe(x, ids, w, wgu, wd).astype(jnp.float32).sum()

    jax.block_until_ready(jax.grad(loss, argnums=(0, 1))(x, w))
    print(y.shape, "ok")


if __name__ == "__main__":
    main()
