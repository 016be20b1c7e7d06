"""The worker side of the NVFP4 decode GEMM switch (`rollout.vllm_gemv_rows`, `rollout.vllm_gemv_kernel`).

`qerl_lib.rollout.vllm_worker` reads the two environment variables at load and, for steps of at most
`QERL_VLLM_GEMV_ROWS` rows, calls `gemv_function(rows, kernel)` inside its opaque ops with the layer's
packed codes, its per-row global scales (`partition_scales`) and, for LoRA layers, vLLM's slot-0 LoRA
buffers (`_gemv_lora`). Torch only; imported by the worker, the engine and `vllm serve`'s command.
"""

from __future__ import annotations

import functools
import os

import torch

from qerl_lib.kernels.nvfp4_gemv_cuda import PDL_ENV

GEMV_ROWS_ENV = "QERL_VLLM_GEMV_ROWS"
"""Environment variable read in the worker at load: rows up to which NVFP4 linears run the decode GEMM."""
GEMV_KERNEL_ENV = "QERL_VLLM_GEMV_KERNEL"
"""Environment variable read in the worker at load: `auto`, `triton` (when unset) or `cuda` (rows <= 16)."""
GEMV_PDL_ENV = PDL_ENV
"""Environment variable read by the CUDA decode GEMM at each call (so when vLLM captures its graphs):
"1" launches it as a programmatic dependent launch (`rollout.vllm_gemv_pdl`)."""
GEMV_REPACK_ENV = "QERL_VLLM_GEMV_REPACK"
"""Environment variable read in the worker at load: "1" stores the decode GEMM's copy of the codes in the CUDA
kernel's repacked layout (`nvfp4_gemv_cuda.repack_codes`: fewer decode instructions, same results). Only with
the CUDA kernel at <= 16 rows; a benchmark switch (`rollout_throughput.py`'s `-rp` engines) until timed."""
GEMV_KERNELS = ("auto", "triton", "cuda")
"""The choices of `rollout.vllm_gemv_kernel`; `auto` resolves in the worker (`resolve_kernel`)."""


def gemv_env(rows: int | None, kernel: str, pdl: bool, repack: bool = False) -> dict[str, str | None]:
    """The worker environment of these decode-GEMM settings: variable -> value, None = must be unset.
    Rows None/0: the decode GEMM is off, and so are its kernel choice, PDL and the repacked codes."""
    on = bool(rows)
    return {GEMV_ROWS_ENV: str(int(rows)) if on else None, GEMV_KERNEL_ENV: kernel if on else None,
            GEMV_PDL_ENV: "1" if on and pdl else None, GEMV_REPACK_ENV: "1" if on and repack else None}


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


def resolve_kernel(kernel: str, rows: int) -> tuple[str | None, int, str | None]:
    """(kernel, rows, why not) the worker runs for the configured `kernel` and `rows`.

    `auto` is the CUDA kernel when its extension builds (or loads from its cache) here, for at most its
    `MAX_ROWS` rows; when it does not build (no nvcc, no ninja, another CUDA), the decode GEMM is off
    (None, 0, the build error) and the layers keep Marlin, which beats the Triton kernel at every row
    count measured (`benchmarks/results/nvfp4_gemv.json`). `cuda` raises on a failed build: it was asked
    for by name. `triton` is returned as given. Builds now, at load, never inside a CUDA-graph capture."""
    if kernel == "triton":
        return "triton", rows, None
    if kernel not in GEMV_KERNELS:
        raise ValueError(f"{GEMV_KERNEL_ENV}={kernel}: one of {GEMV_KERNELS}")
    from qerl_lib.kernels import nvfp4_gemv_cuda

    try:
        nvfp4_gemv_cuda.load_extension()
    except Exception as e:  # noqa: BLE001 - any failed build leaves vLLM's path in place, and says why
        if kernel == "cuda":
            raise
        return None, 0, f"{type(e).__name__}: {e}"
    return "cuda", rows if kernel == "cuda" else min(rows, nvfp4_gemv_cuda.MAX_ROWS), None


def gemv_repack_from_env() -> bool:
    """`QERL_VLLM_GEMV_REPACK` is "1"."""
    return os.environ.get(GEMV_REPACK_ENV, "").strip() == "1"


@functools.cache
def gemv_function(rows: int, kernel: str, repacked: bool = False):
    """The decode GEMM for a step of `rows` rows: the CUDA kernel when `kernel` is `cuda` and it serves
    that many rows, else the Triton one (same signature and semantics). `repacked`: the codes are in the
    CUDA kernel's repacked layout, which only it reads. Memoised: the worker asks at every linear call."""
    if kernel == "cuda":
        from qerl_lib.kernels import nvfp4_gemv_cuda

        if rows <= nvfp4_gemv_cuda.MAX_ROWS:
            return functools.partial(nvfp4_gemv_cuda.nvfp4_gemv, config={"repacked": True}) if repacked \
                else nvfp4_gemv_cuda.nvfp4_gemv
    if repacked:
        raise ValueError(f"repacked codes are read by the CUDA kernel only (rows <= 16), not by {kernel} at {rows} rows")
    from qerl_lib.kernels.nvfp4_gemv import nvfp4_gemv

    return nvfp4_gemv


def partition_scales(global_scales: torch.Tensor, widths: list[int]) -> torch.Tensor:
    """float32 [N]: each output row's compressed-tensors global scale (one per fused partition), as
    `dequantize_partitions` applies them."""
    gs = global_scales.reshape(-1).float()
    if gs.numel() != len(widths):
        raise ValueError(f"{gs.numel()} global scales for partitions {widths}")
    return torch.cat([gs[i:i + 1].expand(w) for i, w in enumerate(widths)]).contiguous()


def max_lora_rank(kernel: str) -> int | None:
    """The largest LoRA rank `kernel`'s fused LoRA serves (None: any)."""
    if kernel == "cuda":
        from qerl_lib.kernels.nvfp4_gemv_cuda import MAX_RANK

        return MAX_RANK
    return None


def _gemv_lora(wrapper, max_rank: int | None = None):
    """(A slices, B slices, per-token slots) of vLLM's LoRA wrapper for `nvfp4_gemv`, or None when the
    fused path does not apply (more than one LoRA slot, another dtype, slices not covering the rows, a
    padded rank above `max_rank`): vLLM's own LoRA kernels then run around Marlin."""
    cached = getattr(wrapper, "qerl_gemv_lora", None)
    if cached is None:
        a = [t[0, 0] for t in wrapper.lora_a_stacked]  # slot 0: [max_rank, K]
        b = [t[0, 0] for t in wrapper.lora_b_stacked]  # [n_i, max_rank], scaling folded in by vLLM
        base = wrapper.base_layer
        ok = (wrapper.lora_a_stacked[0].shape[0] == 1 and 1 <= len(a) <= 3
              and (max_rank is None or a[0].shape[0] <= max_rank)
              and sum(t.shape[0] for t in b) == base.output_size_per_partition
              and all(t.dtype == getattr(base, "params_dtype", None) for t in a + b))
        cached = wrapper.qerl_gemv_lora = (a, b) if ok else False
    if cached is False:
        return None
    indices = getattr(getattr(wrapper, "punica_wrapper", None), "_token_lora_indices", None)
    return None if indices is None else (*cached, indices)
