"""What the two NVFP4 decode GEMMs share: their argument contract and their torch custom op.

`qerl_lib.kernels.nvfp4_gemv` (Triton, up to 64 rows) and `qerl_lib.kernels.nvfp4_gemv_cuda` (CUDA C++,
up to 16 rows) take the same arguments and raise the same ValueErrors; both check them here, before
any layout copy or launch. Torch only (no Triton import), so the CUDA module stays importable alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class GemvArgs:
    """Checked arguments: x2 [M, K] (x's rows, a view where possible), lead (x's leading shape),
    scale as its uint8 view [N, K/16], LoRA slices as lists (empty = no LoRA)."""

    x2: torch.Tensor
    lead: tuple
    m: int
    n: int
    k: int
    scale: torch.Tensor
    a_list: list[torch.Tensor]
    b_list: list[torch.Tensor]


def check_args(name: str, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
               bias: torch.Tensor | None, lora_a: torch.Tensor | Sequence[torch.Tensor] | None,
               lora_b: torch.Tensor | Sequence[torch.Tensor] | None, lora_index: torch.Tensor | None, *,
               max_rows: int, max_slices: int, max_rank: int | None = None) -> GemvArgs:
    """ValueError naming the first argument that breaks `nvfp4_gemv`'s contract (its docstring); `name`
    is the kernel's, in the row-count message; `max_rank` None = any LoRA rank."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"nvfp4_gemv needs bf16 or fp16 activations, got {x.dtype}")
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], packed.shape[0]
    if m > max_rows:
        raise ValueError(f"{name} serves at most {max_rows} rows, got {m}")
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] * 2 != k or k % 16 or k == 0:
        raise ValueError(f"packed {tuple(packed.shape)} {packed.dtype} does not match K={k} "
                         "(uint8 [N, K/2], K a positive multiple of 16)")
    if scale.shape != (n, k // 16):
        raise ValueError(f"scale {tuple(scale.shape)} does not match [N, K/16] = [{n}, {k // 16}]")
    if scale.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise ValueError(f"scale must be float8_e4m3fn or its uint8 view, got {scale.dtype}")
    scale = scale if scale.dtype == torch.uint8 else scale.view(torch.uint8)
    if global_scale.numel() not in (1, n):
        raise ValueError(f"global_scale must have 1 or N={n} elements, got {global_scale.numel()}")
    if packed.device != x.device or scale.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError("x, packed, scale and bias must be on one device")
    if bias is not None and bias.numel() != n:
        raise ValueError(f"bias must have N={n} elements, got {bias.numel()}")
    a_list, b_list = ([] if t is None else [t] if isinstance(t, torch.Tensor) else list(t) for t in (lora_a, lora_b))
    if a_list:
        if len(a_list) != len(b_list) or not 1 <= len(a_list) <= max_slices:
            raise ValueError(f"LoRA needs 1 to {max_slices} (A, B) slices, got {len(a_list)} A and {len(b_list)} B")
        rank = a_list[0].shape[0]
        if max_rank is not None and not 1 <= rank <= max_rank:
            raise ValueError(f"LoRA rank must be 1..{max_rank}, got {rank}")
        for a, b in zip(a_list, b_list):
            if a.shape != (rank, k) or b.dim() != 2 or b.shape[1] != rank or a.dtype != x.dtype or b.dtype != x.dtype:
                raise ValueError(f"LoRA slices must be A [{rank}, {k}] and B [n_i, {rank}] in {x.dtype}")
            if a.stride(-1) != 1 or b.stride(-1) != 1 or a.device != x.device or b.device != x.device:
                raise ValueError("LoRA A and B need a contiguous last dimension, on x's device")
        if sum(b.shape[0] for b in b_list) != n:
            raise ValueError(f"LoRA B slices cover {sum(b.shape[0] for b in b_list)} rows, W has {n}")
        if lora_index is not None and lora_index.numel() < m:
            raise ValueError(f"lora_index has {lora_index.numel()} entries for {m} rows")
    return GemvArgs(x2, lead, m, n, k, scale, a_list, b_list)


def define_op(name: str, gemv):
    """`torch.ops.qerl.<name>`: `gemv` (an `nvfp4_gemv`-shaped function) as a torch custom op, LoRA
    slices as lists (empty = none). Opaque to torch.compile; CUDA graphs capture the kernels it launches."""

    @torch.library.custom_op(f"qerl::{name}", mutates_args=())
    def op(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
           bias: torch.Tensor | None, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor],
           lora_scale: float, lora_index: torch.Tensor | None, lora_slot: int) -> torch.Tensor:
        return gemv(x, packed, scale, global_scale, bias, lora_a or None, lora_b or None, lora_scale,
                    lora_index, lora_slot)

    @op.register_fake
    def _(x, packed, scale, global_scale, bias, lora_a, lora_b, lora_scale, lora_index, lora_slot):
        return x.new_empty((*x.shape[:-1], packed.shape[0]))

    return op
