"""The convert stage: base model -> NVFP4A16 (compressed-tensors) or BF16 checkpoint.

NVFP4A16 is made by llm-compressor, data-free:
`QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=["lm_head"])`. The
output is the compressed-tensors format that vLLM loads unchanged (weight_packed uint8
pairs of FP4 E2M1, weight_scale FP8 E4M3 per 16 inputs, weight_global_scale FP32).
`bf16` copies the base as is, for the 16-bit LoRA baseline.

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
from pathlib import Path
from typing import Iterator

import torch

from qerl_lib.io import atomic_dir, atomic_write_json

log = logging.getLogger(__name__)

RECIPE = {"targets": "Linear", "scheme": "NVFP4A16", "ignore": ["lm_head"]}
DEFAULT_OBSERVER = "memoryless_minmax"  # what the NVFP4A16 preset's weights use when no observer is named


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


def convert(base_dir: Path, out_dir: Path, quant: str, observer: str = DEFAULT_OBSERVER) -> dict:
    """Write the checkpoint of `quant` from the plain HF `base_dir`: "nvfp4" the compressed-tensors
    NVFP4A16 checkpoint (group scales chosen by llm-compressor's weight `observer`, config
    `model.nvfp4_observer`), "bf16" and "nf4" a copy (NF4 quantizes when it loads, as QLoRA does)."""
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    if not (base_dir / "config.json").is_file():
        raise FileNotFoundError(f"base model directory {base_dir} has no config.json")
    with atomic_dir(out_dir) as tmp:
        if quant == "nvfp4":
            _nvfp4_oneshot(base_dir, tmp, observer)
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
            "recipe": {**RECIPE, "observer": observer} if quant == "nvfp4" else None,
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


def _nvfp4_oneshot(base_dir: Path, out_dir: Path, observer: str = DEFAULT_OBSERVER) -> None:
    with _quiet_llmcompressor():
        _nvfp4_oneshot_call(base_dir, out_dir, observer)


def nvfp4_recipe(observer: str = DEFAULT_OBSERVER, targets: str | list[str] = RECIPE["targets"]):
    """llm-compressor's modifier for RECIPE; another weight `observer` replaces the preset's
    (the scheme spelled out as a config group: a preset name takes no observer). `targets` other
    than "Linear" (e.g. a `re:` pattern of module names) quantize only those modules: for measuring."""
    from llmcompressor.modifiers.quantization import QuantizationModifier

    if observer == DEFAULT_OBSERVER:
        return QuantizationModifier(**{**RECIPE, "targets": targets})
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme(RECIPE["scheme"], [targets] if isinstance(targets, str) else list(targets))
    scheme.weights.observer = observer
    return QuantizationModifier(config_groups={"group_0": scheme}, ignore=RECIPE["ignore"])


def _nvfp4_oneshot_call(base_dir: Path, out_dir: Path, observer: str = DEFAULT_OBSERVER) -> None:
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl_lib.model import drop_environment_keys

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    recipe = nvfp4_recipe(observer)
    # Data-free: NVFP4A16 needs no calibration set (weights only; every observer here reads the weights alone).
    try:
        oneshot(model=model, recipe=recipe)
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
