"""A few jitted SGD steps through `mok_jax.moe` on one GPU; prints one JSON line.

    XLA_FLAGS=... python tests/graph_replay_case.py --backend auto --steps 6

Used by tests/test_cuda_graphs.py, which runs it in subprocesses with XLA's
command buffers (CUDA graphs) on and off: XLA_FLAGS must be set before JAX
starts. Each step draws new tokens and routing and
donates the parameters (so the next step reuses their buffers: a CUDA graph
recorded in one step is replayed in the next with other values at the same
addresses). Prints the losses, a digest of the final parameters' bytes and how
many times the process ran a mok_jax CUDA handler.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np

import mok_jax
from mok_jax import _ext


def run(backend: str, steps: int) -> dict:
    # bf16 at sizes the tensor-core kernels take (GEMM1 with SwiGLU in its epilogue).
    T, K, E, H, F = 512, 2, 8, 128, 128
    bf16 = jnp.bfloat16
    k_weights, k_gate_up, k_down, k_data = jax.random.split(jax.random.key(0), 4)
    params = {
        "weights": jax.random.uniform(k_weights, (T, K), jnp.float32),
        "w_gate_up": (jax.random.normal(k_gate_up, (E, H, 2 * F)) * H**-0.5).astype(bf16),
        "w_down": (jax.random.normal(k_down, (E, F, H)) * F**-0.5).astype(bf16),
    }

    def loss_fn(p, x, ids):
        y = mok_jax.moe(x, ids, p["weights"], p["w_gate_up"], p["w_down"], backend=backend)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    # Only elementwise ops and reductions around the layer, whose results do not
    # depend on XLA's choice of algorithm (a dot's may differ between processes,
    # with its autotuning).
    @functools.partial(jax.jit, donate_argnums=0)
    def step(p, i):
        k_x, k_ids = jax.random.split(jax.random.fold_in(k_data, i))
        x = jax.random.normal(k_x, (T, H), jnp.float32).astype(bf16)
        ids = jax.random.randint(k_ids, (T, K), 0, E, jnp.int32)
        loss, grads = jax.value_and_grad(loss_fn)(p, x, ids)
        p = jax.tree.map(lambda a, g: (a.astype(jnp.float32) - 4.0 * g.astype(jnp.float32))
                         .astype(a.dtype), p, grads)
        return p, loss

    losses = []
    for i in range(steps):
        params, loss = step(params, jnp.int32(i))
        losses.append(loss)
    leaves = [np.asarray(a) for a in jax.tree.leaves(params)]
    digest = hashlib.sha256(b"".join(a.tobytes() for a in leaves)
                            + np.asarray(losses, np.float32).tobytes()).hexdigest()
    return {"losses": [float(v) for v in losses], "digest": digest,
            "handler_calls": _ext.cuda_handler_calls(), "platform": jax.devices()[0].platform}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto", choices=("auto", "xla"))
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    print(json.dumps(run(args.backend, args.steps)), flush=True)


if __name__ == "__main__":
    main()
