"""convert: base model (hub id, HF directory, GGUF file or a packaged model) -> `models/base/`
(plain HF copy) and `models/<quant>/` (NVFP4A16 through llm-compressor, or BF16) with
`convert_report.json` (bytes before / after, quantization error, checkpoint hash). With
`model.nvfp4_calibration: gptq` the NVFP4 rounding is GPTQ's, calibrated on the first training
prompts of `data/prepared/train.parquet` (so `prepare` runs first)."""

from __future__ import annotations

import re
import time
from pathlib import Path

from qerl_lib.config import QerlConfig
from qerl_lib.paths import Layout


def calibration_text(prompt_text: str, solution: str | None) -> str:
    """One calibration sequence: the prompt as the rollouts format it, then the row's worked
    solution when the source has one, without GSM8K's calculator annotations `<<48/2=24>>` (a
    policy writes no such thing). The solution matters: GPTQ weights each input direction by how
    much the calibration text uses it, and a completion's activations are what the policy's
    rollouts run on; on the Qwen base, prompts alone left twice the KL to BF16 of prompts with
    solutions (docs/results_qwen05_gsm8k.md)."""
    return prompt_text + (re.sub(r"<<[^>]*>>", "", solution) if solution else "")


def calibration_ids(tok, rows: list[dict], prompt: str, chat_template: bool) -> list[list[int]]:
    """Token ids of each row's calibration sequence (`calibration_text`): the row (`question`,
    `grader`, `solution`) formatted under `data.prompt` as the rollouts format it, tokenized as
    they tokenize a prompt."""
    from qerl_lib.rewards import format_row

    return [tok(calibration_text(format_row(tok, r, prompt, chat_template), r["solution"]),
                add_special_tokens=False)["input_ids"] for r in rows]


def calibration_from_prepared(train: Path, tokenizer_dir: Path, n: int, prompt: str, chat_template: bool):
    """GPTQ's calibration sequences: the first `n` rows of the prepared `train` split, each the
    prompt text the rollouts feed the model followed by the row's worked solution."""
    from transformers import AutoTokenizer

    from qerl_lib.convert import Calibration
    from qerl_lib.data import DataError, load_prepared

    if not train.is_file():
        raise DataError(f"{train}: not found; model.nvfp4_calibration: gptq calibrates on the prepared "
                        "training prompts, so the prepare stage runs first (`qerl stage prepare`)")
    rows = load_prepared(train)[:n]
    ids = calibration_ids(AutoTokenizer.from_pretrained(str(tokenizer_dir)), rows, prompt, chat_template)
    with_solutions = sum(r["solution"] is not None for r in rows)
    return Calibration(ids, f"{train.name}, first {len(rows)} rows, data.prompt {prompt}, "
                            f"{with_solutions} with their solution", [r["prompt_id"] for r in rows])


def convert_stage(cfg: QerlConfig, layout: Layout) -> dict:
    from qerl_lib.convert import convert
    from qerl_lib.model import base_is_materialized, materialize_base

    t0 = time.perf_counter()
    # A workspace may start with models/base already in place (scripts/device_experiment.sh hard-links one
    # copy into each quantization's workspace): the GGUF -> BF16 copy is most of a convert stage's time.
    if not base_is_materialized(cfg.model.base, cfg.model.gguf_file, layout.base_model):
        materialize_base(cfg.model.base, cfg.model.gguf_file, layout.base_model)
    t1 = time.perf_counter()
    calibration = None
    if cfg.model.quant == "nvfp4" and cfg.model.nvfp4_calibration == "gptq":
        calibration = calibration_from_prepared(layout.prepared("train"), layout.base_model,
                                                cfg.model.nvfp4_calibration_samples, cfg.data.prompt,
                                                cfg.model.chat_template)
    report = convert(layout.base_model, layout.checkpoint(cfg.model.quant), cfg.model.quant, cfg.model.nvfp4_observer,
                     calibration)
    report["seconds_materialize"] = round(t1 - t0, 3)
    report["seconds_convert"] = round(time.perf_counter() - t1, 3)
    return report
