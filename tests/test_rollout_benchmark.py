"""Pieces of `benchmarks/rollout_throughput.py` and `benchmarks/rollout_plan.py` that run without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import rollout_checkpoints as ck  # noqa: E402
from benchmarks import rollout_plan as plan  # noqa: E402
from benchmarks import rollout_throughput as rt  # noqa: E402

TINY = dict(hidden=64, inter=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=256)


def test_random_bf16_checkpoint_loads_as_a_qwen2_model(tmp_path):
    from transformers import AutoModelForCausalLM

    info = ck.write_bf16_weights(tmp_path / "w", TINY, "cpu")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "w"), dtype=torch.bfloat16)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == info["bytes"]
    assert model.model.layers[1].mlp.down_proj.weight.shape == (64, 128)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 256) and torch.isfinite(logits).all()


def test_engine_specs_and_bytes_per_step():
    assert plan.parse_spec("nf4-r16") == ("nf4", 16, False, False, False)
    assert plan.parse_spec("nvfp4h-r64-ds") == ("nvfp4h", 64, True, False, False)
    assert plan.parse_spec("nvfp4g-r16-ds-pdl") == ("nvfp4g", 16, True, True, False)
    assert plan.parse_spec("nvfp4g-r16-pdl-rp") == ("nvfp4g", 16, False, True, True)
    with pytest.raises(AssertionError, match="nvfp4g engines only"):
        plan.parse_spec("bf16-r16-pdl")
    with pytest.raises(AssertionError, match="nvfp4g engines only"):
        plan.parse_spec("nvfp4h-r16-rp")
    n = plan.linear_params()
    lm_head = 2 * plan.SHAPE["vocab"] * plan.SHAPE["hidden"]
    assert plan.weight_bytes_per_step("bf16", 1, 0, None) == 2 * n + lm_head
    assert plan.weight_bytes_per_step("nf4", 1, 0, None) == int(n * (0.5 + 4 / 64)) + lm_head
    # the project's NVFP4 engine reads dense weights above its threshold
    assert plan.weight_bytes_per_step("nvfp4h", 64, 0, 48) == plan.weight_bytes_per_step("bf16", 64, 0, None)


def _cell(batch: int, tok_s: float) -> dict:
    stat = {"median": tok_s, "min": tok_s, "max": tok_s, "n": 1}
    return {"batch": batch, "lora_rank": 16, "prompt": 256, "decode": 512, "decode_tok_s": stat, "e2e_tok_s": stat}


def _engine(fmt: str, cells: list[dict]) -> dict:
    return {"format": fmt, "max_lora_rank": 16, "cells": cells}


def test_merge_keeps_the_cells_of_an_engine_measured_in_two_runs(tmp_path):
    import json

    a = {"command": "run a", "engines": {"nf4-r16": _engine("nf4", [_cell(1, 140.0), _cell(256, 11000.0)]),
                                         "bf16-r16": _engine("bf16", [_cell(1, 150.0)])}}
    b = {"command": "run b", "engines": {"bf16-r16": _engine("bf16", [_cell(256, 18000.0)])}}
    for name, run in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(run))
    rt.merge([str(tmp_path / "a.json"), str(tmp_path / "b.json")], str(tmp_path / "m.json"))
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["command"] == ["run a", "run b"]
    assert [(c["batch"], c["run"]) for c in m["engines"]["bf16-r16"]["cells"]] == [(1, 0), (256, 1)]
    ratio = {(r["engine"], r["batch"]): r.get("over_bf16") for r in m["summary"]["rows"]}
    assert ratio[("nf4-r16", 1)] == round(140 / 150, 3) and ratio[("nf4-r16", 256)] == round(11000 / 18000, 3)


def test_a_fixed_kv_cache_holds_the_batch():
    # 7B shape: 28 layers x 4 KV heads x 128 x (K, V) x 2 bytes = 57,344 bytes a token
    assert plan.kv_cache_bytes(256, 784) == int(1.1 * 256 * 784 * 57344)  # 12.7 GB
    assert plan.kv_cache_bytes(8, 784) == 2**30  # at least 1 GiB


def test_overlapped_starts_need_memory_for_every_engine():
    plan.check_overlap(2, 0.45)
    with pytest.raises(SystemExit, match=r"--overlap-starts: 3 engines x --mem 0.45 = 1.35 of the GPU; pass --mem 0.32"):
        plan.check_overlap(3, 0.45)


def test_overlapped_engines_must_fit_the_gpu_together():
    """Session 28's H100 (81,559 MiB): the three engines fit with a KV cache for 64 rows and ran; for 256
    rows they would need about 95 GiB (refused before any engine starts); an H200 holds them."""
    specs = ["bf16-r16", "bf16-r16-ds", "nvfp4g-r16-pdl-rp"]
    h100, h200 = 81559 * 2**20, int(139.8 * 2**30)
    gib = {s: plan.engine_resident_bytes(s, 64, 784, 48, 8) / 2**30 for s in specs}
    assert gib["bf16-r16"] == pytest.approx(14.19 + 1.1 * 64 * 784 * 57344 / 2**30 + 3.6, abs=0.05)
    # NVFP4: packed linears + embedding and lm_head, the dense copies (2 bytes a weight), the decode GEMM's codes
    assert gib["nvfp4g-r16-pdl-rp"] == pytest.approx(5.45 + 12.15 + 3.42 + 2.95 + 3.6, abs=0.05)
    plan.check_overlap_memory(specs, 64, 784, 48, 8, h100, 0.3)
    with pytest.raises(SystemExit, match=r"need about 95\.\d GiB together .* the GPU has 79\.6"):
        plan.check_overlap_memory(specs, 256, 784, 48, 8, h100, 0.3)
    plan.check_overlap_memory(specs, 256, 784, 48, 8, h200, 0.3)
    # vLLM refuses to start an engine that finds less free memory than --mem asks of the GPU: at 512 rows two
    # NVFP4 engines (48.2 GiB each) leave 43.4 GiB of the H200, less than 0.315 x 139.8, though all three fit
    big = ["nvfp4g-r16", "nvfp4g-r16-ds", "bf16-r16"]
    plan.check_overlap_memory(big, 512, 784, 48, 8, h200, 0.31)
    with pytest.raises(SystemExit, match=r"last engine would start with about 43\.4 GiB free .* pass a smaller --mem"):
        plan.check_overlap_memory(big, 512, 784, 48, 8, h200, 0.315)
    # without the dense copies or the decode GEMM the NVFP4 engine holds less
    assert plan.engine_resident_bytes("nvfp4-r16", 64, 784, None, 0) < plan.engine_resident_bytes("nvfp4g-r16", 64, 784, 48, 8)


def test_cell_deadline_shares_the_time_left_after_later_engines_start():
    need = plan.cell_need(1, 3, 512)
    assert need == pytest.approx(1.1 * 3.5 * (512 / 150 + 0.5))
    # ample time: a third of what is left once the two later engines (50 s each) have started
    assert plan.cell_deadline(0.0, 540.0, 2, 50.0, need) == pytest.approx(440 / 3)
    # session 11: the first engine came up 114.5 s into 310 s with two to go; it still gets its first cell
    assert plan.cell_deadline(114.5, 310.0, 2, 114.5, need) == pytest.approx(114.5 + need)
    # the last engine takes all that is left, and no engine runs past the deadline
    assert plan.cell_deadline(100.0, 500.0, 0, 50.0, need) == 500.0
    assert plan.cell_deadline(300.0, 310.0, 0, 50.0, need) == 310.0


def test_an_engines_first_cell_is_held_only_to_the_runs_deadline():
    """Session 25: the share promised the first cell, the adapter load spent its margin, and two engines up
    with about 190 and 50 s left measured nothing. The first cell now runs while the run's deadline allows it."""
    need = plan.cell_need(1, 3, 512)
    share_end = plan.cell_deadline(100.0, 330.0, 2, 110.0, need)
    assert share_end == pytest.approx(100.0 + need)  # no share left: only the first cell's time
    later = 100.0 + 2.0  # the adapter load took 2 s
    assert plan.cell_fits(later, need, share_end, 330.0, first=True)
    assert not plan.cell_fits(later, need, share_end, 330.0, first=False)
    assert not plan.cell_fits(330.0 - need + 1.0, need, 330.0, 330.0, first=True)  # never past the run's deadline
