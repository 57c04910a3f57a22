"""ncu's per-instruction warp-stall samples of one kernel, summed by the source line
each SASS instruction comes from.

    nvdisasm -g -gi KERNELS.cubin > kernels.sass        # the build ncu ran
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > source.csv
    python scripts/ncu_by_source.py --sass kernels.sass --kernel NAME_PART \\
        --csv source.csv --file moe_persistent_backward.cu --scope 792-935 \\
        --part "dgrad2 K loop=820-821" --part "dgrad2 epilogue=822-829" ... \\
        [--wait barrier.h:424]

nvdisasm's line and inline tables give each instruction its chain of source
locations, from the innermost (the code itself) out to the kernel body. An
instruction belongs to the first --part whose lines hold the outermost line of
its chain that lies in --file within --scope (the body of the function whose
calls tell the parts apart, such as a persistent kernel's consume loop); other
instructions in scope count as "other in scope", and those whose chain never
enters the scope as "outside". --wait FILE:LINE also counts, per part, the
samples of instructions whose innermost location is that line (a barrier's
try-wait loop, say). The CSV may be gzipped; its addresses are absolute, the
SASS's relative to the kernel's start.
"""

import argparse
import csv
import gzip
import re
import sys
from collections import Counter

_LOC = re.compile(r'//## File "([^"]*)", line (\d+)')
_INST = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")


def instruction_chains(sass_lines, kernel):
    """{offset: [(file basename, line), ...] innermost first} for the first kernel
    whose .text section name contains `kernel`."""
    chains, inside, pending, current = {}, False, [], []
    for line in sass_lines:
        if line.startswith(".text."):
            if inside:
                break
            inside = kernel in line
            continue
        if not inside:
            continue
        loc = _LOC.search(line)
        if loc:
            pending.append((loc.group(1).rsplit("/", 1)[-1], int(loc.group(2))))
            continue
        inst = _INST.match(line)
        if inst:
            if pending:
                current, pending = pending, []
            chains[int(inst.group(1), 16)] = list(current)
    if not inside:
        raise SystemExit(f"no kernel matching {kernel!r} in the SASS")
    return chains


def parse_parts(specs):
    """["name=lo-hi,line,..."] -> [(name, set of lines)]."""
    parts = []
    for spec in specs:
        name, _, ranges = spec.partition("=")
        lines = set()
        for piece in filter(None, ranges.split(",")):
            lo, _, hi = piece.partition("-")
            lines.update(range(int(lo), int(hi or lo) + 1))
        if not name or not lines:
            raise SystemExit(f"--part {spec!r}: expected NAME=LO-HI[,LINE...]")
        parts.append((name, lines))
    return parts


def part_of(chain, file, scope, parts):
    in_scope = [line for f, line in chain if f == file and scope[0] <= line <= scope[1]]
    if not in_scope:
        return "outside"
    outermost = in_scope[-1]
    for name, lines in parts:
        if outermost in lines:
            return name
    return "other in scope"


def read_csv(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    header_at = next(i for i, r in enumerate(rows) if "Address" in r)
    header = rows[header_at]
    col = {name: header.index(name) for name in
           ("Address", "Warp Stall Sampling (All Samples)", "Instructions Executed")}
    body = [r for r in rows[header_at + 1:] if len(r) > max(col.values())]
    base = int(body[0][col["Address"]], 16)
    return [(int(r[col["Address"]], 16) - base,
             int(r[col["Warp Stall Sampling (All Samples)"]] or 0),
             int(r[col["Instructions Executed"]] or 0)) for r in body]


def summarize(chains, samples, file, scope, parts, wait=None):
    """{part: [samples, warp instructions executed, samples waiting at `wait`]}."""
    totals = {}
    for offset, n, executed in samples:
        chain = chains.get(offset, [])
        part = part_of(chain, file, scope, parts)
        t = totals.setdefault(part, [0, 0, 0])
        t[0] += n
        t[1] += executed
        if wait is not None and chain and chain[0] == wait:
            t[2] += n
    return totals


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sass", required=True, help="nvdisasm -g -gi output of the build")
    ap.add_argument("--kernel", required=True, help="part of the kernel's mangled name")
    ap.add_argument("--csv", required=True, help="ncu --page source --csv --print-source sass")
    ap.add_argument("--file", required=True, help="source file name whose lines classify")
    ap.add_argument("--scope", required=True, help="LO-HI: the lines of the dispatching body")
    ap.add_argument("--part", action="append", default=[], help="NAME=LO-HI[,LINE...]")
    ap.add_argument("--wait", help="FILE:LINE whose samples to count per part")
    args = ap.parse_args(argv)
    lo, _, hi = args.scope.partition("-")
    scope = (int(lo), int(hi or lo))
    wait = None
    if args.wait:
        f, _, line = args.wait.rpartition(":")
        wait = (f, int(line))
    with open(args.sass, encoding="utf-8", errors="replace") as f:
        chains = instruction_chains(f, args.kernel)
    totals = summarize(chains, read_csv(args.csv), args.file, scope, parse_parts(args.part), wait)
    all_samples = sum(t[0] for t in totals.values()) or 1
    print(f"{'part':24s} {'samples':>9s} {'share':>7s} {'warp instr.':>13s}"
          + (f" {'at ' + args.wait:>24s}" if wait else ""))
    for name, (n, executed, waiting) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        line = f"{name:24s} {n:9d} {100 * n / all_samples:6.1f}% {executed:13d}"
        if wait:
            line += f" {waiting:12d} ({100 * waiting / max(n, 1):5.1f} %)"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
