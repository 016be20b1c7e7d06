"""NVFP4 (weight-only, "NVFP4A16") quantization, bit-identical to llm-compressor / compressed-tensors.

Format (compressed-tensors `nvfp4-pack-quantized`), for a weight W of shape [N, K]
(N = out_features, K = in_features, K a multiple of 16):

- `weight_packed`  uint8 [N, K//2]: FP4 E2M1 codes, two per byte; the LOW nibble holds the
  even column, the high nibble the odd column. A code is sign bit (8) | magnitude index
  (0..7) into E2M1 = (0, 0.5, 1, 1.5, 2, 3, 4, 6).
- `weight_scale`  float8_e4m3fn [N, K//16]: one scale per block of 16 consecutive inputs.
- `weight_global_scale` float32 [1]: 448 * 6 / amax(W) (amax over a *fused group*, see
  below), so the largest block scale lands near the top of the FP8 range.

Dequantized W = e2m1 * (block_scale / global_scale), evaluated in float32 and then cast.

The arithmetic below mirrors, operation by operation, what runs when
`oneshot(recipe=QuantizationModifier(targets="Linear", scheme="NVFP4A16"))` calibrates a
weight (llmcompressor `memoryless_minmax` observer -> compressed-tensors
`generate_gparam` and `calculate_qparams`) and `NVFP4PackedCompressor.compress`
quantizes and packs it. Where the order or dtype of an operation changes the bits, a
comment says so. The tests compare against those functions directly.

Fused global scales: llm-compressor gives q/k/v_proj one shared global scale, and
gate/up_proj another (vLLM runs them as one fused matmul). `quantize_nvfp4(w)` alone uses
w's own amax; pass `global_scale=nvfp4_global_scale(wq, wk, wv)` to reproduce the
checkpoint of a fused member.
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 16
"""Inputs per FP8 block scale."""
FP4_MAX = 6.0
"""Largest FP4 E2M1 magnitude."""
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0
"""Largest FP8 E4M3 value."""
ZERO_BLOCK_SCALE = 0.125
"""Block scale compressed-tensors stores for an all-zero block (its FP8 'eps'), so that
quantization never divides by zero."""

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""FP4 E2M1 magnitudes by 3-bit index."""

FUSED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling linears that llm-compressor quantizes with one shared global scale."""

# The 16 signed code values; code 8 is -0.0, exactly what compressed-tensors' unpacking
# (magnitude * -1.0) produces, so dequantized zeros keep the same sign bit.
_CODE_VALUES = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES], dtype=torch.float32)


def _check_weight(weight: torch.Tensor) -> None:
    if weight.ndim != 2:
        raise ValueError(f"NVFP4 expects a 2-D weight [N, K], got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"NVFP4 expects a floating-point weight, got {weight.dtype}")
    if weight.shape[1] % BLOCK_SIZE != 0:
        raise ValueError(f"NVFP4 needs in_features divisible by {BLOCK_SIZE}, got {weight.shape[1]}")


def nvfp4_global_scale(*weights: torch.Tensor) -> torch.Tensor:
    """Global scale float32 [1] = 448 * 6 / amax over all `weights` (a fused group or one).

    Computed in the weights' own dtype before the final cast to float32, as
    compressed-tensors' `generate_gparam` does: `2688 / amax` on a tensor is
    `amax.reciprocal() * 2688` (Tensor.__rtruediv__), two roundings in that dtype, so for
    bfloat16 weights the stored global scale is a bfloat16 number. An all-zero (or
    subnormal-tiny) weight overflows to inf, which is replaced by 1.0.
    """
    if not weights:
        raise ValueError("nvfp4_global_scale needs at least one weight")
    dtype = weights[0].dtype
    if any(w.dtype != dtype for w in weights):
        raise ValueError(f"fused weights must share a dtype, got {[w.dtype for w in weights]}")
    # max |w| == max(max(w), -min(w)): exact in any dtype, same value the observer reduces.
    amax = torch.stack([w.detach().abs().amax() for w in weights]).amax()
    amax = torch.clamp(amax, min=torch.finfo(dtype).tiny)
    global_scale = (FP8_MAX * FP4_MAX) / amax  # reciprocal-then-multiply, in `dtype`
    global_scale = torch.nan_to_num(global_scale, nan=1.0, posinf=1.0, neginf=1.0)
    return global_scale.to(torch.float32).reshape(1)


def nvfp4_block_scales(weight: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """FP8 block scales [N, K//16] (returned as float32 values) of weight [N, K].

    scale = fp8(clamp(global_scale * (block_amax / 6), +-448)), all-zero blocks -> 0.125.
    `block_amax / 6` is evaluated in the weight's dtype (compressed-tensors divides by a
    0-dim tensor of that dtype on the weight's device; a Python scalar would take
    CUDA's multiply-by-reciprocal path and could differ in the last bit), the product
    with the float32 global scale in float32.
    """
    _check_weight(weight)
    blocks = weight.detach().unflatten(-1, (-1, BLOCK_SIZE))  # [N, G, 16]
    zero = torch.zeros((), dtype=weight.dtype, device=weight.device)
    block_min = torch.minimum(blocks.amin(dim=-1), zero)
    block_max = torch.maximum(blocks.amax(dim=-1), zero)
    block_amax = torch.maximum(block_min.abs(), block_max.abs())  # [N, G], exact
    fp4_half_range = torch.tensor(2 * FP4_MAX, device=weight.device).to(weight.dtype) / 2
    local = block_amax / fp4_half_range  # rounded in weight.dtype
    scales = global_scale.to(device=weight.device, dtype=torch.float32) * local  # float32
    scales = torch.clamp(scales, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return torch.where(scales == 0, torch.full_like(scales, ZERO_BLOCK_SCALE), scales)


def fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values (already divided by their scale) to FP4 E2M1 codes (uint8, same shape).

    Round to nearest, ties to even mantissa, after clamping to [-6, 6]: magnitudes
    <= 0.25 -> 0, (0.25, 0.75) -> 0.5, [0.75, 1.25] -> 1, (1.25, 1.75) -> 1.5,
    [1.75, 2.5] -> 2, (2.5, 3.5) -> 3, [3.5, 5] -> 4, > 5 -> 6 (the same bucket edges as
    compressed-tensors' `cast_to_fp4`). The sign bit is set for every x < 0, including
    values that round to zero: compressed-tensors computes `magnitude * sign(x)`, which
    is -0.0 there, and its packer keeps the sign bit of -0.0. x == -0.0 itself has
    sign() == +0 and gets code 0.
    """
    if torch.isnan(x).any():
        raise ValueError("cannot quantize NaN to FP4")
    a = torch.clamp(x, -FP4_MAX, FP4_MAX).abs()
    index = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    return index | ((x < 0).to(torch.uint8) << 3)


def pack_fp4_codes(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes [N, K] into bytes [N, K//2]: low nibble = even column, high = odd."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even number of columns, got {codes.shape[-1]}")
    pairs = codes.unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes [N, K//2] into uint8 codes [N, K] (inverse of `pack_fp4_codes`)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed FP4 must be uint8, got {packed.dtype}")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


_CODE_VALUES_BY_DEVICE: dict[torch.device, torch.Tensor] = {}


def fp4_code_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of FP4 codes (same shape); code 8 is -0.0."""
    table = _CODE_VALUES_BY_DEVICE.get(codes.device)
    if table is None:  # one host-to-device copy per device, not one per forward
        table = _CODE_VALUES_BY_DEVICE[codes.device] = _CODE_VALUES.to(codes.device)
    return table[codes.long()]


@torch.no_grad()
def quantize_nvfp4(
    weight: torch.Tensor, global_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize weight [N, K] (any float dtype) to NVFP4 exactly as llm-compressor writes it.

    Returns (packed uint8 [N, K//2], scale float8_e4m3fn [N, K//16], global_scale float32 [1]).
    `global_scale` defaults to `nvfp4_global_scale(weight)`; pass the fused group's scale
    for q/k/v and gate/up (see module docstring).

    Each element becomes fp4(clamp(w / (block_scale / global_scale), -6, 6)), where the
    effective scale `block_scale / global_scale` is rounded to float32 first and the
    division is then done in float32 (compressed-tensors' `_quantize` order).
    """
    _check_weight(weight)
    if global_scale is None:
        global_scale = nvfp4_global_scale(weight)
    global_scale = global_scale.to(device=weight.device, dtype=torch.float32).reshape(1)
    scales = nvfp4_block_scales(weight, global_scale)  # [N, G] float32
    effective = scales / global_scale  # float32, rounded once
    scaled = weight.detach().unflatten(-1, (-1, BLOCK_SIZE)) / effective.unsqueeze(-1)  # float32
    codes = fp4_codes(scaled.flatten(-2))
    return pack_fp4_codes(codes), scales.to(torch.float8_e4m3fn), global_scale


def dequantize_nvfp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Dequantize NVFP4 to a dense weight [N, K] of `dtype`.

    packed uint8 [N, K//2], scale float8_e4m3fn [N, K//16] (or any float dtype holding FP8
    values), global_scale float32 [1]. Computes
    `(e2m1 value in float32) * float32(scale / global_scale)` and casts once to `dtype`,
    which is bit-identical to compressed-tensors' `NVFP4PackedCompressor.decompress` (that
    unpacks to bfloat16, divides the scale by the float32 global scale -> float32,
    multiplies in float32, casts back) for bfloat16, and to its `dequantize(...,
    dtype=torch.float32)` path for float32. A 16-bit copy is made only in the returned
    tensor; the float32 intermediate lives for this call only.
    """
    n, half_k = packed.shape
    k = 2 * half_k
    if scale.shape != (n, k // BLOCK_SIZE):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match packed {tuple(packed.shape)}")
    values = fp4_code_values(unpack_fp4_codes(packed)).unflatten(-1, (-1, BLOCK_SIZE))  # [N, G, 16]
    effective = scale.to(torch.float32) / global_scale.to(device=scale.device, dtype=torch.float32)
    return (values * effective.unsqueeze(-1)).flatten(-2).to(dtype)
