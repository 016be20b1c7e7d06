"""The synthetic checkpoints and adapters of the rollout benchmarks (`benchmarks/rollout_throughput.py`,
`benchmarks/rl_step.py`): the Qwen2.5-7B shape (`decode_gemm_profile.SHAPE`) with random weights.

- `write_synthetic`: an NVFP4 checkpoint in compressed-tensors layout, packed directly on the GPU (random
  FP4 codes, FP8 block scales, one global scale per fused group; embeddings and lm_head bf16), and a
  config-only BF16 directory (vLLM's `load_format="dummy"` fills it);
- `write_bf16_weights`: a random BF16 checkpoint, one shard per layer (for vLLM's in-flight NF4);
- `write_adapter`: a random PEFT LoRA adapter of rank r for every projection.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.decode_gemm_profile import GLOBAL_SCALE, SHAPE

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DEVICE = "cuda"


def linear_shapes(shape: dict | None = None) -> dict[str, tuple[int, int]]:
    """{module path inside a decoder layer: (out_features, in_features)} of the seven linears, in order."""
    shape = shape or SHAPE
    h, i = shape["hidden"], shape["inter"]
    q, kv = shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
    return {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}


def qwen7b_config(quantized: bool, shape: dict | None = None) -> dict:
    """config.json of the Qwen2.5-7B shape (or `shape`), NVFP4A16 when `quantized`."""
    from transformers import Qwen2Config

    shape = shape or SHAPE
    c = Qwen2Config(hidden_size=shape["hidden"], intermediate_size=shape["inter"], num_hidden_layers=shape["layers"],
                    num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"], vocab_size=shape["vocab"],
                    max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1e6,
                    dtype="bfloat16")
    c.architectures = ["Qwen2ForCausalLM"]
    d = c.to_dict()
    if quantized:
        from qerl_lib.nvfp4_checkpoint import nvfp4a16_quantization_config

        d["quantization_config"] = nvfp4a16_quantization_config()
    return d


def synth_packed(n: int, k: int, gen):
    import torch

    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=DEVICE, generator=gen)
    scale = (torch.rand((n, k // 16), device=DEVICE, generator=gen) + 0.5).to(torch.float8_e4m3fn)
    return packed, scale


def write_synthetic(work: Path) -> dict:
    """NVFP4 checkpoint (packed directly) and a BF16 config-only dir; returns the GPU tensors of the linears."""
    import torch
    from safetensors.torch import save_file

    nv, bf = work / "nvfp4", work / "bf16"
    t0 = time.perf_counter()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    h, L, V = SHAPE["hidden"], SHAPE["layers"], SHAPE["vocab"]
    q, kv = SHAPE["heads"] * SHAPE["head_dim"], SHAPE["kv_heads"] * SHAPE["head_dim"]
    gs = torch.tensor([GLOBAL_SCALE], dtype=torch.float32)
    layers = []
    tensors = {}
    for l in range(L):
        pre = f"model.layers.{l}"
        gpu = {}
        for m, (n, k) in linear_shapes().items():
            packed, scale = synth_packed(n, k, gen)
            gpu[m] = (packed, scale)
            tensors[f"{pre}.{m}.weight_packed"] = packed.cpu()
            tensors[f"{pre}.{m}.weight_scale"] = scale.cpu()
            tensors[f"{pre}.{m}.weight_global_scale"] = gs.clone()
        for m, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            tensors[f"{pre}.self_attn.{m}.bias"] = (torch.randn(n, generator=None) * 0.01).to(torch.bfloat16)
        tensors[f"{pre}.input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        tensors[f"{pre}.post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        layers.append(gpu)
    tensors["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    tensors["model.embed_tokens.weight"] = (torch.randn(V, h, device=DEVICE, generator=gen) * 0.02).to(torch.bfloat16).cpu()
    tensors["lm_head.weight"] = (torch.randn(V, h, device=DEVICE, generator=gen) * 0.02).to(torch.bfloat16).cpu()
    nv.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(nv / "model.safetensors"), metadata={"format": "pt"})
    (nv / "config.json").write_text(json.dumps(qwen7b_config(True), indent=1))
    bf.mkdir(parents=True, exist_ok=True)
    (bf / "config.json").write_text(json.dumps(qwen7b_config(False), indent=1))
    size = (nv / "model.safetensors").stat().st_size
    del tensors
    return {"layers": layers, "seconds": round(time.perf_counter() - t0, 1), "nvfp4_file_bytes": size}


def write_bf16_weights(out: Path, shape: dict | None = None, device: str | None = None) -> dict:
    """A random BF16 checkpoint of `shape` (default the 7B one) for engines that must read real 16-bit
    weights (vLLM's in-flight NF4). One safetensors shard per decoder layer plus the index, so the
    host never holds more than one layer (about 0.5 GB for the 7B shape)."""
    import torch
    from safetensors.torch import save_file

    shape = shape or SHAPE
    device = device or DEVICE
    t0 = time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(1)
    h, L, V = shape["hidden"], shape["layers"], shape["vocab"]
    q, kv = shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]

    def rand(*size, std=0.02):
        return (torch.randn(*size, device=device, generator=gen) * std).to(torch.bfloat16).cpu()

    out.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    shards = L + 1
    for l in range(L + 1):
        name = f"model-{l + 1:05d}-of-{shards:05d}.safetensors"
        if l < L:
            pre = f"model.layers.{l}"
            t = {f"{pre}.{m}.weight": rand(n, k) for m, (n, k) in linear_shapes(shape).items()}
            for m, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                t[f"{pre}.self_attn.{m}.bias"] = rand(n, std=0.01)
            t[f"{pre}.input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
            t[f"{pre}.post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        else:
            t = {"model.norm.weight": torch.ones(h, dtype=torch.bfloat16), "model.embed_tokens.weight": rand(V, h),
                 "lm_head.weight": rand(V, h)}
        save_file(t, str(out / name), metadata={"format": "pt"})
        total += sum(x.numel() * x.element_size() for x in t.values())
        weight_map.update({k: name for k in t})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(qwen7b_config(False, shape), indent=1))
    return {"seconds": round(time.perf_counter() - t0, 1), "bytes": total}


def write_adapter(out: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter for the 7B shape (random A and B, bf16), as `lora.save_adapter` lays it out."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    t = {}
    for l in range(SHAPE["layers"]):
        for m, (fan_out, fan_in) in linear_shapes().items():
            key = f"base_model.model.model.layers.{l}.{m}"
            t[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=g) / fan_in**0.5).to(torch.bfloat16)
            t[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) * 0.01).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(t, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "bias": "none", "target_modules": sorted(TARGETS), "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "modules_to_save": None, "base_model_name_or_path": None, "init_lora_weights": True,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
    }, indent=1))
    return out
