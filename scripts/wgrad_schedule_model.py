"""A static model of the weight-gradient GEMM's tile schedule under uneven routing.

The backward's two weight gradients run as one CUTLASS grouped GEMM of 2E
groups (dW_gate_up's E, then dW_down's E). Its persistent scheduler numbers the
tiles group after group and CTA c takes tiles c, c + grid, c + 2 grid, ...; every
tile of an expert reduces over that expert's rows, so its time is about the
rows plus a fixed cost. This model gives each CTA the sum of its tiles' times
and reports the longest CTA over the ideal (all work spread evenly), for two
orders of the groups: expert order, as the groups come, and rows, most first
(longest first), which is the order the GEMM uses (setup_groups in
ffi/kernels/cutlass_grouped.cuh). It is a model, not a measurement: it ignores
memory contention, the epilogue's cost and the tile order inside a group. The
case it makes was measured with expert 17 at 8x the mean load: both weight
gradients 1.41 ms in expert order, 1.18 longest first (docs/ledger.md,
2026-12-01).

    python scripts/wgrad_schedule_model.py [--tokens 32768 --top-k 4 --experts 32
                                            --hidden 1024 --ffn 1024 --ctas 132]
"""

from __future__ import annotations

import argparse

import numpy as np

TILE = (128, 256)  # the default weight-gradient tile (M x N)
FIXED = 64  # a tile's fixed cost, in rows of reduction


def tiles_per_expert(hidden: int, ffn: int) -> tuple[int, int]:
    """Tiles of one expert's dW_gate_up [H, 2F] and dW_down [F, H]."""
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    return (cdiv(hidden, TILE[0]) * cdiv(2 * ffn, TILE[1]),
            cdiv(ffn, TILE[0]) * cdiv(hidden, TILE[1]))


def makespan(rows: np.ndarray, tiles: tuple[int, int], ctas: int, order: str) -> float:
    """The busiest CTA's time over the ideal for the groups in `order` ("expert" or
    "longest"), an expert without rows having no tiles."""
    experts = len(rows)
    groups = [(p, e) for p in range(2) for e in range(experts)]
    if order == "longest":  # rows, most first; ties in group order
        groups = sorted(groups, key=lambda g: (-rows[g[1]], g[0] * experts + g[1]))
    times = [rows[e] + FIXED for p, e in groups if rows[e] > 0 for _ in range(tiles[p])]
    load = np.zeros(ctas)
    for i, t in enumerate(times):
        load[i % ctas] += t
    return float(load.max() / (sum(times) / ctas))


def one_busy(tokens: int, top_k: int, experts: int, load: float, hot: int) -> np.ndarray:
    """Rows per expert: expert `hot` at `load` times the mean, the rest even."""
    pairs = tokens * top_k
    rows = np.full(experts, (pairs - round(load * pairs / experts)) // (experts - 1))
    rows[hot] = round(load * pairs / experts)
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--ctas", type=int, default=132, help="SMs (an H200 has 132)")
    parser.add_argument("--samples", type=int, default=200, help="random loads per row")
    args = parser.parse_args(argv)
    tiles = tiles_per_expert(args.hidden, args.ffn)
    pairs = args.tokens * args.top_k
    rows_out = {}

    def row(label, loads):
        expert = np.mean([makespan(r, tiles, args.ctas, "expert") for r in loads])
        longest = np.mean([makespan(r, tiles, args.ctas, "longest") for r in loads])
        rows_out[label] = (expert, longest)
        print(f"| {label} | {expert:.3f} | {longest:.3f} |")

    print(f"tiles an expert {tiles}, {args.ctas} CTAs; the busiest CTA over the ideal:")
    print("| loads | expert order | longest first |\n| --- | --- | --- |")
    row("even", [np.full(args.experts, pairs // args.experts)])
    for hot in (0, args.experts // 2 + 1, args.experts - 1):
        row(f"expert {hot} at 8x", [one_busy(args.tokens, args.top_k, args.experts, 8.0, hot)])
    row("one expert at 3x, mean over which",
        [one_busy(args.tokens, args.top_k, args.experts, 3.0, h) for h in range(args.experts)])
    rng = np.random.default_rng(0)
    for alpha in (0.5, 2.0):
        loads = [np.round(rng.dirichlet(np.full(args.experts, alpha)) * pairs).astype(int)
                 for _ in range(args.samples)]
        busiest = np.mean([r.max() / r.mean() for r in loads])
        row(f"random (Dirichlet {alpha:g}, busiest {busiest:.1f}x the mean)", loads)
    return rows_out


if __name__ == "__main__":
    main()
