"""Whether an NVFP4 engine keeps dense copies of its linears (`rollout.vllm_dense_above: auto`).

Above `dense_above` sequences per decode step an NVFP4 engine runs one dense BF16 GEMM per linear
with the adapter merged in (`qerl_lib.rollout.vllm_worker`), instead of Marlin + vLLM's LoRA
kernels, which are slower than BF16's cuBLAS at tens to hundreds of rows. The copies cost 2 bytes
per quantized weight of GPU memory, so `auto` keeps them only where they take at most `DENSE_SHARE`
of the engine's memory budget, and says so when it declines them (`dense_declined_note`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

DENSE_SHARE = 0.25
"""Most of an engine's memory budget that `auto` gives the dense copies: the rest holds the 4-bit
weights, the KV cache and CUDA graphs."""


def linear_param_count(config: dict) -> int:
    """Weights of the decoder linears (q, k, v, o, gate, up, down) of a Llama/Qwen2 config."""
    h = config["hidden_size"]
    inter = config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or h // heads
    per_layer = h * heads * head_dim * 2 + 2 * h * kv * head_dim + 3 * h * inter
    return per_layer * config["num_hidden_layers"]


def dense_copy_bytes(checkpoint: str | Path) -> int | None:
    """GPU bytes of an NVFP4 checkpoint's dense copies (2 per quantized weight); None when the
    checkpoint is not quantized (its engine needs no copy)."""
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    return 2 * linear_param_count(config) if "quantization_config" in config else None


def copies_fit(dense: int | None, budget_bytes: float, share: float = DENSE_SHARE) -> bool:
    """The one test `auto` applies: there are copies to hold (`dense`, bytes) and they take at
    most `share` of the engine's `budget_bytes`."""
    return dense is not None and dense <= share * budget_bytes


def auto_dense_above(checkpoint: str | Path, budget_bytes: float, threshold: int,
                     share: float = DENSE_SHARE) -> int | None:
    """`threshold` when the checkpoint is NVFP4 and its dense copies fit `share` of the engine's
    memory budget (`copies_fit`); else None (Marlin only)."""
    return threshold if copies_fit(dense_copy_bytes(checkpoint), budget_bytes, share) else None


def dense_declined_note(checkpoint: str | Path, total_bytes: float, utilization: float,
                        share: float = DENSE_SHARE) -> str | None:
    """Why `auto` runs an NVFP4 engine without its dense copies on this card, and the
    `rollout.vllm_gpu_memory_utilization` that would keep them; None when `auto` keeps them or the
    checkpoint needs none. Without the copies, rows above the decode GEMM's run Marlin + LoRA, slower
    than BF16 at tens to hundreds of rows (a 7B RL step on an 80 GB card: 17.9 s of rollout against
    11.7 s with them, `docs/gpu.md`, session 30)."""
    dense = dense_copy_bytes(checkpoint)
    if dense is None or total_bytes <= 0 or copies_fit(dense, utilization * total_bytes, share):
        return None
    need = dense / (share * total_bytes)
    keep = (f"rollout.vllm_gpu_memory_utilization >= {math.ceil(need * 100) / 100:.2f} lets auto keep them"
            if need <= 1 else "no vllm_gpu_memory_utilization lets auto keep them on this card")
    return (f"rollout.vllm_dense_above auto: no dense copies for {checkpoint} ({dense / 1e9:.2f} GB, more than "
            f"{share:g} of the engine's {utilization:g} x {total_bytes / 2**30:.1f} GiB), so rows above the decode "
            f"GEMM's run Marlin + LoRA, slower than BF16 at tens to hundreds of rows. {keep}; "
            f"rollout.vllm_dense_above: ROWS forces them; off runs without them and without this warning")
