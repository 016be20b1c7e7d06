"""The `MatmulBackend`s that `qerl_lib.nvfp4_linear.NVFP4Linear` registers on CUDA, built on the
Triton kernels of `qerl_lib.kernels.nvfp4_triton` (same packed layout: `packed` uint8 [N, K//2],
`scale` float8_e4m3fn [N, K//16], `global_scale` float32 [1]).

- `make_backend()`, "triton": the fused dequantize-and-multiply GEMMs; no 16-bit W in global memory.
- `make_dequant_backend()`, "triton-dq": dequantize once per call with one kernel, then cuBLAS.
  That is the plain path's algorithm with its several PyTorch ops (unpack, code lookup, float32
  scale product, cast) replaced by one kernel; it makes a transient 16-bit copy of the one weight in
  use, as bitsandbytes' NF4 path does. Session 5 measured NF4 at 1.04x BF16 per training step at
  micro-batch 2 where the fused kernels took 1.34x (docs/kernels.md). Opt-in
  (QERL_NVFP4_BACKEND=triton-dq) until it is measured on the GPU.

Both take bf16/fp16 activations; float32 activations fall back to the exact torch path.
"""

from __future__ import annotations

import torch

from qerl_lib.kernels.nvfp4_triton import nvfp4_dequantize_triton, nvfp4_grad_input, nvfp4_matmul
from qerl_lib.nvfp4_linear import MatmulBackend, torch_matmul_forward, torch_matmul_grad_input

HALF = (torch.bfloat16, torch.float16)


def _on_device_of(t: torch.Tensor, fn, *args):
    """fn(*args) with t's CUDA device current (Triton launches there); CPU tensors: the interpreter (tests)."""
    if not t.is_cuda:
        return fn(*args)
    with torch.cuda.device(t.device):
        return fn(*args)


def _forward(x, packed, scale, global_scale, bias):
    """y [M, N] = x [M, K] @ W.T + bias by the fused kernel."""
    if x.dtype not in HALF:
        return torch_matmul_forward(x, packed, scale, global_scale, bias)
    return _on_device_of(x, nvfp4_matmul, x, packed, scale, global_scale, bias)


def _grad_input(grad_y, packed, scale, global_scale):
    """grad_x [M, K] = grad_y [M, N] @ W [N, K] by the fused kernel."""
    if grad_y.dtype not in HALF:
        return torch_matmul_grad_input(grad_y, packed, scale, global_scale)
    return _on_device_of(grad_y, nvfp4_grad_input, grad_y, packed, scale, global_scale)


def make_backend() -> MatmulBackend:
    """The fused-kernel backend ("triton")."""
    return MatmulBackend("triton", _forward, _grad_input)


def _dq_forward(x, packed, scale, global_scale, bias):
    """y [M, N] = x [M, K] @ W.T + bias, W dequantized by one kernel for this call only."""
    if x.dtype not in HALF:
        return torch_matmul_forward(x, packed, scale, global_scale, bias)
    w = _on_device_of(x, nvfp4_dequantize_triton, packed, scale, global_scale, x.dtype)
    return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))


def _dq_grad_input(grad_y, packed, scale, global_scale):
    """grad_x [M, K] = grad_y [M, N] @ W [N, K], W dequantized again by one kernel."""
    if grad_y.dtype not in HALF:
        return torch_matmul_grad_input(grad_y, packed, scale, global_scale)
    return grad_y @ _on_device_of(grad_y, nvfp4_dequantize_triton, packed, scale, global_scale, grad_y.dtype)


def make_dequant_backend() -> MatmulBackend:
    """The dequantize-once backend ("triton-dq"): one Triton dequantization kernel per call, then cuBLAS."""
    return MatmulBackend("triton-dq", _dq_forward, _dq_grad_input)
