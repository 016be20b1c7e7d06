"""Checkpoint loaders: causal LMs whose quantized linears are `NVFP4Linear` (packed, never 16-bit), or
plain 16/32-bit ones.

- `load_nvfp4_model(dir, dtype, device)` builds a causal LM from an llm-compressor
  NVFP4A16 checkpoint without ever materialising the quantized linears in 16 bits.
- `load_dense_model(dir, dtype, device)` loads a plain 16/32-bit checkpoint.
- `load_model(dir, quant, dtype, device)` picks one of them by `quant`.

Every refusal is a `CheckpointError` naming the file and tensor key.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Literal

import torch
from torch import nn

from qerl_lib.nvfp4 import BLOCK_SIZE
from qerl_lib.nvfp4_linear import NVFP4Linear

# ---------------------------------------------------------------------------------------
# Checkpoint reading
# ---------------------------------------------------------------------------------------

QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and tensor key."""


def _safetensors_files(checkpoint_dir: Path) -> dict[str, Path]:
    """key -> file holding it, for single-file and sharded (`*.index.json`) checkpoints."""
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {key: checkpoint_dir / name for key, name in weight_map.items()}
    single = checkpoint_dir / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{checkpoint_dir}: no model.safetensors or model.safetensors.index.json")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {key: single for key in f.keys()}


def _matches(name: str, module: nn.Module, patterns: Iterable[str]) -> bool:
    """compressed-tensors target semantics: `re:<regex>` (re.match on the module name), an
    exact module name, or a class name anywhere in the module's MRO."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif pattern == name or any(cls.__name__ == pattern for cls in type(module).__mro__):
            return True
    return False


def _nvfp4_groups(quant_config: dict, checkpoint_dir: Path) -> tuple[list[str], list[str]]:
    """(targets, ignore) of an NVFP4A16 `quantization_config`; raise if it is anything else."""
    where = f"{checkpoint_dir / 'config.json'}: quantization_config"
    if quant_config.get("quant_method") != "compressed-tensors":
        raise CheckpointError(f"{where}.quant_method is {quant_config.get('quant_method')!r}, not 'compressed-tensors'")
    targets: list[str] = []
    for group_name, group in quant_config.get("config_groups", {}).items():
        fmt = group.get("format") or quant_config.get("format")
        w = group.get("weights") or {}
        if fmt != "nvfp4-pack-quantized" or w.get("num_bits") != 4 or w.get("type") != "float" or w.get("group_size") != BLOCK_SIZE:
            raise CheckpointError(f"{where}.config_groups.{group_name} is not NVFP4 (format {fmt!r}, weights {w})")
        if group.get("input_activations"):
            raise CheckpointError(f"{where}.config_groups.{group_name} quantizes activations; only NVFP4A16 is supported")
        targets.extend(group.get("targets", []))
    if not targets:
        raise CheckpointError(f"{where} has no config_groups targets")
    return targets, list(quant_config.get("ignore") or [])


def _replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _swap_quantized_linears(
    model: nn.Module, targets: list[str], ignore: list[str], keys: set[str], checkpoint_dir: Path, dtype: torch.dtype
) -> list[str]:
    """Replace every targeted, non-ignored nn.Linear by an (empty, meta) NVFP4Linear.

    Cross-checks the config against the tensors: a targeted linear must have its packed
    tensors in the checkpoint and an untargeted one must not.
    """
    swapped = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        wanted = _matches(name, module, targets) and not _matches(name, module, ignore)
        present = f"{name}.weight_packed" in keys
        if wanted != present:
            state = "is missing" if wanted else "is present although the config does not quantize this layer"
            raise CheckpointError(f"{checkpoint_dir}: tensor {name}.weight_packed {state}")
        if wanted:
            _replace_module(
                model,
                name,
                NVFP4Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta", bias_dtype=dtype),
            )
            swapped.append(name)
    return swapped


def _expected_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Persistent parameters and buffers the checkpoint must provide, by state-dict key."""
    return model.state_dict(keep_vars=True)


def _load_tensors(
    model: nn.Module,
    files: dict[str, Path],
    checkpoint_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    tied: bool,
) -> None:
    """Assign every checkpoint tensor to its (meta) slot, casting float non-NVFP4 tensors to `dtype`."""
    from safetensors import safe_open

    expected = _expected_tensors(model)
    optional = {"lm_head.weight"} if tied else set()
    missing = sorted(set(expected) - set(files) - optional)
    if missing:
        raise CheckpointError(f"{checkpoint_dir}: tensor {missing[0]} missing from the checkpoint ({len(missing)} missing)")
    unexpected = sorted(set(files) - set(expected))
    if unexpected:
        raise CheckpointError(
            f"{files[unexpected[0]]}: tensor {unexpected[0]} has no place in {type(model).__name__} ({len(unexpected)} unexpected)"
        )
    loaded: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for key, path in files.items():
        by_file.setdefault(path, []).append(key)
    for path, keys in by_file.items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in keys:
                tensor = f.get_tensor(key)
                slot = expected[key]
                if tuple(tensor.shape) != tuple(slot.shape):
                    raise CheckpointError(
                        f"{path}: tensor {key} has shape {tuple(tensor.shape)}, the model expects {tuple(slot.shape)}"
                    )
                quantized_part = key.rsplit(".", 1)[-1] in QUANT_SUFFIXES
                if quantized_part:
                    if tensor.dtype != slot.dtype:
                        raise CheckpointError(f"{path}: tensor {key} has dtype {tensor.dtype}, expected {slot.dtype}")
                    tensor = tensor.to(device)
                else:
                    tensor = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
                loaded[key] = tensor
    result = model.load_state_dict(loaded, strict=False, assign=True)
    leftover = [k for k in result.missing_keys if k not in optional]
    if leftover or result.unexpected_keys:
        raise CheckpointError(f"{checkpoint_dir}: could not place tensors {leftover or result.unexpected_keys}")


def _freeze(model: nn.Module) -> None:
    for p in model.parameters():
        p.requires_grad_(False)


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_nvfp4_model(
    checkpoint_dir: str | Path, dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = "cpu"
):
    """Build the causal LM of an llm-compressor NVFP4A16 checkpoint with packed NVFP4Linear layers.

    The model skeleton is created under `accelerate.init_empty_weights(include_buffers=False)`
    (parameters on the meta device, rotary buffers real), every linear the
    checkpoint's `quantization_config` targets (and does not ignore) becomes an
    `NVFP4Linear`, and the safetensors tensors are assigned in place (`assign=True`), so
    no 16-bit copy of a quantized weight ever exists. Non-quantized float tensors
    (embeddings, norms, lm_head, biases) are cast to `dtype`; NVFP4 buffers keep their
    uint8 / float8 / float32 dtypes. Embeddings are tied when the config says so. The
    model is returned in eval mode with no parameter requiring grad.

    Raises CheckpointError naming the file and key when a tensor is missing, extra, or
    of the wrong shape, or when the config is not NVFP4A16.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    checkpoint_dir = Path(checkpoint_dir)
    device = _resolve_device(device)
    config = AutoConfig.from_pretrained(checkpoint_dir)
    quant_config = getattr(config, "quantization_config", None)
    if quant_config is None:
        raise CheckpointError(f"{checkpoint_dir / 'config.json'} has no quantization_config; use load_dense_model")
    if not isinstance(quant_config, dict):
        quant_config = quant_config.to_dict()
    targets, ignore = _nvfp4_groups(quant_config, checkpoint_dir)
    files = _safetensors_files(checkpoint_dir)

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _swap_quantized_linears(model, targets, ignore, set(files), checkpoint_dir, dtype)
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    _load_tensors(model, files, checkpoint_dir, dtype, device, tied)
    if tied:
        model.tie_weights()
        if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
            model.get_output_embeddings().weight = model.get_input_embeddings().weight
    meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if meta:
        raise CheckpointError(f"{checkpoint_dir}: tensor {meta[0]} was not loaded")
    model.to(device)  # the rotary buffers, which were built real on the CPU
    if (checkpoint_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(checkpoint_dir)
    model.config._name_or_path = str(checkpoint_dir)
    model.name_or_path = str(checkpoint_dir)
    _freeze(model)
    return model.eval()


def load_dense_model(
    checkpoint_dir: str | Path, dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = "cpu"
):
    """Load a plain (unquantized) causal-LM checkpoint in `dtype` on `device`, frozen, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint_dir = Path(checkpoint_dir)
    config = AutoConfig.from_pretrained(checkpoint_dir)
    if getattr(config, "quantization_config", None) is not None:
        raise CheckpointError(f"{checkpoint_dir / 'config.json'} holds a quantization_config; use load_nvfp4_model")
    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=dtype).to(_resolve_device(device))
    _freeze(model)
    return model.eval()


def load_model(
    checkpoint_dir: str | Path,
    quant: Literal["nvfp4", "bf16"],
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = "cpu",
):
    """`load_nvfp4_model` for quant == "nvfp4", `load_dense_model` for "bf16" (the 16-bit baseline)."""
    if quant == "nvfp4":
        return load_nvfp4_model(checkpoint_dir, dtype, device)
    if quant == "bf16":
        return load_dense_model(checkpoint_dir, dtype, device)
    raise ValueError(f"unknown quant {quant!r}; expected 'nvfp4' or 'bf16'")
