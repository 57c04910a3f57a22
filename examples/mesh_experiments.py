"""Mesh sharding experiments: one MoE LM loss+grad step on every (dp, ep) mesh.

    python examples/mesh_experiments.py --host-devices 8      # 8 CPU devices
    python examples/mesh_experiments.py                        # the visible GPUs

For every factorisation dp * ep = n of the n devices, the byte-level MoE LM of
``train_moe_lm.py`` (tiny preset by default) computes the loss, the logits and
every parameter gradient for one batch of standard-library source, in two ways:

* ``jit``: plain ``jax.jit`` on global arrays, traced inside ``jax.set_mesh``.
  Experts are sharded over ``ep`` by their logical axes, tokens over ``dp`` and
  ``ep``; ``mok_jax.moe`` partitions itself by its sharding rule. The HLO's
  all-gathers are counted: routing ids are small, gathered tokens or weights
  would show.
* ``shard_map``: the whole step inside ``jax.shard_map``; every MoE layer calls
  ``moe(..., axis_name="ep")`` on its local experts.

Tokens are sharded over all n devices on every mesh, so only the placement of
the experts changes from row to row; the outputs and gradients of each row are
compared bit for bit with the mode's first mesh (n, 1). Outputs must be the same
bits. Gradients of replicated weights are sums over data-parallel shards, so
when dp changes they may differ in summation order (up to 1e-5 relative;
``--strict`` requires the same bits); anything else fails the run (exit 1).
Step times (median of ``--repeats``) go to a table, ``mesh.json`` and
``mesh.png`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_args import positive_int, writable_dir  # noqa: E402  (examples/)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:4]))
    parser.add_argument("--host-devices", type=positive_int, metavar="N",
                        help="use N CPU devices (sets XLA_FLAGS before JAX is imported)")
    parser.add_argument("--devices", type=positive_int, metavar="N",
                        help="use the first N visible devices (default: all)")
    parser.add_argument("--mode", choices=["jit", "shard_map", "both"], default="both")
    parser.add_argument("--preset", default="tiny", help="train_moe_lm.py preset for the model")
    parser.add_argument("--batch", type=positive_int,
                        help="sequences (default: the preset's, rounded up to a multiple of "
                             "the device count)")
    parser.add_argument("--seq", type=positive_int, help="bytes per sequence")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed steps per mesh")
    parser.add_argument("--out", default=os.path.join("runs", "mesh"), help="output directory")
    parser.add_argument("--strict", action="store_true",
                        help="require every gradient to be bitwise equal too (by default "
                             "gradients may differ in summation order, up to 1e-5 relative)")
    return parser.parse_args(argv)


def set_host_devices(n: int) -> None:
    """``--xla_force_host_platform_device_count=n`` in XLA_FLAGS (replacing any
    earlier value) and CPU as the platform; only effective before JAX starts."""
    if "jax" in sys.modules:
        import jax

        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)  # raises if backends are running
        return
    flag = "--xla_force_host_platform_device_count"
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(flag)]
    os.environ["XLA_FLAGS"] = " ".join(kept + [f"{flag}={n}"])
    os.environ["JAX_PLATFORMS"] = "cpu"


OUTPUTS = ("loss", "logits")
# Gradients summed over a different number of data-parallel shards differ in
# summation order only; anything larger is a bug.
GRAD_RTOL = 1e-5
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_ALL_GATHER = re.compile(r"= \(?([a-z0-9]+)\[([0-9,]*)\][^=]*? all-gather(?:-start)?\(")


def all_gathers(hlo: str) -> tuple[int, int]:
    """(number, result bytes) of the all-gathers in compiled HLO text: how much the
    partitioned program gathers (ids and counts are small; tokens or weights are not)."""
    count = size = 0
    for dtype, dims in _ALL_GATHER.findall(hlo):
        count += 1
        elems = 1
        for d in filter(None, dims.split(",")):
            elems *= int(d)
        size += elems * _DTYPE_BYTES.get(dtype, 4)
    return count, size


def factorisations(n: int) -> list[tuple[int, int]]:
    """Every (dp, ep) with dp * ep = n, ep ascending: (n, 1) first."""
    return [(n // ep, ep) for ep in range(1, n + 1) if n % ep == 0]


def bits_equal(a, b) -> bool:
    """Whether two arrays have the same dtype, shape and bits."""
    import numpy as np

    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def max_rel(a, b) -> float:
    """The largest ``|a - b|`` over the largest ``|b|`` (``b``: the baseline); inf
    where the two are not finite in the same places with the same values (a NaN
    compares as no difference, and a NaN here would pass any tolerance)."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    finite = np.isfinite(b)
    if not (np.array_equal(np.isfinite(a), finite)
            and np.array_equal(a[~finite], b[~finite], equal_nan=True)):
        return float("inf")
    a, b = a[finite], b[finite]
    return float(np.max(np.abs(a - b), initial=0.0) / max(np.max(np.abs(b), initial=0.0), 1e-30))


def compare(row: dict, result: dict, base: dict) -> None:
    """Bitwise comparison of every output and gradient of ``result`` with the
    baseline's, into ``row``: which differ, whether the outputs and the gradients
    are the same bits, and the largest relative difference (`max_rel`)."""
    differ = [k for k in base if not bits_equal(result[k], base[k])]
    row["differ"] = differ
    row["outputs_bitwise"] = not any(k in OUTPUTS for k in differ)
    row["grads_bitwise"] = not any(k not in OUTPUTS for k in differ)
    row["max_rel_diff"] = max((max_rel(result[k], base[k]) for k in differ), default=0.0)


def run(args) -> dict:
    if args.host_devices:
        set_host_devices(args.host_devices)

    import dataclasses

    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import moe_lm as lm
    from mok_jax import nn as mnn

    if args.preset not in lm.PRESETS:
        raise SystemExit(f"--preset must be one of {sorted(lm.PRESETS)}, got {args.preset!r}")
    if args.devices and args.devices > len(jax.devices()):
        raise SystemExit(f"--devices {args.devices}: only {len(jax.devices())} visible")
    devices = jax.devices()[:args.devices] if args.devices else jax.devices()
    n = len(devices)
    cfg = lm.PRESETS[args.preset]
    batch = args.batch or -(-cfg.batch // n) * n
    # One loss+grad step, no optimizer update: no bf16 copies of the expert stacks.
    cfg = dataclasses.replace(cfg, batch=batch, seq=args.seq or cfg.seq, weight_copies=False)
    if cfg.batch % n:
        raise SystemExit(f"--batch {cfg.batch} must be a multiple of the {n} devices")
    corpus = lm.load_corpus()
    lm.check_seq(cfg.seq, corpus, held_out=False)
    # After the refusals (a refused command line creates nothing), before the
    # meshes run (not after them).
    writable_dir("--out", args.out)
    tokens_np = lm.batch_at(corpus.train, 0, cfg)
    tx, _ = lm.make_optimizer(cfg)
    data_axes = ("dp", "ep")
    modes = ["jit", "shard_map"] if args.mode == "both" else [args.mode]
    print(f"{n} {devices[0].platform} device(s) ({devices[0].device_kind}); model: "
          f"{lm.describe(cfg)}")

    def loss_of(model, tokens, reduce_axes=()):
        logits, auxes = model(tokens[:, :-1])
        ce = lm.cross_entropy(logits, tokens[:, 1:])
        if reduce_axes:
            ce = jax.lax.pmean(ce, reduce_axes)
        aux_loss, z_loss, _, _ = lm.aux_totals(auxes)
        return ce + cfg.aux_coef * aux_loss + cfg.z_coef * z_loss, logits

    def jit_step(graphdef):
        def step(params, bias, tokens):
            return jax.value_and_grad(
                lambda p: loss_of(nnx.merge(graphdef, p, bias), tokens), has_aux=True)(params)
        return step

    def shard_map_step(graphdef, mesh, shardings):
        specs = jax.tree.map(lambda s: s.spec, shardings,
                             is_leaf=lambda x: isinstance(x, NamedSharding))

        def local_loss(params, bias, tokens):
            return loss_of(nnx.merge(graphdef, params, bias), tokens, reduce_axes=data_axes)

        sharded = jax.shard_map(local_loss, mesh=mesh,
                                in_specs=(specs.params, specs.bias, P(data_axes)),
                                out_specs=(P(), P(data_axes)), check_vma=True)

        def step(params, bias, tokens):
            return jax.value_and_grad(lambda p: sharded(p, bias, tokens), has_aux=True)(params)
        return step

    def run_mesh(mode, mesh, row):
        """Compiles and times one loss+grad step; returns {name: array} or None."""
        graphdef, state, shardings = lm.init_state(cfg, mesh, tx)
        tokens = jax.device_put(tokens_np, lm.batch_sharding(mesh))
        if mode == "jit":
            step = jit_step(graphdef)
        else:
            graphdef = nnx.split(lm.abstract_model(cfg, axis_name="ep", batch_axis_names=data_axes),
                                 nnx.Param, mnn.BalanceBias)[0]
            step = shard_map_step(graphdef, mesh, shardings)
        step = jax.jit(step, out_shardings=((NamedSharding(mesh, P()), lm.batch_sharding(mesh)),
                                            shardings.params))
        t0 = time.perf_counter()
        compiled = step.lower(state.params, state.bias, tokens).compile()
        row["compile_s"] = time.perf_counter() - t0
        row["all_gathers"], row["all_gather_bytes"] = all_gathers(compiled.as_text())
        (loss, logits), grads = jax.block_until_ready(compiled(state.params, state.bias, tokens))
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(state.params, state.bias, tokens))
            times.append(time.perf_counter() - t0)
        row["step_s"] = statistics.median(times)
        row["tokens_per_s"] = cfg.batch * cfg.seq / row["step_s"]
        row["loss"] = float(loss)
        result = {"loss": loss, "logits": logits}
        for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
            name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
            result["grad/" + name.removesuffix("/.value").removesuffix("/value")] = leaf
        return {k: np.asarray(v) for k, v in result.items()}

    rows, baselines = [], {}
    for mode in modes:
        for dp, ep in factorisations(n):
            row = {"mode": mode, "dp": dp, "ep": ep, "status": "ok"}
            rows.append(row)
            if cfg.n_experts % ep:
                row["status"] = f"skipped: E={cfg.n_experts} is not a multiple of ep={ep}"
                continue
            mesh = lm.make_mesh(dp, ep, devices)
            # Traced inside the mesh: moe partitions itself over it under jit, and
            # Flax's eager sharding follows the same logical rules.
            rules = mnn.logical_axis_rules(mesh.axis_names)
            with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
                result = run_mesh(mode, mesh, row)
            if mode not in baselines:
                baselines[mode] = ((dp, ep), result)
                row["vs"] = "baseline"
            else:
                (bdp, bep), base = baselines[mode]
                row["vs"] = f"({bdp},{bep})"
                compare(row, result, base)
            if mode != "jit" and "jit" in baselines:
                jit_base = baselines["jit"][1]
                row["max_rel_diff_vs_jit"] = max(max_rel(result[k], jit_base[k]) for k in result)

    failed = [r for r in rows if r.get("vs") not in (None, "baseline") and (
        not r["outputs_bitwise"] or r["max_rel_diff"] > GRAD_RTOL
        or (args.strict and not r["grads_bitwise"]))]
    for r in failed:
        r["status"] = "FAILED"
    report = {"devices": n, "platform": devices[0].platform,
              "device_kind": devices[0].device_kind, "jax": jax.__version__,
              "config": dataclasses.asdict(cfg), "rows": rows, "ok": not failed}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "mesh.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(format_table(rows))
    plot(rows, os.path.join(args.out, "mesh.png"), title=(
        f"MoE LM loss+grad step, {n} {devices[0].platform} devices, "
        f"{cfg.batch}x{cfg.seq} tokens"))
    print(f"wrote {os.path.join(args.out, 'mesh.json')} and {os.path.join(args.out, 'mesh.png')}")
    if failed:
        print("FAILED: " + ", ".join(f"{r['mode']} ({r['dp']},{r['ep']})" for r in failed)
              + " disagree with their baseline beyond " + (
                  "bitwise equality" if args.strict else f"{GRAD_RTOL:g} on gradients"))
    elif not any(r.get("vs") not in (None, "baseline") or "max_rel_diff_vs_jit" in r
                 for r in rows):
        print(f"nothing compared: no mesh of the {n} device(s) besides the baseline could "
              "run (one device, or the experts not divisible by the other meshes' ep)")
    else:
        print("all meshes agree: outputs bitwise" + (
            ", gradients bitwise" if args.strict else
            f", gradients bitwise or within {GRAD_RTOL:g} (summation order)"))
    return report


def _equality(r: dict, what: str) -> str:
    if r["vs"] == "baseline":
        return "baseline"
    if r[f"{what}_bitwise"]:
        return "bitwise"
    names = [k for k in r["differ"] if (k in OUTPUTS) == (what == "outputs")]
    leaves = sorted({k.rsplit("/", 1)[-1] for k in names})
    return f"{len(names)} differ ({', '.join(leaves)}); max rel {r['max_rel_diff']:.1e}"


def format_table(rows: list[dict]) -> str:
    """Markdown table of the rows of `run`."""
    lines = ["| mode | dp | ep | step (ms) | tokens/s | all-gathers (KiB) | vs | outputs |"
             " gradients | status |", "|" + "---|" * 10]
    for r in rows:
        if "step_s" in r:
            lines.append(f"| {r['mode']} | {r['dp']} | {r['ep']} | {1e3 * r['step_s']:.1f} | "
                         f"{r['tokens_per_s']:,.0f} | {r['all_gathers']} "
                         f"({r['all_gather_bytes'] / 1024:,.1f}) | {r['vs']} | "
                         f"{_equality(r, 'outputs')} | {_equality(r, 'grads')} | {r['status']} |")
        else:
            lines.append(f"| {r['mode']} | {r['dp']} | {r['ep']} | - | - | - | - | - | - | "
                         f"{r['status']} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r["mode"] for r in rows}, key=["jit", "shard_map"].index)
    meshes = sorted({(r["dp"], r["ep"]) for r in rows}, key=lambda m: m[1])
    width = 0.8 / len(modes)
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(meshes), 4), dpi=120)
    for i, mode in enumerate(modes):
        for j, mesh in enumerate(meshes):
            r = next(r for r in rows if r["mode"] == mode and (r["dp"], r["ep"]) == mesh)
            x = j + (i - (len(modes) - 1) / 2) * width
            if "step_s" in r:
                ax.bar(x, 1e3 * r["step_s"], width, color=f"C{i}")
                if r["vs"] == "baseline":
                    mark = "base"
                elif not r["outputs_bitwise"]:
                    mark = "≠"
                else:
                    mark = "=" if r["grads_bitwise"] else "≈"
                ax.text(x, 1e3 * r["step_s"], mark, ha="center", va="bottom", fontsize=9)
            else:
                ax.text(x, 0, "n/a", ha="center", va="bottom", rotation=90, fontsize=8,
                        color=f"C{i}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=f"C{i}") for i in range(len(modes))]
    ax.legend(handles, modes)
    ax.set_xticks(range(len(meshes)), [f"dp={dp}\nep={ep}" for dp, ep in meshes])
    ax.set(ylabel="loss+grad step (ms, median)", title=title)
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.12)
    fig.text(0.01, 0.01, "vs the mode's (n,1) mesh:  = same bits   ≈ outputs same bits, "
             "some gradients differ in summation order   ≠ outputs differ", fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> dict:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
