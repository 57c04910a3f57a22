"""Expert parallelism at rack scale on host devices: bitwise equal to one device.

Builds one process with enough CPU host devices for the largest mesh asked for
(``--xla_force_host_platform_device_count``) and, for each mesh, runs the same
global problem three ways -- one device, ``jax.shard_map`` with ``axis_name``,
and plain ``jax.jit`` on sharded arrays inside ``jax.set_mesh`` -- and compares
y and the four gradients bit for bit:

* ``epP``: one EP axis of P devices (E = 2P experts, 2 per rank). Everything,
  weight gradients included, must have the single-device bits.
* ``dpDepP``: D data-parallel groups of P EP ranks (experts replicated over dp).
  y, dx and d expert_weights must have the single-device bits. The weight
  gradients are the dp groups' partial gradients summed in group order; each
  partial must have the bits of one device running that group's tokens with the
  global capacity plan (pairs the global plan drops are given invalid ids there).

    python scripts/ep_sizes.py --meshes ep16,ep32,ep64,ep72,dp2ep36 --capacity-factor 1.0

Prints one line per mesh and layer; exit status 0 when all are equal.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time


def parse_mesh(text: str) -> tuple[int, int]:
    """'ep72' -> (1, 72); 'dp2ep36' -> (2, 36)."""
    m = re.fullmatch(r"(?:dp(\d+))?ep(\d+)", text)
    if not m or int(m.group(2)) < 1 or (m.group(1) and int(m.group(1)) < 1):
        raise argparse.ArgumentTypeError(f"mesh {text!r}: expected epP or dpDepP")
    return int(m.group(1) or 1), int(m.group(2))


def keep_mask(ids, num_experts, capacity):
    """The global plan's kept pairs: each expert keeps its first `capacity` valid
    pairs in (token, k) order."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    seen = np.zeros(num_experts, np.int64)
    keep = np.zeros(ids.shape, bool)
    for t, k in np.ndindex(*ids.shape):
        e = ids[t, k]
        if 0 <= e < num_experts:
            keep[t, k] = capacity is None or seen[e] < capacity
            seen[e] += 1
    return keep


def sum_in_order(parts):
    """parts[0] + parts[1] + ... in that order, in the parts' dtype."""
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def check(dp: int, ep: int, args) -> list[str]:
    """Runs one mesh; returns its report lines (prefixed MISMATCH on failure)."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
    import mok_jax  # pylint: disable=import-outside-toplevel

    n = dp * ep
    tokens_per_device, top_k, hidden, ffn = (int(v) for v in args.shape.split(","))
    T, K, E, H, F = tokens_per_device * n, top_k, 2 * ep, hidden, ffn
    dtype = {"bf16": jnp.bfloat16, "f32": jnp.float32}[args.dtype]
    rng = np.random.default_rng(n)
    ids = np.argsort(-rng.random((T, E)), axis=1)[:, :K].astype(np.int32)
    ids[1, 0], ids[T // 2, K - 1], ids[T - 1, 0] = -1, E + 5, -E   # invalid ids
    w = rng.random((T, K)).astype(np.float32)
    cast = lambda a: np.asarray(jnp.asarray(a, dtype))  # noqa: E731
    x = cast(rng.standard_normal((T, H)))
    wgu = cast(rng.standard_normal((E, H, 2 * F)) * H**-0.5)
    wd = cast(rng.standard_normal((E, F, H)) * F**-0.5)
    cot = jnp.asarray(np.cos(np.arange(H)), jnp.float32)
    cf = args.capacity_factor

    def grads(layer):
        def loss(x, w, wgu, wd, ids):
            y, stats = layer(x, ids, w, wgu, wd)
            return jnp.sum(y.astype(jnp.float32) * cot), (y, stats)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))

    one_device = lambda x, ids, w, wgu, wd: mok_jax.moe(  # noqa: E731
        x, ids, w, wgu, wd, capacity_factor=cf, return_stats=True)
    no_capacity = lambda x, ids, w, wgu, wd: mok_jax.moe(  # noqa: E731
        x, ids, w, wgu, wd, return_stats=True)
    dev0 = jax.devices()[0]

    def on_one_device(layer, x, w, ids):
        (_, (y, s)), g = grads(layer)(*jax.device_put((x, w, wgu, wd, ids), dev0))
        return [np.asarray(a) for a in (y,) + tuple(g)], [np.asarray(v) for v in s]

    # Plain jit plans over the global batch: one device on all tokens.
    want_jit, stats_jit = on_one_device(one_device, x, w, ids)
    want_shard_map, stats_shard_map = want_jit, stats_jit
    if dp > 1:
        rows = T // dp
        groups = [slice(d * rows, (d + 1) * rows) for d in range(dp)]
        # Weight gradients under plain jit: each dp group's partial, with the global
        # plan's drops (pairs it drops get invalid ids), summed in group order.
        kept = keep_mask(ids, E, mok_jax.capacity(cf, T, K, E))
        partial = [on_one_device(no_capacity, x[g], w[g],
                                 np.where(kept[g], ids[g], -1).astype(np.int32))[0]
                   for g in groups]
        want_jit = want_jit[:3] + [sum_in_order([p[i] for p in partial]) for i in (3, 4)]
        # shard_map with axis_name="ep" is one EP layer per dp group: each group
        # plans (capacity, statistics) over its own tokens.
        per_group = [on_one_device(one_device, x[g], w[g], ids[g]) for g in groups]
        want_shard_map = ([np.concatenate([r[i] for r, _ in per_group]) for i in range(3)]
                          + [sum_in_order([r[i] for r, _ in per_group]) for i in (3, 4)])
        stats_shard_map = [sum_in_order([s[i] for _, s in per_group]) for i in range(3)]

    names = ("dp", "ep") if dp > 1 else ("ep",)
    mesh = jax.make_mesh((dp, ep) if dp > 1 else (ep,), names, devices=jax.devices()[:n])
    tokens = P(names)
    experts = P("ep")

    def shard_map_layer(x, ids, w, wgu, wd):
        def local(x, ids, w, wgu, wd):
            y, stats = mok_jax.moe(x, ids, w, wgu, wd, axis_name="ep", capacity_factor=cf,
                                   return_stats=True)
            if dp > 1:  # moe's statistics are global over its EP group; add the groups'
                stats = jax.tree.map(lambda v: jax.lax.psum(v, "dp"), stats)
            return y, stats
        return jax.shard_map(local, mesh=mesh, in_specs=(tokens,) * 3 + (experts,) * 2,
                             out_specs=(tokens, P()), check_vma=True)(x, ids, w, wgu, wd)

    tok, wts = NamedSharding(mesh, tokens), NamedSharding(mesh, experts)
    placed = (jax.device_put(x, tok), jax.device_put(w, tok), jax.device_put(wgu, wts),
              jax.device_put(wd, wts), jax.device_put(ids, tok))
    label = f"dp{dp}ep{ep}" if dp > 1 else f"ep{ep}"
    lines = []
    for name, layer, want, want_stats in (
            ("shard_map", shard_map_layer, want_shard_map, stats_shard_map),
            ("plain jit", one_device, want_jit, stats_jit)):
        t0 = time.perf_counter()
        with jax.set_mesh(mesh):
            (_, (y, stats)), g = grads(layer)(*placed)
        bad = [what for what, got, ref in zip(
            ("y", "dx", "d_expert_weights", "d_w_gate_up", "d_w_down"), (y,) + tuple(g), want)
            if not np.array_equal(np.asarray(got).view(np.uint8), ref.view(np.uint8))]
        for what, got, ref in zip(("tokens_per_expert", "dropped", "invalid"), stats,
                                  want_stats):
            if not np.array_equal(np.asarray(got), ref):
                bad.append(f"{what} {np.asarray(got)} vs {ref}")
        verdict = "bitwise equal" if not bad else "MISMATCH in " + ", ".join(bad)
        lines.append(f"{label} {name}: {verdict} (T={T} K={K} E={E} H={H} F={F} "
                     f"{args.dtype}, dropped={int(stats.dropped)} invalid={int(stats.invalid)}, "
                     f"{time.perf_counter() - t0:.1f} s)")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", default="ep16,ep32,ep64,ep72,dp2ep36",
                        type=lambda s: [parse_mesh(m) for m in s.split(",")],
                        help="comma-separated epP or dpDepP (default: %(default)s)")
    parser.add_argument("--dtype", choices=["bf16", "f32"], default="f32")
    parser.add_argument("--shape", default="4,4,16,8",
                        help="tokens per device, K, H, F (E is 2 per EP rank)")
    parser.add_argument("--capacity-factor", type=float, default=None)
    args = parser.parse_args(argv)
    devices = max(dp * ep for dp, ep in args.meshes)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "",
                   os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    import jax  # pylint: disable=import-outside-toplevel
    jax.config.update("jax_platforms", "cpu")
    if len(jax.devices()) < devices:
        print(f"needs {devices} host devices, jax has {len(jax.devices())} "
              "(was jax imported before this script set XLA_FLAGS?)")
        return 2
    ok = True
    for dp, ep in args.meshes:
        for line in check(dp, ep, args):
            print(line, flush=True)
            ok &= "MISMATCH" not in line
    print("all meshes bitwise equal to one device" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
