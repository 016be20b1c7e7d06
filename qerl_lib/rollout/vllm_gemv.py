"""The worker side of the NVFP4 decode GEMM switch (`rollout.vllm_gemv_rows`, `rollout.vllm_gemv_kernel`).

`qerl_lib.rollout.vllm_worker` reads the two environment variables at load and, for steps of at most
`QERL_VLLM_GEMV_ROWS` rows, calls `gemv_function(rows, kernel)` inside its opaque ops with the layer's
packed codes, its per-row global scales (`partition_scales`) and, for LoRA layers, vLLM's slot-0 LoRA
buffers (`_gemv_lora`). Torch only; imported by the worker, the engine and `vllm serve`'s command.
"""

from __future__ import annotations

import os

import torch

GEMV_ROWS_ENV = "QERL_VLLM_GEMV_ROWS"
"""Environment variable read in the worker at load: rows up to which NVFP4 linears run the decode GEMM."""
GEMV_KERNEL_ENV = "QERL_VLLM_GEMV_KERNEL"
"""Environment variable read in the worker at load: `triton` (default) or `cuda` (rows <= 16)."""
GEMV_KERNELS = ("triton", "cuda")
"""The decode GEMMs `rollout.vllm_gemv_kernel` chooses from."""


def gemv_rows_from_env() -> int | None:
    """`QERL_VLLM_GEMV_ROWS` as an int (rows up to which NVFP4 linears run `nvfp4_gemv`), None if unset/off/0."""
    raw = os.environ.get(GEMV_ROWS_ENV, "").strip().lower()
    if raw in ("", "0", "off", "none", "false"):
        return None
    rows = int(raw)
    if not 1 <= rows <= 64:
        raise ValueError(f"{GEMV_ROWS_ENV}={raw}: the decode GEMM serves 1 to 64 rows")
    return rows


def gemv_kernel_from_env() -> str:
    """`QERL_VLLM_GEMV_KERNEL` (`triton` when unset or empty); anything else than `GEMV_KERNELS` is refused."""
    raw = os.environ.get(GEMV_KERNEL_ENV, "").strip().lower() or "triton"
    if raw not in GEMV_KERNELS:
        raise ValueError(f"{GEMV_KERNEL_ENV}={raw}: one of {GEMV_KERNELS}")
    return raw


def gemv_function(rows: int, kernel: str):
    """The decode GEMM for a step of `rows` rows: the CUDA kernel when `kernel` is `cuda` and it serves
    that many rows, else the Triton one (same signature and semantics)."""
    if kernel == "cuda":
        from qerl_lib.kernels import nvfp4_gemv_cuda

        if rows <= nvfp4_gemv_cuda.MAX_ROWS:
            return nvfp4_gemv_cuda.nvfp4_gemv
    from qerl_lib.kernels.nvfp4_gemv import nvfp4_gemv

    return nvfp4_gemv


def partition_scales(global_scales: torch.Tensor, widths: list[int]) -> torch.Tensor:
    """float32 [N]: each output row's compressed-tensors global scale (one per fused partition), as
    `dequantize_partitions` applies them."""
    gs = global_scales.reshape(-1).float()
    if gs.numel() != len(widths):
        raise ValueError(f"{gs.numel()} global scales for partitions {widths}")
    return torch.cat([gs[i:i + 1].expand(w) for i, w in enumerate(widths)]).contiguous()


def _gemv_lora(wrapper):
    """(A slices, B slices, per-token slots) of vLLM's LoRA wrapper for `nvfp4_gemv`, or None when the
    fused path does not apply (more than one LoRA slot, another dtype, slices not covering the rows)."""
    cached = getattr(wrapper, "qerl_gemv_lora", None)
    if cached is None:
        a = [t[0, 0] for t in wrapper.lora_a_stacked]  # slot 0: [max_rank, K]
        b = [t[0, 0] for t in wrapper.lora_b_stacked]  # [n_i, max_rank], scaling folded in by vLLM
        base = wrapper.base_layer
        ok = (wrapper.lora_a_stacked[0].shape[0] == 1 and 1 <= len(a) <= 3
              and sum(t.shape[0] for t in b) == base.output_size_per_partition
              and all(t.dtype == getattr(base, "params_dtype", None) for t in a + b))
        cached = wrapper.qerl_gemv_lora = (a, b) if ok else False
    if cached is False:
        return None
    indices = getattr(getattr(wrapper, "punica_wrapper", None), "_token_lora_indices", None)
    return None if indices is None else (*cached, indices)
