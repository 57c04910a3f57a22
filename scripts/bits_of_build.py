"""Fingerprints of mok_jax's results on the bench shapes, for comparing two builds.

    python scripts/bits_of_build.py OUT.json [--shapes a,b] [--dtypes bf16,f32]
    python scripts/bits_of_build.py --compare A.json B.json

For each bench shape (mok_jax.bench's, full size) and dtype: y and the four
gradients (x, expert_weights, w_gate_up, w_down) of a fixed loss, from fixed
random inputs drawn on the host, each as a SHA-256 of its bytes. Run it once per installed build;
`--compare` prints which arrays differ and exits 1 if any do. A change of bits
between builds is then a deliberate one, named where it is made.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys


def fingerprints(shapes, dtypes, quick=False, path=None) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import mok_jax
    from mok_jax import bench

    out = {"mok_jax": mok_jax.__file__, "device": str(jax.devices()[0])}
    by_name = dict(bench.QUICK_SHAPES if quick else bench.FULL_SHAPES)
    for name in shapes:
        sh = by_name[name]
        T, K, E, H, F = sh.tokens, sh.top_k, sh.experts, sh.hidden, sh.ffn
        for dt in dtypes:
            dtype = jnp.bfloat16 if dt == "bf16" else jnp.float32
            # Inputs drawn on the host with NumPy: XLA's own kernels (a softmax, a
            # top-k) may pick other algorithms from run to run (autotuning under
            # load), and the inputs must be the same bits for both builds.
            rng = np.random.default_rng(7)
            logits = rng.standard_normal((T, E)).astype(np.float32)
            ids = np.argsort(-logits, axis=1, kind="stable")[:, :K].astype(np.int32)
            probs = np.exp(logits - logits.max(axis=1, keepdims=True))
            w = np.take_along_axis(probs / probs.sum(axis=1, keepdims=True), ids, axis=1)
            x, wgu, wd, cot = (
                jnp.asarray(rng.standard_normal(shape, np.float32) * scale).astype(dtype)
                for shape, scale in (((T, H), 1.0), ((E, H, 2 * F), H**-0.5),
                                     ((E, F, H), F**-0.5), ((T, H), 1.0)))
            ids, w = jnp.asarray(ids), jnp.asarray(w.astype(np.float32))

            def loss(x, w, wgu, wd):
                y = mok_jax.moe(x, ids, w, wgu, wd)
                return jnp.sum((y * cot).astype(jnp.float32)), y

            grads, y = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, w, wgu, wd)
            arrays = {"y": y, "dx": grads[0], "d_expert_weights": grads[1],
                      "d_w_gate_up": grads[2], "d_w_down": grads[3]}
            for key, a in arrays.items():
                a = np.asarray(jax.device_get(a))
                out[f"{name}/{dt}/{key}"] = hashlib.sha256(a.tobytes()).hexdigest()
            print(name, dt, "done", flush=True)
            if path:  # after each problem, so that a run cut short keeps what it did
                with open(path, "w") as f:
                    json.dump(out, f, indent=1)
            del x, w, ids, wgu, wd, cot, grads, y, arrays
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?")
    p.add_argument("--shapes", default="small-experts,deepseek-slice,mixtral-like,ep")
    p.add_argument("--dtypes", default="bf16,f32")
    p.add_argument("--quick", action="store_true", help="the scaled-down shapes (CPU)")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = p.parse_args(argv)
    if args.compare:
        a, b = (json.load(open(f)) for f in args.compare)
        keys = sorted(k for k in set(a) | set(b) if "/" in k)
        differ = [k for k in keys if a.get(k) != b.get(k)]
        print(f"{len(keys) - len(differ)} of {len(keys)} arrays bitwise equal")
        for k in differ:
            print("DIFFERS:", k)
        return 1 if differ or not keys else 0
    if not args.out:
        p.error("give OUT.json or --compare A B")
    fingerprints(args.shapes.split(","), args.dtypes.split(","), args.quick, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
