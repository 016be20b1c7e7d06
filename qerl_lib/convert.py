"""The convert stage: base model -> NVFP4A16 (compressed-tensors) or BF16 checkpoint.

NVFP4A16 is made by llm-compressor, by default data-free round-to-nearest:
`QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=["lm_head"])`. With
calibration token ids (config `model.nvfp4_calibration: gptq`) it is GPTQ instead:
`GPTQModifier` with the same scheme. GPTQ keeps the group scales that the observer picks, but
quantizes each linear's input columns one at a time and spreads each column's rounding error
over the columns not yet quantized, in proportion to H^-1 where H = X^T X is the second moment of
that linear's inputs X over the calibration tokens. So it minimises the error of the layer's
output on those inputs, ||X W^T - X Q^T||, rather than the weights' own error (which grows).
llm-compressor runs it layer by layer, each layer's inputs taken from the already quantized
layers before it. Either way the output is the compressed-tensors format that vLLM loads
unchanged (weight_packed uint8 pairs of FP4 E2M1, weight_scale FP8 E4M3 per 16 inputs,
weight_global_scale FP32). `bf16` copies the base as is, for the 16-bit LoRA baseline.

The report records bytes on disk before and after and, per quantized layer, the
relative Frobenius error ||W - deq(q(W))|| / ||W|| with our own dequantization
(which the tests hold bit-equal to compressed-tensors').
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from qerl_lib.io import atomic_dir, atomic_write_json

log = logging.getLogger(__name__)

RECIPE = {"targets": "Linear", "scheme": "NVFP4A16", "ignore": ["lm_head"]}
DEFAULT_OBSERVER = "memoryless_minmax"  # what the NVFP4A16 preset's weights use when no observer is named
# GPTQModifier's knobs, llm-compressor's defaults spelled out so the report records them: 128
# columns updated per block; 1 % of the Hessian's mean diagonal added to it before its inverse;
# "static" activation order (columns taken by decreasing Hessian diagonal, their group scales fixed
# beforehand, so the checkpoint needs no column permutation and stays plain nvfp4-pack-quantized).
GPTQ_SETTINGS = {"block_size": 128, "dampening_frac": 0.01, "actorder": "static"}


@dataclass(frozen=True)
class Calibration:
    """Token ids that GPTQ measures each linear's inputs on, and where they came from."""

    input_ids: list[list[int]]
    """One list of token ids per sequence (no padding; llm-compressor runs them one at a time)."""
    source: str
    """What the sequences are, for the report (e.g. `data/prepared/train.parquet, first 128 rows`)."""
    prompt_ids: list[str] = field(default_factory=list)
    """The prepared rows' `prompt_id`s, in order, when they come from a prepared split."""

    def __post_init__(self):
        if not self.input_ids or any(not ids for ids in self.input_ids):
            raise ValueError(f"calibration from {self.source}: needs at least one non-empty sequence")

    def dataset(self):
        """The sequences as the `datasets.Dataset` (input_ids, attention_mask) that `oneshot` reads."""
        from datasets import Dataset

        return Dataset.from_dict({"input_ids": self.input_ids, "attention_mask": [[1] * len(x) for x in self.input_ids]})

    def record(self) -> dict:
        ids_hash = hashlib.sha256(json.dumps(self.input_ids).encode()).hexdigest()
        return {"calibration_source": self.source, "calibration_sequences": len(self.input_ids),
                "calibration_tokens": sum(map(len, self.input_ids)), "calibration_ids_sha256": ids_hash,
                "calibration_prompt_ids": self.prompt_ids}


def weight_files(model_dir: Path) -> list[Path]:
    return sorted(Path(model_dir).glob("*.safetensors"))


def dir_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in weight_files(model_dir))


def checkpoint_hash(model_dir: Path) -> str:
    """sha256 over the weight files and config (names and bytes), in name order."""
    h = hashlib.sha256()
    for p in [*weight_files(model_dir), Path(model_dir) / "config.json"]:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _tensors(model_dir: Path) -> dict[str, tuple[Path, str]]:
    from safetensors import safe_open

    index = {}
    for p in weight_files(model_dir):
        with safe_open(p, "pt") as f:
            for k in f.keys():
                index[k] = (p, k)
    return index


def _load(ref: tuple[Path, str]) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(ref[0], "pt") as f:
        return f.get_tensor(ref[1])


def quantization_errors(base_dir: Path, quant_dir: Path) -> dict[str, float]:
    """Relative Frobenius error per quantized linear (name without `.weight`)."""
    from qerl_lib.nvfp4 import dequantize_nvfp4

    base, quant = _tensors(base_dir), _tensors(quant_dir)
    errors = {}
    for key in sorted(quant):
        if not key.endswith(".weight_packed"):
            continue
        name = key[: -len(".weight_packed")]
        w = _load(base[name + ".weight"]).float()
        deq = dequantize_nvfp4(
            _load(quant[key]), _load(quant[name + ".weight_scale"]), _load(quant[name + ".weight_global_scale"]),
            dtype=torch.float32,
        )
        errors[name] = float((w - deq).norm() / w.norm().clamp_min(1e-30))
    return errors


def convert(base_dir: Path, out_dir: Path, quant: str, observer: str = DEFAULT_OBSERVER,
            calibration: "Calibration | None" = None) -> dict:
    """Write the checkpoint of `quant` from the plain HF `base_dir`: "nvfp4" the compressed-tensors
    NVFP4A16 checkpoint (group scales chosen by llm-compressor's weight `observer`, config
    `model.nvfp4_observer`; rounded by GPTQ on `calibration`'s token ids when given, else to
    nearest), "bf16" and "nf4" a copy (NF4 quantizes when it loads, as QLoRA does)."""
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    if not (base_dir / "config.json").is_file():
        raise FileNotFoundError(f"base model directory {base_dir} has no config.json")
    if calibration is not None and quant != "nvfp4":
        raise ValueError(f"calibration is for model.quant 'nvfp4' only, got {quant!r}")
    with atomic_dir(out_dir) as tmp:
        if quant == "nvfp4":
            _nvfp4_oneshot(base_dir, tmp, observer, calibration)
        elif quant in ("bf16", "nf4"):
            for p in base_dir.iterdir():
                if p.is_file():
                    shutil.copy2(p, tmp / p.name)
        else:
            raise ValueError(f"model.quant must be 'nvfp4', 'bf16' or 'nf4', got {quant!r}")
        errors = quantization_errors(base_dir, tmp) if quant == "nvfp4" else {}
        before, after = dir_bytes(base_dir), dir_bytes(tmp)
        report = {
            "quant": quant,
            "recipe": _recipe_record(observer, calibration) if quant == "nvfp4" else None,
            "bytes_before": before,
            "bytes_after": after,
            "size_ratio": after / before,
            "checkpoint_hash": checkpoint_hash(tmp),
            "layers": len(errors),
            "rel_error_mean": sum(errors.values()) / len(errors) if errors else 0.0,
            "rel_error_max": max(errors.values()) if errors else 0.0,
            "rel_error_per_layer": errors,
        }
        atomic_write_json(tmp / "convert_report.json", report)
    log.info("convert %s: %d -> %d bytes", quant, before, after)
    return report


@contextmanager
def _quiet_llmcompressor() -> Iterator[None]:
    """llm-compressor's console log off while it converts: it writes to stdout through loguru, at
    import and per call, "No accelerator available! Compressing model on CPU instead" (the plan
    on a CPU: NVFP4A16 is data-free) and a dozen lifecycle INFO lines; transformers adds a
    50 GB shard-size warning about llm-compressor's CPU offloading on save. Errors still raise.
    A user's LLM_COMPRESSOR_LOG_LEVEL keeps its logs."""
    import warnings

    if "LLM_COMPRESSOR_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["LLM_COMPRESSOR_LOG_LEVEL"] = "ERROR"  # read once, by its first import
    try:
        import llmcompressor  # noqa: F401
    finally:
        del os.environ["LLM_COMPRESSOR_LOG_LEVEL"]
    from loguru import logger

    logger.disable("llmcompressor")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Attempting to save a model with offloaded modules")
            yield
    finally:
        logger.enable("llmcompressor")


def _nvfp4_oneshot(base_dir: Path, out_dir: Path, observer: str = DEFAULT_OBSERVER,
                   calibration: "Calibration | None" = None) -> None:
    with _quiet_llmcompressor():
        _nvfp4_oneshot_call(base_dir, out_dir, observer, calibration)


def _recipe_record(observer: str, calibration: "Calibration | None") -> dict:
    """What the convert report says about how the NVFP4 checkpoint was made."""
    if calibration is None:
        return {**RECIPE, "observer": observer, "method": "rtn"}
    return {**RECIPE, "observer": observer, "method": "gptq", **GPTQ_SETTINGS, **calibration.record()}


def nvfp4_recipe(observer: str = DEFAULT_OBSERVER, targets: str | list[str] = RECIPE["targets"], gptq: bool = False):
    """llm-compressor's modifier for RECIPE; another weight `observer` replaces the preset's
    (the scheme spelled out as a config group: a preset name takes no observer). `targets` other
    than "Linear" (e.g. a `re:` pattern of module names) quantize only those modules: for measuring.
    `gptq`: the GPTQModifier with the same scheme (it needs calibration data), else round-to-nearest."""
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier

    cls, extra = (GPTQModifier, GPTQ_SETTINGS) if gptq else (QuantizationModifier, {})
    if observer == DEFAULT_OBSERVER:
        return cls(**{**RECIPE, "targets": targets}, **extra)
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme(RECIPE["scheme"], [targets] if isinstance(targets, str) else list(targets))
    scheme.weights.observer = observer
    return cls(config_groups={"group_0": scheme}, ignore=RECIPE["ignore"], **extra)


def _nvfp4_oneshot_call(base_dir: Path, out_dir: Path, observer: str = DEFAULT_OBSERVER,
                        calibration: "Calibration | None" = None) -> None:
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl_lib.model import drop_environment_keys

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    recipe = nvfp4_recipe(observer, gptq=calibration is not None)
    # Round-to-nearest is data-free (every observer here reads the weights alone); GPTQ runs
    # llm-compressor's sequential pipeline over the calibration sequences, one layer at a time.
    data = {} if calibration is None else {
        "dataset": calibration.dataset(), "num_calibration_samples": len(calibration.input_ids),
        "max_seq_length": max(map(len, calibration.input_ids)), "shuffle_calibration_samples": False,
    }
    try:
        oneshot(model=model, recipe=recipe, **data)
        model.save_pretrained(str(out_dir), save_compressed=True)  # reads the session's recipe
    finally:
        # llm-compressor's global session keeps the model (and its lifecycle state) after oneshot:
        # 280 MB of SmolLM2 held for the rest of a `qerl run`, and state a second convert would reuse.
        from llmcompressor.core import reset_session

        reset_session()
    tokenizer.save_pretrained(str(out_dir))
    drop_environment_keys(out_dir / "tokenizer_config.json")
    cfg = json.loads((out_dir / "config.json").read_text())
    fmt = cfg.get("quantization_config", {}).get("format")
    if fmt != "nvfp4-pack-quantized":
        raise RuntimeError(f"llm-compressor wrote format {fmt!r}, expected 'nvfp4-pack-quantized'")
