"""Fused NVFP4 (W4A16) dequantize-and-multiply kernels in Triton, compressed-tensors layout.

The frozen base weight W [N, K] (N = out_features, K = in_features) stays packed:

- `packed` uint8 [N, K//2]: FP4 E2M1 codes, low nibble = even column k, high nibble = k + 1;
- `scale`  float8_e4m3fn [N, K//16]: one block scale per 16 consecutive inputs;
- `global_scale` float32 [1].

Two GEMMs, tiled, each dequantizing its weight tile in registers right before `tl.dot`
(bf16/fp16 operands, float32 accumulation); no 16-bit copy of W is ever written to global
memory (per call, one float32 [N, K//16] tensor of effective block scales is, and freed):

- forward      y [M, N]  = x [M, K] @ W.T (+ bias)      (`nvfp4_matmul`)
- input grad   dx [M, K] = dy [M, N] @ W                (`nvfp4_grad_input`)

Dequantization of one tile is bit-identical to `qerl_lib.nvfp4.dequantize_nvfp4` (and so to
compressed-tensors): value = fp32(e2m1) * fp32(scale / global_scale), rounded once to the
activation dtype. How it gets there with integer/bit operations only (no lookup table):

- an E2M1 code `s e1 e0 m` placed as fp16 bits `s 0 0 0 e1 e0 m 0...` (sign at bit 15,
  e1 e0 m at bits 11..9) is exactly e2m1 * 2**-14 (e = 0 lands on fp16 subnormals, which
  the fp16 -> fp32 conversion keeps exactly);
- an E4M3 byte `s eeee mmm` placed as fp16 bits `s 0 eeee mmm 0...` is exactly fp8 * 2**-8;
- eff = div_rn(fp8, global_scale) (the correctly rounded float32 division the reference
  does; `_eff_kernel`, once per call, stores eff * 2**14), then
  w = (e2m1 * 2**-14) * (eff * 2**14) in float32: both factors are the
  reference's operands times exact powers of two, so the product rounds identically
  (outside float32 underflow/overflow of eff * 2**14, i.e. |eff| < 2**-112 or > 2**113,
  which no real checkpoint has). Then one cast to bf16/fp16.

The low (even k) and high (odd k) nibbles of a [R, G, 8] byte tile (G = BLOCK_K / 16
scale groups of 8 bytes) are dequantized separately, multiplied by the group's scale by
broadcasting, and interleaved back into K order with `tl.join` + `tl.reshape`.

Both GEMMs are computed transposed ("swap AB"): the dequantized weight tile is the MMA's
register operand A (64 rows per warpgroup) and the tokens are the MMA's N side (up to 256
per tile), read from shared memory. The other orientation (W as the shared-memory operand
B) makes Triton 3.6 abort in `TritonGPUOptimizeDotOperands` (join + reshape feeding
`local_alloc`). The first K (N) step is peeled so that no zero-fill of the accumulator sits
in the pipelined loop (ptxas would serialize the wgmma, C7515). Autotune configurations are
pruned by an M bucket (power of two): decode-like, middle and prefill sets (`nvfp4_triton_configs`).
Design notes, measurements and limits: docs/kernels.md.

Works under Triton's interpreter (`TRITON_INTERPRET=1`, CPU tensors) for tests; there the
autotuner is bypassed and a fixed small configuration runs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from qerl_lib.kernels.nvfp4_triton_configs import (DQ_CONFIGS, FWD_CONFIGS, GRAD_CONFIGS,  # noqa: F401
                                                   INTERPRETER_CONFIG, _bench, _prune)

BLOCK_SIZE = 16  # inputs per FP8 block scale (qerl_lib.nvfp4.BLOCK_SIZE)


def interpreter_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _interpreter_compat() -> None:
    """Let Triton's interpreter run loops with run-time bounds under NumPy >= 2.3.

    The interpreter keeps scalar kernel arguments as 1-element arrays and converts them for
    `range()` with `int(array)`, which NumPy 2.3+ refuses for arrays of ndim > 0. Patch its
    `tensor.__index__` to take the single element. Only ever applied in interpreter mode.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - layout of other Triton versions
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_qerl_compat", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._qerl_compat = True
    interpreter._patch_lang_tensor = patched


if interpreter_mode():
    _interpreter_compat()


# ---------------------------------------------------------------------------------------
# Device code
# ---------------------------------------------------------------------------------------


@triton.jit
def _grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program `pid`, walking GROUP_M row tiles per column for L2 reuse."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _mma(a, b, acc, DOT_F32: tl.constexpr):
    """acc + a @ b (a @ b when acc is None) with float32 accumulation. DOT_F32 (interpreter
    only, whose dot does not understand bf16) upcasts the 16-bit operands first, which is exact."""
    if DOT_F32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if acc is None:
        return tl.dot(a, b, out_dtype=tl.float32)
    return tl.dot(a, b, acc)


@triton.jit
def _load_act(ptrs, m_mask, offs_r, r0, R, EVEN_R: tl.constexpr):
    """Activation tile [BLOCK_R, BLOCK_M] (transposed view of a row-major [M, R] matrix) at
    reduction offset r0; rows past R and columns past M read as 0."""
    if EVEN_R:
        return tl.load(ptrs, mask=m_mask[None, :], other=0.0)
    return tl.load(ptrs, mask=m_mask[None, :] & (r0 + offs_r[:, None] < R), other=0.0)


@triton.jit
def _eff_kernel(s_ptr, gs_ptr, e_ptr, n_elements, BLOCK: tl.constexpr):
    """e = fp32(fp8 block scale) / global_scale * 2**14, elementwise over the [N, K // 16] scales.

    The division is the correctly rounded float32 division of the reference dequantization
    (`scale.to(float32) / global_scale`); the factor 2**14 (exact) undoes the 2**-14 of the
    FP4 decode in `_dequant_tile`. 4 bytes per 16 weights, computed per call and freed after it.
    """
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    s32 = tl.load(s_ptr + offs, mask=mask, other=0).to(tl.int32)
    # FP8 E4M3 -> float32: the byte as fp16 bits s|0|eeee|mmm|0000000 is exactly fp8 * 2**-8.
    s_f16 = (((s32 & 0x80) << 8) | ((s32 & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True)
    eff = tl.math.div_rn(s_f16.to(tl.float32) * 256.0, tl.load(gs_ptr)) * 16384.0
    tl.store(e_ptr + offs, eff, mask=mask)


@triton.jit
def _dequant_tile(
    p_ptr,
    e_ptr,
    rows,
    row_mask,
    k0,
    K,
    stride_pn,
    stride_en,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MASK_K: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    """W[rows, k0:k0+BLOCK_K] in OUT_DTYPE ([BLOCK_R, BLOCK_K]); masked rows/columns are 0.

    `e_ptr` points at the float32 [N, K // 16] effective scales of `_eff_kernel`. k0 is a
    multiple of 16 and K % 16 == 0, so a scale group is either wholly inside K or outside.
    """
    G: tl.constexpr = BLOCK_K // 16
    group_col = k0 // 16 + tl.arange(0, G)
    p_cols = group_col[:, None] * 8 + tl.arange(0, 8)[None, :]  # [G, 8] byte column
    mask = row_mask[:, None, None]
    if MASK_K:
        mask = mask & (group_col[None, :, None] * 16 < K)
    b = tl.load(p_ptr + rows[:, None, None] * stride_pn + p_cols[None, :, :], mask=mask, other=0)
    eff = tl.load(e_ptr + rows[:, None, None] * stride_en + group_col[None, :, None], mask=mask, other=0.0)
    # FP4 E2M1 -> fp16 bits, both nibbles of a byte at once in one int32: the low nibble's
    # fp16 (bits 15..0) gets sign -> bit 15 and e1 e0 m -> bits 11..9, the high nibble's
    # (bits 31..16) sign -> bit 31 and e1 e0 m -> bits 27..25. An fp16 with those bits is
    # exactly e2m1 * 2**-14 (e = 0 lands on fp16 subnormals, converted exactly).
    b32 = b.to(tl.uint32)
    pair = ((b32 * 0x00200200) & 0x0E000E00) | ((b32 * 0x01001000) & 0x80008000)
    lo_f16 = pair.to(tl.uint16).to(tl.float16, bitcast=True)  # even k
    hi_f16 = (pair >> 16).to(tl.uint16).to(tl.float16, bitcast=True)  # odd k
    # (e2m1 * 2**-14) * (scale / global_scale * 2**14): the reference's float32 product, exactly
    lo = (lo_f16.to(tl.float32) * eff).to(OUT_DTYPE)
    hi = (hi_f16.to(tl.float32) * eff).to(OUT_DTYPE)
    w = tl.join(lo, hi)  # [R, G, 8, 2]: k = 16 g + 2 j + (0 | 1)
    return tl.reshape(w, [BLOCK_R, BLOCK_K])


@triton.jit
def _nvfp4_fwd_kernel(
    x_ptr,
    p_ptr,
    e_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    M_BUCKET,  # autotune key only (next power of two of M)
    stride_xm,
    stride_pn,
    stride_en,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_F32: tl.constexpr = False,
):
    """y[M, N] = x[M, K] @ W[N, K].T (+ bias), computed as y.T tile [BLOCK_N, BLOCK_M] =
    W tile [BLOCK_N, BLOCK_K] @ x.T tile [BLOCK_K, BLOCK_M], W dequantized in registers
    (the MMA's register operand), x.T read from shared memory."""
    OUT_DTYPE: tl.constexpr = y_ptr.dtype.element_ty
    pid = tl.program_id(0)
    pid_m, pid_n = _grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows = tl.where(n_mask, offs_n, 0)
    x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None]  # x.T tile [K, M]
    # first K step peeled: the accumulator starts as the first product instead of zeros, so
    # no non-MMA instruction writes it inside the pipelined loop (ptxas would then serialize
    # the asynchronous wgmma instructions, warning C7515)
    w = _dequant_tile(p_ptr, e_ptr, rows, n_mask, 0, K, stride_pn, stride_en, BLOCK_N, BLOCK_K, not EVEN_K, OUT_DTYPE)
    xt = _load_act(x_ptrs, m_mask, offs_k, 0, K, EVEN_K)
    acc = _mma(w, xt, None, DOT_F32)  # [BLOCK_N, BLOCK_M] float32
    for k0 in range(BLOCK_K, K, BLOCK_K):
        x_ptrs += BLOCK_K
        w = _dequant_tile(p_ptr, e_ptr, rows, n_mask, k0, K, stride_pn, stride_en, BLOCK_N, BLOCK_K, not EVEN_K,
                          OUT_DTYPE)
        xt = _load_act(x_ptrs, m_mask, offs_k, k0, K, EVEN_K)
        acc = _mma(w, xt, acc, DOT_F32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(OUT_DTYPE).to(tl.float32)
        acc += bias[:, None]
    y_ptrs = y_ptr + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(OUT_DTYPE), mask=m_mask[None, :] & n_mask[:, None])


@triton.jit
def _nvfp4_grad_input_kernel(
    dy_ptr,
    p_ptr,
    e_ptr,
    dx_ptr,
    M,
    N,
    K,
    M_BUCKET,  # autotune key only
    stride_dym,
    stride_pn,
    stride_en,
    stride_dxm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # reduction tile (rows of W)
    BLOCK_K: tl.constexpr,  # output tile (columns of W)
    GROUP_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_F32: tl.constexpr = False,
):
    """dx[M, K] = dy[M, N] @ W[N, K], computed as dx.T tile [BLOCK_K, BLOCK_M] =
    W.T tile [BLOCK_K, BLOCK_N] @ dy.T tile [BLOCK_N, BLOCK_M] (reduction over N), W
    dequantized in registers, dy.T read from shared memory."""
    OUT_DTYPE: tl.constexpr = dx_ptr.dtype.element_ty
    pid = tl.program_id(0)
    pid_m, pid_k = _grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(K, BLOCK_K), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    k_mask = offs_k < K
    k0 = pid_k * BLOCK_K
    dy_ptrs = dy_ptr + offs_m[None, :].to(tl.int64) * stride_dym + offs_n[:, None]  # dy.T tile [N, M]
    # first N step peeled (see the forward kernel)
    n_mask = offs_n < N
    rows = tl.where(n_mask, offs_n, 0)
    w = _dequant_tile(p_ptr, e_ptr, rows, n_mask, k0, K, stride_pn, stride_en, BLOCK_N, BLOCK_K, not EVEN_K, OUT_DTYPE)
    dyt = _load_act(dy_ptrs, m_mask, offs_n, 0, N, EVEN_N)
    acc = _mma(tl.trans(w), dyt, None, DOT_F32)  # [BLOCK_K, BLOCK_M] float32
    for n0 in range(BLOCK_N, N, BLOCK_N):
        dy_ptrs += BLOCK_N
        cur = n0 + offs_n
        n_mask = cur < N
        rows = tl.where(n_mask, cur, 0)
        w = _dequant_tile(p_ptr, e_ptr, rows, n_mask, k0, K, stride_pn, stride_en, BLOCK_N, BLOCK_K, not EVEN_K,
                          OUT_DTYPE)
        dyt = _load_act(dy_ptrs, m_mask, offs_n, n0, N, EVEN_N)
        acc = _mma(tl.trans(w), dyt, acc, DOT_F32)
    dx_ptrs = dx_ptr + offs_m[None, :].to(tl.int64) * stride_dxm + offs_k[:, None]
    tl.store(dx_ptrs, acc.to(OUT_DTYPE), mask=m_mask[None, :] & k_mask[:, None])


@triton.jit
def _nvfp4_dequant_kernel(
    p_ptr, e_ptr, w_ptr, N, K, stride_pn, stride_en, stride_wn, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """W[N, K] written densely: the tile dequantization of the GEMMs (`nvfp4_dequantize_triton`)."""
    OUT_DTYPE: tl.constexpr = w_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k0 = tl.program_id(1) * BLOCK_K
    row_mask = rows < N
    w = _dequant_tile(p_ptr, e_ptr, tl.where(row_mask, rows, 0), row_mask, k0, K, stride_pn, stride_en,
                      BLOCK_R, BLOCK_K, True, OUT_DTYPE)
    cols = k0 + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :], w,
             mask=row_mask[:, None] & (cols[None, :] < K))


# ---------------------------------------------------------------------------------------
# Autotuning (the configurations: qerl_lib.kernels.nvfp4_triton_configs)
# ---------------------------------------------------------------------------------------

_fwd_tuned = triton.autotune(
    configs=FWD_CONFIGS, key=["M_BUCKET", "N", "K", "HAS_BIAS"], prune_configs_by={"early_config_prune": _prune},
    do_bench=_bench,
)(triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})(_nvfp4_fwd_kernel))

_grad_tuned = triton.autotune(
    configs=GRAD_CONFIGS, key=["M_BUCKET", "N", "K"], prune_configs_by={"early_config_prune": _prune},
    do_bench=_bench,
)(triton.heuristics({
    "EVEN_N": lambda a: a["N"] % a["BLOCK_N"] == 0,
    "EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0,
})(_nvfp4_grad_input_kernel))

# The dequantization kernel is a copy with arithmetic (DQ_CONFIGS: bigger tiles, longer contiguous rows).
_dq_tuned = triton.autotune(configs=DQ_CONFIGS, key=["N", "K"], do_bench=_bench)(_nvfp4_dequant_kernel)

# ---------------------------------------------------------------------------------------
# Host wrappers
# ---------------------------------------------------------------------------------------


def _m_bucket(m: int) -> int:
    return max(16, triton.next_power_of_2(max(m, 1)))


def _check(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, k: int):
    n, half_k = packed.shape
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8, got {packed.dtype}")
    if 2 * half_k != k or k % BLOCK_SIZE:
        raise ValueError(f"packed {tuple(packed.shape)} does not match K={k} (K must be a multiple of {BLOCK_SIZE})")
    if scale.shape != (n, k // BLOCK_SIZE):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match packed {tuple(packed.shape)}")
    if scale.dtype != torch.uint8:
        if scale.dtype != torch.float8_e4m3fn:
            scale = scale.to(torch.float8_e4m3fn)  # float values holding FP8 numbers
        scale = scale.view(torch.uint8)
    if packed.stride(-1) != 1:
        packed = packed.contiguous()
    if scale.stride(-1) != 1:
        scale = scale.contiguous()
    global_scale = global_scale.to(device=packed.device, dtype=torch.float32).reshape(1)
    return packed, effective_scales(scale, global_scale)


def effective_scales(scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """float32 [N, K // 16] = fp32(scale) / global_scale * 2**14 (one small kernel, per call).

    `scale` is the uint8 view of the float8_e4m3fn block scales. Bit-identical to
    `scale.view(float8_e4m3fn).float() / global_scale * 16384` (tested).
    """
    eff = torch.empty(scale.shape, dtype=torch.float32, device=scale.device)
    n = scale.numel()
    if n:
        block = 1024
        _eff_kernel[(triton.cdiv(n, block),)](scale, global_scale, eff, n, BLOCK=block)
    return eff


def _launch_cfg(config: dict | None) -> dict | None:
    if config is None and interpreter_mode():
        config = INTERPRETER_CONFIG
    if config is None:
        return None
    config = dict(config)
    if interpreter_mode():
        config["DOT_F32"] = True
    return config


def nvfp4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T (+ bias) in x.dtype (bf16 or fp16), W = NVFP4 (packed, scale, global_scale).

    `config` (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, optional num_warps/num_stages) bypasses
    the autotuner.
    """
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [M, K], got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"nvfp4_matmul needs bf16 or fp16 activations, got {x.dtype}")
    m, k = x.shape
    n = packed.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_() if bias is None else y.copy_(bias.to(x.dtype).expand(m, n))
    packed, eff = _check(packed, scale, global_scale, k)
    has_bias = bias is not None
    b = bias if has_bias else y  # dummy pointer when there is no bias
    args = (x, packed, eff, b, y, m, n, k, _m_bucket(m), x.stride(0), packed.stride(0), eff.stride(0), y.stride(0))
    cfg = _launch_cfg(config)
    if cfg is None:
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        _fwd_tuned[grid](*args, HAS_BIAS=has_bias)
    else:
        warps, stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 3)
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
        _nvfp4_fwd_kernel[grid](*args, HAS_BIAS=has_bias, EVEN_K=k % cfg["BLOCK_K"] == 0,
                                num_warps=warps, num_stages=stages, **cfg)
    return y


def nvfp4_grad_input(
    grad_y: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """grad_x [M, K] = grad_y [M, N] @ W [N, K] in grad_y.dtype (bf16 or fp16)."""
    if grad_y.ndim != 2:
        raise ValueError(f"grad_y must be 2-D [M, N], got {tuple(grad_y.shape)}")
    if grad_y.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"nvfp4_grad_input needs bf16 or fp16 gradients, got {grad_y.dtype}")
    m, n = grad_y.shape
    if packed.shape[0] != n:
        raise ValueError(f"grad_y has {n} columns, W has {packed.shape[0]} rows")
    k = 2 * packed.shape[1]
    if grad_y.stride(-1) != 1:
        grad_y = grad_y.contiguous()
    dx = torch.empty((m, k), dtype=grad_y.dtype, device=grad_y.device)
    if m == 0 or k == 0:
        return dx
    if n == 0:
        return dx.zero_()
    packed, eff = _check(packed, scale, global_scale, k)
    args = (grad_y, packed, eff, dx, m, n, k, _m_bucket(m), grad_y.stride(0), packed.stride(0), eff.stride(0),
            dx.stride(0))
    cfg = _launch_cfg(config)
    if cfg is None:
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(k, meta["BLOCK_K"]),)  # noqa: E731
        _grad_tuned[grid](*args)
    else:
        warps, stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 3)
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(k, cfg["BLOCK_K"]),)
        _nvfp4_grad_input_kernel[grid](*args, EVEN_N=n % cfg["BLOCK_N"] == 0, EVEN_K=k % cfg["BLOCK_K"] == 0,
                                       num_warps=warps, num_stages=stages, **cfg)
    return dx


def nvfp4_dequantize_triton(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Dense W [N, K] through the GEMMs' tile dequantization, in one kernel: equal to `dequantize_nvfp4`
    (the dequantize-once backend of `qerl_lib.kernels.nvfp4_backends` and the tests use it)."""
    n, half_k = packed.shape
    k = 2 * half_k
    w = torch.empty((n, k), dtype=dtype, device=packed.device)
    if n and k:
        packed, eff = _check(packed, scale, global_scale, k)
        args = (packed, eff, w, n, k, packed.stride(0), eff.stride(0), w.stride(0))
        if interpreter_mode():
            _nvfp4_dequant_kernel[(triton.cdiv(n, 16), triton.cdiv(k, 64))](*args, BLOCK_R=16, BLOCK_K=64)
        else:
            grid = lambda meta: (triton.cdiv(n, meta["BLOCK_R"]), triton.cdiv(k, meta["BLOCK_K"]))  # noqa: E731
            _dq_tuned[grid](*args)
    return w


def tuned_configs() -> dict[str, dict[str, str]]:
    """The configuration the autotuner chose per key, for each kernel (for benchmark records)."""
    out = {}
    for name, tuner in (("forward", _fwd_tuned), ("grad_input", _grad_tuned), ("dequantize", _dq_tuned)):
        out[name] = {str(key): str(cfg) for key, cfg in tuner.cache.items()}
    return out
