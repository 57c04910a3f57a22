"""Finds XLA fusions whose body (or a computation it calls) holds a custom call.

XLA's GPU loop, scatter and reduction emitters cannot generate code through a
custom call: when one ends up inside a fusion -- an FFI call wrapped by a pass, or
a ``Sharding`` custom call left in a scatter's combiner -- the compiler aborts the
process (``ComputeOutputToInputIndexing is not implemented for opcode
custom-call``). Given HLO text (a file, or the directory of ``--xla_dump_to``,
optionally with ``--xla_dump_hlo_pass_re=.*``), this prints every such fusion and,
for a pass-by-pass dump, the first pass whose output has one.
``scripts/ep_multiprocess.py --xla-dump DIR`` writes such dumps.

    python scripts/hlo_fusions.py DUMP_DIR_OR_FILE [--target-prefix Sharding]

Exit status 1 when a fusion holds a matching custom call, else 0.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%?([^\s,)}]+)")
_FUSION = re.compile(r"=\s*\S.*?\sfusion\(")


def computations(hlo_text: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines."""
    comps, name = {}, None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m and name is None:
            name = m.group(1)
            comps[name] = []
        elif name is not None:
            if line.strip() == "}":
                name = None
            else:
                comps[name].append(line)
    return comps


def fused_custom_calls(hlo_text: str, target_prefix: str = "") -> list[tuple[str, str]]:
    """(fusion instruction, custom call line) for every fusion whose body, or a
    computation it calls, holds a custom call whose target starts with
    `target_prefix`."""
    comps = computations(hlo_text)
    found = []
    for lines in comps.values():
        for line in lines:
            if not _FUSION.search(line):
                continue
            todo = _CALLS.findall(line)
            seen = set()
            while todo:
                callee = todo.pop()
                if callee in seen or callee not in comps:
                    continue
                seen.add(callee)
                for inner in comps[callee]:
                    if f'custom_call_target="{target_prefix}' in inner:
                        found.append((line.strip(), inner.strip()))
                    todo.extend(_CALLS.findall(inner))
    return found


def _pass_order(path: str) -> tuple:
    # XLA names pass dumps module_NNNN.<name>.NNNN.<pipeline>.after_<pass>.before_<next>.txt
    nums = re.findall(r"\.(\d{4})\.", os.path.basename(path))
    return (os.path.basename(path).split(".")[0], int(nums[-1]) if nums else -1, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="an HLO text file or a --xla_dump_to directory")
    parser.add_argument("--target-prefix", default="",
                        help="only custom calls whose target starts with this (default: any)")
    args = parser.parse_args(argv)
    if os.path.isdir(args.path):
        files = sorted((os.path.join(args.path, f) for f in os.listdir(args.path)
                        if f.endswith(".txt")), key=_pass_order)
    else:
        files = [args.path]
    hits = 0
    first_per_module = {}
    for i, path in enumerate(files):
        with open(path, encoding="utf-8", errors="replace") as f:
            found = fused_custom_calls(f.read(), args.target_prefix)
        if not found:
            continue
        hits += 1
        module = os.path.basename(path).split(".")[0]
        if module not in first_per_module:
            first_per_module[module] = path
            print(f"first fused {args.target_prefix}* custom call: {os.path.basename(path)}")
            if i > 0 and os.path.basename(files[i - 1]).split(".")[0] == module:
                print(f"  the pass before it wrote: {os.path.basename(files[i - 1])}")
            for fusion, call in found:
                print(f"  fusion: {fusion[:600]}")
                print(f"  holds:  {call[:600]}")
    if not hits:
        print(f"no fusion holds a {args.target_prefix}* custom call in {len(files)} file(s)")
    return 1 if hits else 0


if __name__ == "__main__":
    sys.exit(main())
