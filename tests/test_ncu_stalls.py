"""benchmarks/ncu_stalls.py: the stall samples of an Nsight Compute SASS page, summed by reason and opcode."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import ncu_stalls as S  # noqa: E402

HEAD = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
        '"stall_long_sb","stall_wait","stall_selected","stall_long_sb (Not Issued)"')


def page(tmp_path: Path, rows: list[str]) -> Path:
    p = tmp_path / "k_sass.csv"
    p.write_text('"Kernel Name","void k<1>(P)",\n' + HEAD + "\n" + "\n".join(rows) + "\n")
    return p


def test_sums_by_reason_and_opcode(tmp_path: Path):
    p = page(tmp_path, [
        '"0x10","      IMAD.SHL.U32 R9, R12, 0x40, RZ","6","5","5","0","1","5"',
        '"0x20","      @!P0 IMAD.WIDE R4, R2, 0x4, R6","2","1","0","1","1","0"',
        '"0x30","      LOP3.LUT R1, R2, 0x1f, RZ, 0xc0, !PT","2","2","0","2","0","0"',
        '"0x40","      EXIT","0","0","0","0","0","0"',
    ])
    s = S.summarize(p)
    assert s["kernel"] == "void k<1>(P)" and s["samples"] == 10 and s["instructions"] == 4
    assert s["by_reason"] == {"long_sb": 0.5, "wait": 0.3, "selected": 0.2}  # the Not Issued twin is not added
    assert list(s["by_opcode"]) == ["IMAD", "LOP3"]  # predicate and modifiers dropped; EXIT has no samples
    assert s["by_opcode"]["IMAD"] == {"share": 0.8, "instructions": 2,
                                      "reasons": {"long_sb": 0.5, "selected": 0.2, "wait": 0.1}}
    assert s["top"][0]["source"].startswith("IMAD.SHL") and s["top"][0]["share"] == 0.6
    out = tmp_path / "s.json"
    assert S.main([str(p), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["kernels"][0]["samples"] == 10 and "ncu_stalls.py" in doc["command"]


def test_bad_pages_name_the_file_and_field(tmp_path: Path):
    with pytest.raises(SystemExit, match="no SASS table"):
        S.summarize(_write(tmp_path / "d.txt", "Duration 4 us\n"))
    bad = page(tmp_path, ['"0x10","      IMAD R1, R2, R3, RZ","six","0","0","0","0","0"'])
    with pytest.raises(SystemExit, match=r"k_sass.csv: row 1, field 'Warp Stall Sampling \(All Samples\)'"):
        S.summarize(bad)
    with pytest.raises(SystemExit, match="no stall samples"):
        S.summarize(page(tmp_path, ['"0x10","      IMAD R1, R2, R3, RZ","0","0","0","0","0","0"']))


def _write(p: Path, text: str) -> Path:
    p.write_text(text)
    return p
