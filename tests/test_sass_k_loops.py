"""scripts/sass_k_loops.py, the check that the persistent kernels' wgmma K loops move no
accumulators, on listings written here in cuobjdump -sass's format (the check of the
built extension itself needs cuobjdump and runs in scripts/gpu_ci.sh)."""

from conftest import load_script

sass_k_loops = load_script("sass_k_loops")

NAME = "_ZN3mok4cuda12_GLOBAL__N_122moe_forward_persistentINS_4bf16ELi128EEEvNS1_6ParamsE"


def listing(moves, name=NAME, wgmma=True, spills=0, back_edge="@!P2 BRA 0x20", others=0):
    """One function: a task loop from 0x10 around a K loop from 0x20 whose body holds
    `moves` register moves into the accumulators (R24..R151 of a 64x256 wgmma),
    `others` moves between other registers, `spills` local-memory stores and (if
    `wgmma`) four HGMMAs, closed by `back_edge`."""
    body = ["YIELD", "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R179+URZ], R52"]
    body += [f"IMAD.MOV.U32 R{52 + i}, RZ, RZ, R{162 + i}" for i in range(moves)]
    body += [f"MOV R{152 + i % 20}, R{2 + i % 20}" for i in range(others)]
    body += [f"STL [R1+{4 * i:#x}], R{24 + i}" for i in range(spills)]
    if wgmma:
        body += ["HGMMA.64x256x16.F32.BF16 R24, gdesc[UR20].tnspB, R24, UP0"] * 3
        body += ["HGMMA.64x256x16.F32.BF16 R24, gdesc[UR20].tnspB, R24, gsb0",
                 "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
    body += ["@!PT LDS RZ, [RZ]", back_edge]  # the K loop's back edge
    code = ["MOV R1, c[0x0][0x28]", "S2R R0, SR_TID.X"] + body + [
        "ST.E desc[UR14][R90.64], R13", "@P0 BRA 0x10", "EXIT"]  # the task loop's back edge
    lines = [f"\t\tFunction : {name}", "\t.headerflags\t@\"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)\""]
    lines += [f"        /*{16 * i:04x}*/                   {text} ;  /* 0x0 */"
              for i, text in enumerate(code)]
    return "\n".join(lines) + "\n"


def test_moves_in_a_k_loop_fail_the_check():
    lines = sass_k_loops.check(listing(moves=64), max_moves=16)
    assert len(lines) == 1  # the K loop only, not the task loop around it
    assert lines[0].startswith("FAIL")
    assert "moe_forward_persistent<bf16, 128>" in lines[0]
    assert "4 HGMMA, 64 moves" in lines[0]


def test_a_k_loop_with_few_moves_passes():
    lines = sass_k_loops.check(listing(moves=8), max_moves=16)
    assert len(lines) == 1 and lines[0].startswith("ok"), lines
    assert "8 moves" in lines[0]


def test_moves_of_other_registers_do_not_count():
    # R152 and up lie past the 128 accumulators from R24; R23 and below before them.
    lines = sass_k_loops.check(listing(moves=0, others=40), max_moves=0)
    assert len(lines) == 1 and lines[0].startswith("ok") and "0 moves" in lines[0], lines
    one_in = listing(moves=0, others=40).replace("MOV R152, R2 ", "MOV R152, R151 ")
    lines = sass_k_loops.check(one_in, max_moves=0)
    assert len(lines) == 1 and lines[0].startswith("FAIL") and "2 moves" in lines[0], lines


def test_the_innermost_loop_is_measured():
    # The K loop starts at 0x20 (its back edge branches there), the task loop at 0x10.
    (first, last, count, wgmmas, moves), = sass_k_loops.wgmma_loops(
        list(next(sass_k_loops.functions(listing(moves=3)))[1]))
    assert first == 0x20 and (wgmmas, moves) == (4, 3)
    assert count == 2 + 3 + 5 + 2  # wait, moves, four wgmmas and their wait, back edge


def test_functions_without_wgmma_and_several_functions():
    other = listing(moves=40, name="_ZN3mok4cuda7routingEv", wgmma=False)
    lines = sass_k_loops.check(listing(moves=2) + other + listing(moves=30), max_moves=16)
    assert [line.split()[0] for line in lines] == ["ok", "FAIL"]


def test_spilled_accumulators_count_as_moves():
    lines = sass_k_loops.check(listing(moves=4, spills=20), max_moves=16)
    assert len(lines) == 1 and lines[0].startswith("FAIL") and "24 moves" in lines[0], lines


def test_a_wgmma_outside_every_loop_fails():
    # No back edge to 0x20 (a branch forward instead): the wgmmas lie in the task loop
    # from 0x10 only, which is measured; with no back edge at all they lie in no loop.
    forward = listing(moves=0, back_edge="@!P2 BRA 0x400")
    lines = sass_k_loops.check(forward, max_moves=16)
    assert len(lines) == 1 and "0x00010-" in lines[0], lines
    alone = forward.replace("@P0 BRA 0x10", "NOP")
    lines = sass_k_loops.check(alone, max_moves=16)
    assert lines and all(line.startswith("FAIL") and "no loop" in line for line in lines), lines


def test_branches_with_modifiers_close_loops():
    lines = sass_k_loops.check(listing(moves=2, back_edge="@!P2 BRA.U 0x20"), max_moves=16)
    assert len(lines) == 1 and lines[0].startswith("ok") and "0x00020-" in lines[0], lines
