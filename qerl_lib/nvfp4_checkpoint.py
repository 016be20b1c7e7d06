"""A compressed-tensors NVFP4A16 checkpoint written without llm-compressor.

The GPU machine has no llm-compressor, and benchmarks need large NVFP4 checkpoints that never
exist in 16 bits; `write_nvfp4_checkpoint` produces the same tensors as llm-compressor's
`oneshot(QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=["lm_head"]))` (a CPU
test compares them bit for bit) through `qerl_lib.nvfp4.quantize_nvfp4`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

_LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def nvfp4a16_quantization_config() -> dict[str, Any]:
    """config.json's `quantization_config` as llm-compressor writes it for NVFP4A16, lm_head ignored."""
    return {
        "config_groups": {
            "group_0": {
                "format": "nvfp4-pack-quantized",
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": None, "block_structure": None, "dynamic": False, "group_size": 16,
                    "num_bits": 4, "observer": "memoryless_minmax", "observer_kwargs": {},
                    "scale_dtype": "torch.float8_e4m3fn", "strategy": "tensor_group", "symmetric": True,
                    "type": "float", "zp_dtype": None,
                },
            }
        },
        "format": "nvfp4-pack-quantized",
        "global_compression_ratio": None,
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.19.0",
    }


def write_nvfp4_checkpoint(dense_dir: str | Path, out_dir: str | Path) -> Path:
    """NVFP4A16 compressed-tensors checkpoint of a dense Llama/Qwen2 dir, without llm-compressor.

    The same tensors as `oneshot(QuantizationModifier(targets="Linear", scheme="NVFP4A16",
    ignore=["lm_head"]))` writes (bit for bit; a CPU test compares them): every decoder linear
    becomes weight_packed / weight_scale / weight_global_scale through
    `qerl_lib.nvfp4.quantize_nvfp4`, with q/k/v and gate/up sharing one global scale; all other
    tensors are copied. For machines without llm-compressor (the GPU machine) and for tests.
    """
    import shutil

    from safetensors.torch import load_file, save_file

    from qerl_lib.nvfp4 import nvfp4_global_scale, quantize_nvfp4

    dense_dir, out_dir = Path(dense_dir), Path(out_dir)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(dense_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    groups = {"q_proj": ("q_proj", "k_proj", "v_proj"), "k_proj": ("q_proj", "k_proj", "v_proj"),
              "v_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj"),
              "up_proj": ("gate_proj", "up_proj")}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if len(parts) >= 3 and parts[-1] == "weight" and parts[-2] in _LINEAR_SUFFIXES and ".layers." in name:
            prefix = ".".join(parts[:-2])
            members = groups.get(parts[-2], (parts[-2],))
            gs = nvfp4_global_scale(*[tensors[f"{prefix}.{m}.weight"] for m in members])
            packed, scale, gs = quantize_nvfp4(t, gs)
            base = name.removesuffix(".weight")
            out[f"{base}.weight_packed"] = packed.contiguous()
            out[f"{base}.weight_scale"] = scale.contiguous()
            out[f"{base}.weight_global_scale"] = gs.contiguous()
        else:
            out[name] = t
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dense_dir / "config.json").read_text())
    config["quantization_config"] = nvfp4a16_quantization_config()
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for p in dense_dir.iterdir():
        if p.name not in ("config.json", "model.safetensors.index.json") and p.suffix != ".safetensors" and p.is_file():
            shutil.copy(p, out_dir / p.name)
    return out_dir
