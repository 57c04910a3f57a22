"""scripts/hlo_fusions.py: finds custom calls inside fusions in HLO text."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

import hlo_fusions  # noqa: E402

# The shape of what aborted XLA's GPU compiler (seen on two H200s, 2026-11-30): a
# scatter fusion whose combiner holds a custom call.
_BAD = """\
HloModule m, entry_computation_layout={(s32[4]{0})->s32[4]{0}}

%region_3.13 (a: s32[], b: s32[]) -> s32[] {
  %a = s32[] parameter(0)
  %b = s32[] parameter(1)
  %add.33 = s32[] custom-call(%a), custom_call_target="Sharding"
  ROOT %add = s32[] add(%add.33, %b)
}

%fused_scatter.5 (p0: s32[4], p1: s32[2,1], p2: s32[2]) -> s32[4] {
  %p0 = s32[4]{0} parameter(0)
  %p1 = s32[2,1]{1,0} parameter(1)
  %p2 = s32[2]{0} parameter(2)
  ROOT %scatter = s32[4]{0} scatter(%p0, %p1, %p2), to_apply=%region_3.13
}

ENTRY %main (x: s32[4]) -> s32[4] {
  %x = s32[4]{0} parameter(0)
  %mok = s32[4]{0} custom-call(%x), custom_call_target="mok_combine"
  ROOT %input_scatter_fusion#1 = s32[4]{0} fusion(%mok, %i, %u), kind=kInput, calls=%fused_scatter.5
}
"""


def test_finds_a_custom_call_in_a_fusions_scatter_combiner():
    found = hlo_fusions.fused_custom_calls(_BAD)
    assert len(found) == 1
    fusion, call = found[0]
    assert "input_scatter_fusion#1" in fusion and 'custom_call_target="Sharding"' in call
    assert hlo_fusions.fused_custom_calls(_BAD, target_prefix="Sharding") == found


def test_a_custom_call_outside_every_fusion_is_not_reported():
    assert hlo_fusions.fused_custom_calls(_BAD, target_prefix="mok_") == []
    clean = _BAD.replace('custom-call(%a), custom_call_target="Sharding"', "copy(%a)")
    assert hlo_fusions.fused_custom_calls(clean) == []


def test_the_command_line_reports_the_first_bad_pass(tmp_path, capsys):
    (tmp_path / "module_0001.jit_f.0007.fusion.after_priority-fusion.before_cse.txt").write_text(_BAD)
    (tmp_path / "module_0001.jit_f.0006.fusion.after_pipeline-start.before_x.txt").write_text(
        _BAD.replace("fusion(%mok, %i, %u), kind=kInput, calls=%fused_scatter.5",
                     "add(%mok, %mok)"))
    assert hlo_fusions.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "first fused * custom call: module_0001.jit_f.0007" in out
    assert "the pass before it wrote: module_0001.jit_f.0006" in out
