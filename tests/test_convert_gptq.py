"""`model.nvfp4_calibration: gptq`: the convert stage's NVFP4 rounding by llm-compressor's GPTQ,
calibrated on the prepared training prompts. Same checkpoint format as round-to-nearest; the
weights move further from the 16-bit ones while the model's outputs on the calibration inputs
move closer (what GPTQ minimises), and the report says what it calibrated on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qerl_lib.convert import GPTQ_SETTINGS, Calibration, convert, nvfp4_recipe


def _calibration(n: int = 12, length: int = 48, vocab: int = 256) -> Calibration:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (n, length), generator=g).tolist()  # above the tiny tokenizer's specials
    return Calibration(ids, "random ids")


def _logits(model_dir: Path, quant: str, *id_sets: list[list[int]]) -> list[torch.Tensor]:
    """The model's logits on each set of sequences, [N, T, vocab] per set (one load)."""
    from qerl_lib.model import load_base

    model = load_base(model_dir, quant, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        return [torch.stack([model(torch.tensor([x])).logits[0] for x in ids]) for ids in id_sets]


def test_gptq_recipe_keeps_the_scheme():
    mod = nvfp4_recipe(gptq=True)
    assert type(mod).__name__ == "GPTQModifier" and mod.scheme == "NVFP4A16" and mod.ignore == ["lm_head"]
    assert (mod.block_size, mod.dampening_frac) == (GPTQ_SETTINGS["block_size"], GPTQ_SETTINGS["dampening_frac"])
    mod = nvfp4_recipe("nvfp4_expanded_mse", gptq=True)
    (group,) = mod.config_groups.values()
    assert type(mod).__name__ == "GPTQModifier" and group.weights.observer == "nvfp4_expanded_mse"


def test_gptq_trades_weight_error_for_output_error(tiny_llama_dir: Path, tmp_path: Path):
    cal = _calibration()
    rtn = convert(tiny_llama_dir, tmp_path / "rtn", "nvfp4")
    gptq = convert(tiny_llama_dir, tmp_path / "gptq", "nvfp4", calibration=cal)
    qc = json.loads((tmp_path / "gptq" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "nvfp4-pack-quantized"
    assert gptq["recipe"]["method"] == "gptq" and rtn["recipe"]["method"] == "rtn"
    assert gptq["recipe"]["calibration_sequences"] == 12 and gptq["recipe"]["calibration_tokens"] == 12 * 48
    assert gptq["layers"] == rtn["layers"] == 14 and gptq["checkpoint_hash"] != rtn["checkpoint_hash"]
    # The same group scales (static order fixes them from the weights first), so the rounding to
    # nearest is the least weight error there is; GPTQ's error-feedback moves off it.
    assert gptq["rel_error_mean"] > rtn["rel_error_mean"]
    # ... and brings the model's outputs on the calibration tokens closer to the 16-bit model's;
    # on held-out tokens too, on this model at least (the Hessian of random tokens is no special case).
    held = torch.randint(3, 256, (4, 48), generator=torch.Generator().manual_seed(1)).tolist()
    ref, ref_h = _logits(tiny_llama_dir, "bf16", cal.input_ids, held)
    err, err_h = {}, {}
    for name in ("rtn", "gptq"):
        out, out_h = _logits(tmp_path / name, "nvfp4", cal.input_ids, held)
        err[name], err_h[name] = float((out - ref).pow(2).mean()), float((out_h - ref_h).pow(2).mean())
    assert err["gptq"] < 0.8 * err["rtn"], err
    assert err_h["gptq"] < err_h["rtn"], err_h


def test_gptq_is_deterministic(tiny_llama_dir: Path, tmp_path: Path):
    cal = _calibration(4, 24)
    a = convert(tiny_llama_dir, tmp_path / "a", "nvfp4", calibration=cal)
    b = convert(tiny_llama_dir, tmp_path / "b", "nvfp4", calibration=cal)
    assert a["checkpoint_hash"] == b["checkpoint_hash"]
    assert a["recipe"]["calibration_ids_sha256"] == b["recipe"]["calibration_ids_sha256"]


def test_calibration_is_for_nvfp4_and_needs_tokens(tiny_llama_dir: Path, tmp_path: Path):
    with pytest.raises(ValueError, match="nvfp4"):
        convert(tiny_llama_dir, tmp_path / "b", "bf16", calibration=_calibration(2, 8))
    assert not (tmp_path / "b").exists()
    with pytest.raises(ValueError, match="non-empty"):
        Calibration([[1, 2], []], "x")


def test_the_stage_calibrates_on_the_first_training_prompts(tiny_llama_dir: Path, tmp_path: Path):
    from qerl_lib.config import load_config
    from qerl_lib.data import DataError, load_prepared
    from qerl_lib.paths import Layout
    from qerl_lib.stages import convert_stage, prepare_stage

    cfg = load_config(None, {
        "run": {"root": str(tmp_path / "ws"), "steps": 1},
        "model": {"base": str(tiny_llama_dir), "nvfp4_calibration": "gptq", "nvfp4_calibration_samples": 5},
        "data": {"synthetic_train": 16, "synthetic_test": 4},
    })
    layout = Layout(tmp_path / "ws")
    with pytest.raises(DataError, match="prepare stage runs first"):
        convert_stage(cfg, layout)
    assert not layout.checkpoint("nvfp4").exists()
    prepare_stage(cfg, layout)
    report = convert_stage(cfg, layout)
    rows = load_prepared(layout.prepared("train"))
    rec = report["recipe"]
    assert rec["method"] == "gptq" and rec["calibration_sequences"] == 5
    assert rec["calibration_prompt_ids"] == [r["prompt_id"] for r in rows[:5]]
    assert json.loads(layout.convert_report("nvfp4").read_text())["recipe"] == rec


def test_calibration_benchmark_with_and_without_solutions(tiny_llama_dir: Path, tmp_path: Path):
    """benchmarks/nvfp4_gptq_calibration.py: GSM8K training problems as calibration text, with their
    solutions as the convert stage builds it (the same checkpoint as `qerl stage convert`), or the
    prompts alone; each summary appended to the JSON list."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import nvfp4_gptq_calibration as B
    from qerl_lib.config import load_config
    from qerl_lib.paths import Layout
    from qerl_lib.stages import convert_stage, prepare_stage

    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS[:2]))
    out = tmp_path / "runs.json"
    for flag in ([], ["--prompts-only"]):
        assert B.main(["--base", str(tiny_llama_dir), "--data", str(tmp_path), "--n", "3", "--out",
                       str(tmp_path / f"ckpt{len(flag)}"), "--json", str(out), *flag]) == 0
    solutions, prompts = json.loads(out.read_text())
    assert prompts["recipe"]["calibration_sequences"] == solutions["recipe"]["calibration_sequences"] == 3
    assert solutions["recipe"]["calibration_tokens"] > prompts["recipe"]["calibration_tokens"]
    assert prompts["checkpoint_hash"] != solutions["checkpoint_hash"]
    cfg = load_config(None, {"run": {"root": str(tmp_path / "ws"), "steps": 1},
                             "model": {"base": str(tiny_llama_dir), "nvfp4_calibration": "gptq",
                                       "nvfp4_calibration_samples": 3},
                             "data": {"source": str(tmp_path), "prompt": "stepwise"}})
    layout = Layout(tmp_path / "ws")
    prepare_stage(cfg, layout)
    report = convert_stage(cfg, layout)
    assert report["checkpoint_hash"] == solutions["checkpoint_hash"]
    assert report["recipe"]["calibration_ids_sha256"] == solutions["recipe"]["calibration_ids_sha256"]
    assert report["recipe"]["calibration_source"].endswith("3 with their solution")


GSM8K_ROWS = [{"question": f"Tom has {i} apples and buys {i} more. How many now?",
               "answer": f"He has {i} + {i} = <<{i}+{i}={2 * i}>>{2 * i} apples.\n#### {2 * i}"} for i in range(1, 6)]


def test_calibration_text_appends_the_solution_without_annotations():
    from qerl_lib.stages.convert import calibration_text

    assert calibration_text("Q? ", GSM8K_ROWS[0]["answer"]) == "Q? He has 1 + 1 = 2 apples.\n#### 2"
    assert calibration_text("Q? ", None) == "Q? "
