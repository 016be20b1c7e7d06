"""A frozen NVFP4 linear layer that stays packed in memory.

`NVFP4Linear` keeps the compressed-tensors tensors (`weight_packed`, `weight_scale`,
`weight_global_scale`) as buffers and dequantizes them inside every forward call. The
matmul runs in a custom autograd Function whose backward dequantizes again to get the
input gradient (grad_x = grad_y @ W), so no 16-bit copy of a base weight lives between
forward and backward, or at all outside one call. The base never gets gradients (it has
no float weight to give them to).

The dequantize+matmul pair is pluggable per device type (`register_matmul_backend`): the
pure-PyTorch backend here dequantizes with `qerl_lib.nvfp4.dequantize_nvfp4` and calls
`torch.nn.functional.linear`, so results are bit-identical to an `nn.Linear` holding the
dequantized weight. On CUDA the first NVFP4 matmul registers the fused Triton kernels of
`qerl_lib.kernels.nvfp4_triton` (dequantize-and-multiply per tile, no 16-bit W in global
memory; docs/kernels.md) when Triton imports and the GPU has bf16 tensor cores (sm_80+), for
calls of up to `DENSE_ABOVE_ROWS` rows; larger calls (every training call) dequantize W once per
call with one Triton kernel and run cuBLAS (see there); the choice is logged once per device type.
`QERL_NVFP4_BACKEND=torch` keeps the pure-PyTorch path on CUDA at every size,
`QERL_NVFP4_BACKEND=triton` the fused kernels at every size, `QERL_NVFP4_BACKEND=triton-dq` one
Triton dequantization kernel per call then cuBLAS at every size; an explicit
`register_matmul_backend` call always wins. The CPU keeps the pure-PyTorch path.

The loaders that build models with it are in `qerl_lib.nvfp4_loader`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from qerl_lib.nvfp4 import BLOCK_SIZE, dequantize_nvfp4

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------
# Pluggable matmul
# ---------------------------------------------------------------------------------------

MatmulForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""(x [M, K], packed [N, K//2], scale [N, K//16], global_scale [1], bias [N] | None) -> y [M, N]."""
MatmulGradInput = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(grad_y [M, N], packed, scale, global_scale) -> grad_x [M, K] = grad_y @ W."""


@dataclass(frozen=True)
class MatmulBackend:
    """How NVFP4Linear multiplies by its packed weight (forward) and by W for grad_x (backward)."""

    name: str
    forward: MatmulForward
    grad_input: MatmulGradInput


def torch_matmul_forward(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T + bias, W dequantized to x.dtype for this call only."""
    weight = dequantize_nvfp4(packed, scale, global_scale, x.dtype)
    return torch.nn.functional.linear(x, weight, None if bias is None else bias.to(x.dtype))


def torch_matmul_grad_input(
    grad_y: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor
) -> torch.Tensor:
    """grad_x [M, K] = grad_y [M, N] @ W [N, K], W dequantized again (it was not saved)."""
    weight = dequantize_nvfp4(packed, scale, global_scale, grad_y.dtype)
    return grad_y @ weight


TORCH_BACKEND = MatmulBackend("torch", torch_matmul_forward, torch_matmul_grad_input)

DENSE_ABOVE_ROWS = 1024
"""Rows (tokens) per call above which CUDA dequantizes W once per call instead of per tile.

The fused kernels dequantize each W tile once per 256-row tile of x, so their cost grows with M;
the dequantize-once backend ("triton-dq") pays one Triton dequantization kernel per call (a
transient 16-bit W of one linear, at most 136 MB for Qwen2.5-7B's gate/up) and then runs cuBLAS.
Measured on the H200 for one Qwen2.5-7B layer's seven linears, forward + input gradient
(`benchmarks/results/train_step_linears_dq.json`): fused 11.23 / 43.28 ms, dequantize-once
6.30 / 25.44 ms, BF16 5.55 / 23.71 ms at 4608 / 18432 tokens. Dequantize-once costs BF16 plus about
0.75 ms per layer, the fused kernels BF16 plus about 1.23 ms per 1000 rows, so the two cross near
600 rows (an estimate: no size between 1 and 4608 rows was timed). 1024 keeps the fused kernels,
which never hold a 16-bit W, for decode-sized calls; training calls (micro-batch x sequence) are
far above it."""


def split_by_rows(small: MatmulBackend, large: MatmulBackend, above: int) -> MatmulBackend:
    """`small` for calls of at most `above` rows, `large` above (decided per call, forward and
    backward alike, by the rows of x or grad_y)."""

    def forward(x, packed, scale, global_scale, bias):
        return (large if x.shape[0] > above else small).forward(x, packed, scale, global_scale, bias)

    def grad_input(grad_y, packed, scale, global_scale):
        return (large if grad_y.shape[0] > above else small).grad_input(grad_y, packed, scale, global_scale)

    return MatmulBackend(f"{small.name}<={above}<{large.name}", forward, grad_input)


BACKEND_CHOICES = ("", "auto", "torch", "triton", "triton-dq")
"""Values of QERL_NVFP4_BACKEND (CUDA only): unset or auto = the split below; torch = plain PyTorch
dequantization; triton = the fused kernels at every size; triton-dq = one Triton dequantization
kernel per call, then cuBLAS."""

_BACKENDS: dict[str, MatmulBackend] = {}
_CHOSEN: set[str] = set()  # device types whose backend is settled (automatically or explicitly)


def register_matmul_backend(device_type: str, backend: MatmulBackend | None) -> None:
    """Use `backend` for NVFP4Linear on tensors of `device_type` ("cuda", "cpu"); None restores torch.

    An explicit registration (None included) replaces the automatic choice for that type.
    """
    _CHOSEN.add(device_type)
    if backend is None:
        _BACKENDS.pop(device_type, None)
    else:
        _BACKENDS[device_type] = backend


_CHOICE_LOG = {
    "triton-dq": "one Triton dequantization kernel per call + cuBLAS at every size (QERL_NVFP4_BACKEND=triton-dq)",
    "triton": "fused Triton dequantize-and-multiply kernels at every size (QERL_NVFP4_BACKEND=triton)",
    "": f"fused Triton dequantize-and-multiply kernels up to {DENSE_ABOVE_ROWS} rows per call, "
        "one Triton dequantization kernel + cuBLAS above (qerl_lib.kernels.nvfp4_backends)",
}


def cuda_backend(choice: str) -> MatmulBackend:
    """The CUDA backend a QERL_NVFP4_BACKEND value names ("" and "auto": the split by rows).

    Imports the Triton kernels for every choice but "torch" (raises when Triton is missing)."""
    if choice == "torch":
        return TORCH_BACKEND
    from qerl_lib.kernels.nvfp4_backends import make_backend, make_dequant_backend

    if choice == "triton-dq":
        return make_dequant_backend()
    if choice == "triton":
        return make_backend()
    return split_by_rows(make_backend(), make_dequant_backend(), DENSE_ABOVE_ROWS)


def _choose_backend(device: torch.device) -> None:
    """First NVFP4 matmul on a device type: pick its backend and log the choice once."""
    choice = os.environ.get("QERL_NVFP4_BACKEND", "").strip().lower()
    if device.type == "cuda" and choice not in BACKEND_CHOICES:  # before settling, so every call raises
        raise ValueError(f"QERL_NVFP4_BACKEND={choice!r}: expected one of {', '.join(BACKEND_CHOICES[1:])} "
                         "(or unset for the automatic choice)")
    _CHOSEN.add(device.type)
    if device.type != "cuda":
        log.info("NVFP4 matmul on %s: pure-PyTorch dequantize + matmul", device.type)
        return
    if choice == "torch":
        log.info("NVFP4 matmul on cuda: pure-PyTorch dequantize + matmul (QERL_NVFP4_BACKEND=torch)")
        return
    try:
        if torch.cuda.get_device_capability(device) < (8, 0):
            raise RuntimeError(f"compute capability {torch.cuda.get_device_capability(device)} < 8.0")
        _BACKENDS["cuda"] = cuda_backend(choice)
    except Exception as e:  # no Triton, an old GPU, a broken install: the torch path still works
        log.warning("NVFP4 matmul on cuda: pure-PyTorch dequantize + matmul (Triton kernels unavailable: %s: %s)",
                    type(e).__name__, e)
        return
    log.info("NVFP4 matmul on cuda: %s", _CHOICE_LOG.get(choice, _CHOICE_LOG[""]))


def get_matmul_backend(device: torch.device | str) -> MatmulBackend:
    """The backend registered for `device`'s type, else the pure-PyTorch one (on CUDA the
    Triton kernels are registered automatically on first use, see the module docstring)."""
    device = torch.device(device)
    if device.type not in _CHOSEN:
        _choose_backend(device)
    return _BACKENDS.get(device.type, TORCH_BACKEND)


class _NVFP4LinearFunction(torch.autograd.Function):
    """y = x @ W.T + b with W packed; saves only the packed buffers (no 16-bit W, no x)."""

    @staticmethod
    def forward(ctx, x2d, packed, scale, global_scale, bias):  # type: ignore[override]
        backend = get_matmul_backend(x2d.device)
        ctx.save_for_backward(packed, scale, global_scale)
        ctx.backend = backend
        ctx.bias_dtype = None if bias is None else bias.dtype
        return backend.forward(x2d, packed, scale, global_scale, bias)

    @staticmethod
    def backward(ctx, grad_y):  # type: ignore[override]
        packed, scale, global_scale = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = ctx.backend.grad_input(grad_y, packed, scale, global_scale)
        if ctx.needs_input_grad[4]:  # only if someone unfroze the bias
            grad_bias = grad_y.sum(dim=0).to(ctx.bias_dtype)
        return grad_x, None, None, None, grad_bias


class NVFP4Linear(nn.Module):
    """Frozen linear layer with an NVFP4 weight kept packed (4.5 bits per weight in memory).

    Buffers (names and dtypes as in compressed-tensors checkpoints, so state-dict keys
    match the safetensors file): `weight_packed` uint8 [out, in//2], `weight_scale`
    float8_e4m3fn [out, in//16], `weight_global_scale` float32 [1]; optional `bias`
    (a frozen Parameter) [out]. forward(x [..., in]) -> [..., out] in x.dtype.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        device: torch.device | str | None = None,
        bias_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if in_features % BLOCK_SIZE:
            raise ValueError(f"NVFP4Linear needs in_features divisible by {BLOCK_SIZE}, got {in_features}")
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer(
            "weight_scale", torch.zeros(out_features, in_features // BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=device)
        )
        self.register_buffer("weight_global_scale", torch.ones(1, dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_tensors(
        cls,
        packed: torch.Tensor,
        scale: torch.Tensor,
        global_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> "NVFP4Linear":
        """Wrap existing NVFP4 tensors (e.g. from `quantize_nvfp4`) without copying them."""
        out_features, half_in = packed.shape
        layer = cls(half_in * 2, out_features, bias=bias is not None, device="meta")
        layer.weight_packed = packed
        layer.weight_scale = scale
        layer.weight_global_scale = global_scale.reshape(1).to(torch.float32)
        if bias is not None:
            layer.bias = nn.Parameter(bias, requires_grad=False)
        return layer

    @property
    def qweight(self) -> torch.Tensor:
        """The packed weight. PEFT looks for `weight`/`qweight` to find a quantized base layer's
        device (and keeps the adapter's float dtype because this one is uint8)."""
        return self.weight_packed

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A fresh dense copy W [out, in] (for tests and export; never kept by the layer)."""
        return dequantize_nvfp4(self.weight_packed, self.weight_scale, self.weight_global_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            # what nn.Linear does under autocast: compute in the autocast dtype
            x = x.to(torch.get_autocast_dtype(x.device.type))
        lead = x.shape[:-1]
        dense = self.__dict__.get("_inference_weight")
        if dense is not None and dense.dtype == x.dtype and not torch.is_grad_enabled():
            # Inside `dense_inference_cache`: the same dequantized W the torch path would make.
            y = torch.nn.functional.linear(x.reshape(-1, self.in_features), dense,
                                           None if self.bias is None else self.bias.to(x.dtype))
            return y.reshape(*lead, self.out_features)
        y = _NVFP4LinearFunction.apply(
            x.reshape(-1, self.in_features), self.weight_packed, self.weight_scale, self.weight_global_scale, self.bias
        )
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, nvfp4"


def resident_weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes held by the model's parameters and buffers, by dtype name, plus "total".

    Tensors sharing storage (tied embeddings) are counted once.
    """
    seen: set[tuple[int, int]] = set()
    out: dict[str, int] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.is_meta:
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        name = str(tensor.dtype).removeprefix("torch.")
        out[name] = out.get(name, 0) + tensor.numel() * tensor.element_size()
    out["total"] = sum(out.values())
    return out


@contextlib.contextmanager
def dense_inference_cache(model: nn.Module, dtype: torch.dtype):
    """Hold each NVFP4 weight dequantized (in `dtype`) while the block runs, for no-grad
    sampling only; freed on exit.

    Autoregressive decoding calls every layer once per token; dequantizing 4-bit weights
    on each call dominates a CPU decode step. The cache costs one dense copy of the base
    (e.g. 540 MB in fp32 for SmolLM2-135M) for the length of a rollout, never during
    training, and gives bit-identical outputs to the packed path on the PyTorch backend
    (same dequantization, same matmul). Other backends (Triton on CUDA) are left alone.
    """
    layers = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    use = [m for m in layers if get_matmul_backend(m.weight_packed.device) is TORCH_BACKEND]
    try:
        for m in use:
            m.__dict__["_inference_weight"] = m.dequantized_weight(dtype)
        yield len(use)
    finally:
        for m in use:
            m.__dict__.pop("_inference_weight", None)
