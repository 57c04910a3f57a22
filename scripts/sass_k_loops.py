"""The persistent kernels' wgmma K loops in the built extension's SASS: no register moves
of the accumulators.

    python scripts/sass_k_loops.py [--so PATH] [--cuobjdump PATH] [--max-moves N]

ptxas can keep a warp group's accumulators outside the registers a wgmma names and move
them in and out around every K block; the results stay right, so no numerical test sees
it, and the tensor cores wait for the moves (the persistent forward's 128-row K loop had
142 moves for four wgmmas and ran 4-7 % slower, docs/measurements.md). For each kernel of
moe_persistent and moe_persistent_backward, every loop that holds a wgmma (a backward
branch over an HGMMA) is listed with its instruction and move count (register moves
that read or write one of the loop's wgmma accumulators, and every local-memory load and
store); a loop with more than --max-moves (default 0), and a wgmma found in no loop, fail
the check (exit 1). Moves of other registers (the wgmma descriptors, the loop's
pointers) are not counted. Needs cuobjdump (the CUDA toolkit's; scripts/gpu_ci.sh runs
this on the GPU machine) and an extension built with sm_90a code.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

CUBINS = ("moe_persistent.sm_90a.cubin", "moe_persistent_backward.sm_90a.cubin")
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
BRANCH = re.compile(r"\bBRA(?:\.\w+)*\s+0x([0-9a-f]+)")  # cuobjdump writes absolute addresses
MOVE = re.compile(r"^(?:@!?U?P\w+\s+)?(?:IMAD\.MOV(?:\.U32)?|MOV)\b")
REGISTER = re.compile(r"\bR(\d+)\b")
# A wgmma's accumulators: f32, M x N per warp group, N / 2 registers a thread from the
# first operand's.
HGMMA = re.compile(r"HGMMA\.64x(\d+)x\d+\.F32\S*\s+R(\d+)\b")
SPILL = re.compile(r"^(?:@!?U?P\w+\s+)?(?:STL|LDL)\b")  # the accumulators in local memory


def functions(sass: str):
    """(name, [(address, instruction)]) of every function in a cuobjdump -sass listing."""
    for part in sass.split("Function : ")[1:]:
        name = part.split("\n", 1)[0].strip()
        yield name, [(int(a, 16), s.strip()) for a, s in INSTRUCTION.findall(part)]


def wgmma_loops(code):
    """(first, last, instructions, wgmmas, moves) of the innermost loop around each wgmma
    of `code`: the shortest range from a backward branch's target to the branch that
    holds the HGMMA (the task loops around it are longer). Moves count register moves
    that name one of the loop's wgmma accumulators (f32: N / 2 registers a thread from
    the HGMMA's first operand) and local-memory loads and stores (spilled accumulators).
    A wgmma in no loop is reported as a loop of its own address with moves -1 (check()
    fails it)."""
    wgmmas = [a for a, s in code if "HGMMA" in s]
    ranges = []
    for address, text in code:
        m = BRANCH.search(text)
        if m is not None and int(m.group(1), 16) < address:
            ranges.append((int(m.group(1), 16), address))
    innermost = set()
    loose = []
    for w in wgmmas:
        around = [r for r in ranges if r[0] <= w <= r[1]]
        if around:
            innermost.add(min(around, key=lambda r: r[1] - r[0]))
        else:
            loose.append(w)
    loops = [(w, w, 1, 1, -1) for w in loose]
    for first, last in sorted(innermost):
        body = [s for a, s in code if first <= a <= last]
        accumulators = set()
        for s in body:
            m = HGMMA.search(s)
            if m is not None:
                accumulators.update(range(int(m.group(2)), int(m.group(2)) + int(m.group(1)) // 2))
        moves = sum(bool(SPILL.match(s)) or (bool(MOVE.match(s)) and any(
            int(r) in accumulators for r in REGISTER.findall(s))) for s in body)
        loops.append((first, last, len(body), sum("HGMMA" in s for s in body), moves))
    return loops


def short_name(mangled: str) -> str:
    """moe_forward_persistent<bf16, 128> for its mangled name (the names are this file's)."""
    base = re.search(r"moe_(?:forward|backward)_persistent", mangled)
    rows = re.search(r"Li(\d+)E", mangled)
    weights = "bf16" if "bf16" in mangled else "float"
    return (f"{base.group(0) if base else mangled}<{weights}"
            f"{', ' + rows.group(1) if rows else ''}>")


def check(sass: str, max_moves: int) -> list[str]:
    """Report lines for every wgmma loop in `sass`; those over max_moves start with FAIL."""
    lines = []
    for name, code in functions(sass):
        for first, last, count, wgmmas, moves in wgmma_loops(code):
            if moves < 0:
                lines.append(f"FAIL {short_name(name):36s} {first:#07x}: a wgmma in no loop "
                             "(the listing's branches not understood?)")
                continue
            verdict = "FAIL" if moves > max_moves else "ok"
            lines.append(f"{verdict:4s} {short_name(name):36s} {first:#07x}-{last:#07x}: "
                         f"{count} instructions, {wgmmas} HGMMA, {moves} moves")
    return lines


def extension_path() -> str:
    import mok_jax  # pylint: disable=import-outside-toplevel
    found = glob.glob(os.path.join(os.path.dirname(mok_jax.__file__), "_mok.*.so"))
    if not found:
        sys.exit("no mok_jax/_mok*.so next to the installed package")
    return found[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--so", help="the extension (default: the installed mok_jax's _mok)")
    parser.add_argument("--cuobjdump", default=shutil.which("cuobjdump"))
    parser.add_argument("--max-moves", type=int, default=0)
    args = parser.parse_args()
    if not args.cuobjdump:
        sys.exit("no cuobjdump: give --cuobjdump PATH")
    so = args.so or extension_path()
    listed = subprocess.run([args.cuobjdump, "-lelf", so], capture_output=True, text=True,
                            check=True).stdout
    missing = [c for c in CUBINS if c not in listed]
    if missing:
        sys.exit(f"{so} has no {', '.join(missing)} (a build without sm_90a code?)")
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        for cubin in CUBINS:
            subprocess.run([args.cuobjdump, "-xelf", cubin, os.path.abspath(so)], cwd=tmp,
                           capture_output=True, check=True)
            sass = subprocess.run([args.cuobjdump, "-sass", os.path.join(tmp, cubin)],
                                  capture_output=True, text=True, check=True).stdout
            found = check(sass, args.max_moves)
            if not found:
                sys.exit(f"no wgmma loop found in {cubin}: the listing's format changed?")
            lines += found
    print("\n".join(lines))
    return 1 if any(line.startswith("FAIL") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
