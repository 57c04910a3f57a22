"""The run's outputs: its JSON log and its loss plot."""

from __future__ import annotations

import json
import math
import os

from moe_lm.config import VOCAB


def write_json(path: str, obj: dict) -> None:
    """Writes ``obj`` to ``path`` through a temporary file and a rename, so that a
    reader never sees half a file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def plot_losses(log: dict, path: str) -> None:
    """Train loss (per step and smoothed) and eval loss against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in log["train"]]
    ce = [r["ce"] for r in log["train"]]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    if steps:
        ax.plot(steps, ce, color="tab:blue", alpha=0.25, lw=0.8, label="train (per step)")
        smooth, ema = [], ce[0]
        for v in ce:
            ema = 0.95 * ema + 0.05 * v
            smooth.append(ema)
        ax.plot(steps, smooth, color="tab:blue", lw=1.6, label="train (EMA 0.95)")
    if log["eval"]:
        ax.plot([r["step"] for r in log["eval"]], [r["loss"] for r in log["eval"]], "o-",
                color="tab:orange", lw=1.6, label="eval (held-out files)")
    ax.axhline(math.log(VOCAB), color="gray", ls=":", lw=1, label="uniform (ln 256)")
    summary = log.get("summary", {})
    title = f"mok_jax MoE LM, preset {log['preset']}: {log['mesh_desc']}"
    if summary.get("tokens_per_s"):
        title += f", {summary['tokens_per_s']:,.0f} tokens/s"
    ax.set(xlabel="step", ylabel="cross-entropy (nats / byte)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
