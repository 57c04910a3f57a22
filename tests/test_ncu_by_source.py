"""scripts/ncu_by_source.py, which sums ncu's per-instruction stall samples by the source
line nvdisasm's line tables give each instruction, on a listing and a CSV written here
in the formats of `nvdisasm -g -gi` and `ncu --page source --csv --print-source sass`."""

import gzip

import pytest

from conftest import load_script

ncu_by_source = load_script("ncu_by_source")

SRC = "/src/ffi/kernels/k.cu"
HDR = "/deps/cutlass/arch/barrier.h"


def loc(file, line, at=None):
    text = f'\t//## File "{file}", line {line}'
    return text + (f' inlined at "{at[0]}", line {at[1]}' if at else "")


# Two kernels; in "kern_b": a setup instruction at line 5 (outside the scope 10-30),
# two instructions of a K loop inlined at line 12 (one of them a barrier wait at
# barrier.h:424, inlined into a helper at k.cu line 40, itself inlined at line 12),
# one epilogue instruction at line 20, one at line 25 that no part names.
LISTING = "\n".join([
    ".text.kern_a:",
    loc(SRC, 12),
    "        /*0000*/                   NOP ;",
    ".text.kern_b:",
    loc(SRC, 5),
    "        /*0000*/                   S2R R0, SR_TID.X ;",
    loc(HDR, 424, (SRC, 40)), loc(SRC, 40, (SRC, 12)), loc(SRC, 12),
    "        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R1], R2 ;",
    "        /*0020*/                   @!P0 BRA `(.L_x_1) ;",
    loc(SRC, 12),
    "        /*0030*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR4], R24 ;",
    loc(SRC, 20),
    "        /*0040*/                   STG.E.64 desc[UR4][R2.64], R24 ;",
    loc(SRC, 25),
    "        /*0050*/                   EXIT ;",
    ".text.kern_c:",
    loc(SRC, 12),
    "        /*0000*/                   NOP ;",
]) + "\n"

# Absolute addresses from 0x7f00; samples and instructions executed per instruction.
ROWS = [(0x00, 3, 10), (0x10, 40, 100), (0x20, 7, 100), (0x30, 20, 4), (0x40, 5, 8),
        (0x50, 1, 1)]


def write_csv(path, rows=ROWS, gz=False):
    lines = ['"Kernel Name","kern_b"',
             '"Address","Source","Warp Stall Sampling (All Samples)",'
             '"Warp Stall Sampling (Not-issued Samples)","Instructions Executed"']
    lines += [f'"0x{0x7f00 + a:x}","X","{n}","0","{e}"' for a, n, e in rows]
    text = "\n".join(lines) + "\n"
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return str(path)


def test_chains_are_read_innermost_first_and_carried_to_the_next_locations(tmp_path):
    chains = ncu_by_source.instruction_chains(LISTING.splitlines(True), "kern_b")
    assert sorted(chains) == [0x00, 0x10, 0x20, 0x30, 0x40, 0x50]
    assert chains[0x10] == [("barrier.h", 424), ("k.cu", 40), ("k.cu", 12)]
    assert chains[0x20] == chains[0x10]  # no new locations: the previous instruction's
    assert chains[0x30] == [("k.cu", 12)]


@pytest.mark.parametrize("gz", [False, True])
def test_samples_by_part_and_at_the_wait_line(tmp_path, gz):
    chains = ncu_by_source.instruction_chains(LISTING.splitlines(True), "kern_b")
    csv_path = write_csv(tmp_path / ("s.csv.gz" if gz else "s.csv"), gz=gz)
    parts = ncu_by_source.parse_parts(["loop=12", "epilogue=18-22"])
    totals = ncu_by_source.summarize(chains, ncu_by_source.read_csv(csv_path), "k.cu",
                                     (10, 30), parts, wait=("barrier.h", 424))
    assert totals == {"outside": [3, 10, 0], "loop": [67, 204, 47],
                      "epilogue": [5, 8, 0], "other in scope": [1, 1, 0]}


def test_the_outermost_line_in_scope_decides(tmp_path):
    # The wait's chain holds lines 40 and 12: with the scope 10-45 the outermost one
    # in scope (12, the call site) decides, not the helper's line 40.
    chains = ncu_by_source.instruction_chains(LISTING.splitlines(True), "kern_b")
    parts = ncu_by_source.parse_parts(["helper=40", "loop=12"])
    assert ncu_by_source.part_of(chains[0x10], "k.cu", (10, 45), parts) == "loop"
    assert ncu_by_source.part_of(chains[0x10], "k.cu", (35, 45), parts) == "helper"


def test_command_line_prints_the_parts(tmp_path, capsys):
    sass = tmp_path / "k.sass"
    sass.write_text(LISTING)
    csv_path = write_csv(tmp_path / "s.csv")
    assert ncu_by_source.main(["--sass", str(sass), "--kernel", "kern_b", "--csv", csv_path,
                               "--file", "k.cu", "--scope", "10-30", "--part", "loop=12",
                               "--wait", "barrier.h:424"]) == 0
    out = capsys.readouterr().out.splitlines()
    loop = next(line for line in out if line.startswith("loop"))
    assert loop.split()[1] == "67" and "47" in loop.split()


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="no kernel"):
        ncu_by_source.instruction_chains(LISTING.splitlines(True), "kern_z")
    with pytest.raises(SystemExit, match="--part"):
        ncu_by_source.parse_parts(["loop"])
