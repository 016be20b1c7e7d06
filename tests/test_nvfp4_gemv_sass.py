"""benchmarks/nvfp4_gemv_sass.py: the SASS parser and pipe counts on a hand-written listing, and (where
nvcc and nvdisasm are installed) the real kernel's instruction mix: the repacked codes' full round has
no PRMT/LEA decode and fewer integer-pipe instructions per MMA step than the compressed-tensors one."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import nvfp4_gemv_sass as S  # noqa: E402

LISTING = """
\t.text._ZN2qg11gemv_kernelILb1ELi1ELb1ELb0EEEvNS_6ParamsE:
        /*0000*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;
        /*0010*/              @!P0 BRA `(.L_x_2) ;
.L_x_1:
        /*0020*/                   ISETP.GE.AND P2, PT, R6, UR23, PT ;
        /*0030*/              @!P2 BRA `(.L_x_3) ;
.L_x_3:
        /*0040*/                   PRMT R18, R97, 0x6020, R20 ;
        /*0050*/                   LOP3.LUT R16, R96, 0x80008000, RZ, 0xc0, !PT ;
        /*0060*/                   LEA.HI R17, R16, R18, RZ, 0x1c ;
        /*0070*/                   HMUL2.BF16_V2 R16, R16, R17 ;
        /*0080*/                   HMMA.16816.F32.BF16 R80, R80, R48, R16 ;
.L_x_4:
        /*0090*/                   ULOP3.LUT UR4, UR4, 0x1, URZ, 0xc0, !UPT ;
        /*00a0*/               @P1 BRA `(.L_x_1) ;
.L_x_2:
        /*00b0*/                   LDG.E.128 R4, desc[UR6][R2.64] ;
        /*00c0*/                   EXIT ;
\t.text._ZN2qg18lora_shrink_kernelILb1ELi8EEEvNS_12ShrinkParamsE:
        /*0000*/                   FFMA R1, R2, R3, R1 ;
"""


def test_parse_splits_functions_and_blocks():
    fns = S.parse_sass(LISTING)
    assert set(fns) == {"_ZN2qg11gemv_kernelILb1ELi1ELb1ELb0EEEvNS_6ParamsE",
                        "_ZN2qg18lora_shrink_kernelILb1ELi8EEEvNS_12ShrinkParamsE"}
    fn = fns["_ZN2qg11gemv_kernelILb1ELi1ELb1ELb0EEEvNS_6ParamsE"]
    # entry (ends at its branch), the loop's head, the round, the latch, the tail
    assert [len(b) for b in fn.blocks] == [2, 2, 5, 2, 2]
    assert fn.labels == {".L_x_1": 1, ".L_x_3": 2, ".L_x_4": 3, ".L_x_2": 4}
    assert fn.blocks[0][1] == S.Instr("BRA", "@!P0", ".L_x_2")
    # the round with its loop control: the head down to its branch into the round, the round, the latch
    body, control = S.steady_round(fn)
    assert control and body == fn.blocks[1] + fn.blocks[2] + fn.blocks[3]


def test_round_without_a_loop_is_the_block_alone():
    fn = S.parse_sass(LISTING.replace("@P1 BRA `(.L_x_1)", "@P1 BRA `(.L_x_2)"))[
        "_ZN2qg11gemv_kernelILb1ELi1ELb1ELb0EEEvNS_6ParamsE"]
    body, control = S.steady_round(fn)
    assert not control and body == fn.blocks[2]


def test_pipes_and_cycle_bound():
    assert [S.pipe_of(o) for o in ("LOP3.LUT", "PRMT", "LEA.HI", "IMAD.SHL.U32", "IMAD.HI.U32", "HMUL2.BF16_V2",
                                   "HMMA.16816.F32.BF16", "LDG.E.128", "ULOP3.LUT", "S2UR", "UTMALDG", "BRA",
                                   "NOP", "XYZ")] == \
        ["alu", "alu", "alu", "fma_heavy", "fma_heavy", "fma", "tensor", "lsu", "uniform", "uniform", "uniform",
         "branch", "other", "other"]
    body, _ = S.steady_round(S.parse_sass(LISTING)["_ZN2qg11gemv_kernelILb1ELi1ELb1ELb0EEEvNS_6ParamsE"])
    pipes = S.pipe_counts(body)
    assert pipes == {"alu": 4, "fma_heavy": 0, "fma": 1, "tensor": 1, "lsu": 0, "branch": 2, "uniform": 1,
                     "other": 0}
    assert S.cycles_lower_bound(pipes) == (9, "issue")  # 9 issued beat 2 x 4 on the integer pipe
    assert S.cycles_lower_bound({**pipes, "alu": 6}) == (12, "alu")
    assert S.cycles_lower_bound({**dict.fromkeys(S.PIPES, 0), "fma_heavy": 3, "fma": 4}) == (7, "fma")


def test_variants_from_mangled_names():
    assert S.variant_of("_ZN2qg11gemv_kernelILb0ELi2ELb1ELb1EEEvNS_6ParamsE") == \
        {"bf16": False, "mt": 2, "aligned": True, "repacked": True, "loop": "rounds"}
    # before the pipe loops the last argument was `bool RING`; since, the loop's number
    assert S.variant_of("_ZN2qg11gemv_kernelILb1ELi1ELb1ELb1ELb1EEEvNS_6ParamsE") == \
        {"bf16": True, "mt": 1, "aligned": True, "repacked": True, "loop": "ring"}
    assert S.variant_of("_ZN2qg11gemv_kernelILb1ELi1ELb1ELb1ELi3EEEvNS_6ParamsE")["loop"] == "pipe2"
    assert S.variant_of("_ZN2qg11gemv_kernelILb1ELi1ELb1ELb0ELi0EEEvNS_6ParamsE")["loop"] == "rounds"
    assert S.variant_of("_ZN2qg18lora_shrink_kernelILb1ELi8EEEvNS_12ShrinkParamsE") is None
    rows = S.analyse(S.parse_sass(LISTING))
    assert len(rows) == 1 and rows[0]["mma_steps"] == 1 and rows[0]["per_step"]["alu"] == 4
    assert rows[0]["opcodes"]["PRMT"] == 1 and rows[0]["with_loop_control"]
    two_tiles = LISTING.replace("ILb1ELi1ELb1ELb0E", "ILb1ELi2ELb1ELb0E")  # one MMA is not a step of 2
    with pytest.raises(SystemExit, match="not a whole number of steps of 2"):
        S.analyse(S.parse_sass(two_tiles))


def test_ptxas_resources():
    err = """ptxas info    : Compiling entry function '_ZN2qg11gemv_kernelILb1ELi1ELb1ELb1EEEvNS_6ParamsE' for 'sm_90'
ptxas info    : Function properties for _ZN2qg11gemv_kernelILb1ELi1ELb1ELb1EEEvNS_6ParamsE
    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 103 registers, used 1 barriers, 448 bytes cmem[0]
ptxas info    : Compiling entry function 'other' for 'sm_90'
ptxas info    : Used 32 registers, 380 bytes cmem[0]
"""
    assert S.ptxas_resources(err) == {
        "_ZN2qg11gemv_kernelILb1ELi1ELb1ELb1EEEvNS_6ParamsE": {"registers": 103, "spill_stores": 8, "spill_loads": 4},
        "other": {"registers": 32}}


def test_sass_file_mode(tmp_path: Path, monkeypatch):
    (tmp_path / "k.sass").write_text(LISTING)
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["nvfp4_gemv_sass.py", "--sass", str(tmp_path / "k.sass"), "--out", str(out)])
    S.main()
    res = json.loads(out.read_text())
    assert res["variants"][0]["binding"] == "issue" and res["repacked_over_compressed_tensors"] == []


def test_missing_nvdisasm_is_named(tmp_path: Path):
    with pytest.raises(SystemExit, match="nope: no such file"):
        S.find_nvdisasm(str(tmp_path / "nope"))


def test_missing_listing_is_named(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["nvfp4_gemv_sass.py", "--sass", str(tmp_path / "none.sass"),
                                      "--out", str(tmp_path / "r.json")])
    with pytest.raises(SystemExit, match="none.sass: no such file"):
        S.main()
    assert not (tmp_path / "r.json").exists()


def test_no_kernel_in_listing_is_an_error(tmp_path: Path, monkeypatch):
    (tmp_path / "k.sass").write_text(LISTING.split("\t.text._ZN2qg18")[0].replace("gemv_kernel", "other"))
    monkeypatch.setattr(sys, "argv", ["nvfp4_gemv_sass.py", "--sass", str(tmp_path / "k.sass"),
                                      "--out", str(tmp_path / "r.json")])
    with pytest.raises(SystemExit, match="no gemv_kernel"):
        S.main()
    assert not (tmp_path / "r.json").exists()


def _nvdisasm() -> str | None:
    try:
        return S.find_nvdisasm(None)
    except SystemExit:
        return None


@pytest.mark.skipif(shutil.which("nvcc") is None or _nvdisasm() is None, reason="needs nvcc and nvdisasm")
def test_real_kernel_instruction_mix(tmp_path: Path, monkeypatch):
    out = tmp_path / "sass.json"
    monkeypatch.setattr(sys, "argv", ["nvfp4_gemv_sass.py", "--out", str(out)])
    S.main()
    res = json.loads(out.read_text())
    by_loop = {loop: [r for r in res["variants"] if r["loop"] == loop] for loop in S.LOOPS}
    # the other loops (repacked codes only): whole chunks between their loads, no spills; at most 128 registers
    # (16-warp blocks) except pipe2, whose blocks hold at most 8 warps (255)
    for loop in ("ring", "pipe", "pipe2"):
        assert len(by_loop[loop]) == 8 and all(r["repacked"] for r in by_loop[loop]), loop
        for r in by_loop[loop]:
            assert r["mma_steps"] % 8 == 0 and r["spill_stores"] == 0, r
            assert r["registers"] <= (255 if loop == "pipe2" else 128), r
    # pipe's unchecked set at one n-tile: U / 2 = 2 chunks of 8 steps in one block; pipe2's: U = 4
    assert {r["mma_steps"] for r in by_loop["pipe"] if r["mt"] == 1} == {16}
    assert {r["mma_steps"] for r in by_loop["pipe2"] if r["mt"] == 1} == {32}
    rows = {(r["bf16"], r["mt"], r["aligned"], r["repacked"]): r for r in by_loop["rounds"]}
    assert len(rows) == 16  # bf16/fp16 x 1/2 n-tiles x aligned or not x two code layouts
    for (bf16, mt, aligned, repacked), r in rows.items():
        # the full round: U = 4 chunks of 8 steps at one n-tile, 2 at two; loop control found around it
        assert r["mma_steps"] == (32 if mt == 1 else 16) and r["with_loop_control"], r
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and 64 <= r["registers"] <= 128, r
        ops = r["opcodes"]
        if repacked:  # the decode this layout exists for: no byte permute, no shift-and-add (LEA.HI: one
            # is left, in the loop's control)
            assert "PRMT" not in ops and ops.get("LEA.HI", 0) <= 1, ops
            other = rows[(bf16, mt, aligned, False)]
            assert r["per_step"]["alu"] < 0.7 * other["per_step"]["alu"]
            assert r["per_step"]["cycles_lower_bound"] < other["per_step"]["cycles_lower_bound"]
            assert r["registers"] <= other["registers"] + 2  # the same warps per SM
        else:
            # a PRMT and a LEA.HI per pair of weights, 4 pairs per step
            assert ops.get("PRMT", 0) >= 4 * r["mma_steps"] and ops.get("LEA.HI", 0) >= 4 * r["mma_steps"], ops
    assert len(res["repacked_over_compressed_tensors"]) == 8
