"""NVFP4 W4A16 decode GEMM for 1..64 rows (Triton): the rollout engine's small-batch linear.

    y [M, N] = x [M, K] @ W.T (+ bias) (+ lora_scale * (x @ A.T) @ B.T, in the same launch)

W [N, K] stays in the compressed-tensors layout (`qerl_lib.nvfp4`): `packed` uint8 [N, K/2] (low
nibble = even k), `scale` float8_e4m3fn [N, K/16], `global_scale` float32 [1] or [N] (per output
row: fused partitions with their own scales). W = e2m1 * scale / global_scale.

**Bytes per output column:** K * 0.5625 (half a byte of code, 1/16 byte of FP8 scale), read once,
whatever M. Besides, through L2: x (M * K * 2 bytes per column tile), the split-K partials
(split * M * N * 8 bytes written and read back) and the LoRA factors once.

**Arithmetic (exact).** W'' = e2m1 * fp8 * 2**-7 has at most 6 significant bits and lies in
[2**-17, 21], so it is exact in bf16 and fp16. On the GPU one PTX block per 32-bit word of codes
(`_DECODE_BF16`) puts each byte's two nibbles into the two halves of a 16-bit-float pair (prmt; the
sign stays, e1 e0 m shifted to bf16 bits 8..6, i.e. e2m1 * 2**-126, subnormal for e = 0) and
multiplies the pair by the group's scale (fp8 * 2**119) in one packed FMA with -0.0: 5 instructions
per 2 weights. The MMA accumulates in float32; the epilogue multiplies by 2**7 / global_scale. The
result is the float32 dequantized reference up to float32 summation order, then one rounding: more
accurate than a GEMM on the bf16-rounded dense weight. No scale tensor per call, no lookup table.

**K order.** The dequantized tile is the MMA's register operand (swap-AB, as in `nvfp4_triton`: the
tokens, padded to 16/32/64, are the MMA's N side). A thread (lane c of its quad) holds positions
2c, 2c+1, 2c+8, 2c+9 of every k16 step; the kernel permutes K inside each 64 (`_k_order`) so that
those are the 8 bytes of *one* scale group over four k16 steps: each thread reads whole groups
(8 contiguous bytes) and converts one scale per 16 weights; x is loaded in the same order.
Compiled for sm_90a (Triton 3.9, on the CPU): 580 SASS instructions per K step of 64 x 256 x 16 at
4 warps (4.5 per weight, 2.5 of them the decode), 163 registers, no spills; the loads of codes, scales
and x are cp.async-pipelined.

**Tiling: split-K, one launch.** A CTA owns BLOCK_N output columns and a contiguous K range; `plan`
splits K by a wave model (at M = 1 on the 7B shapes: 360-1184 CTAs of 18-99 KB of codes). Splits
write float32 partials; a per-tile arrival counter picks the last CTA of a tile, which sums them in
a fixed order (deterministic: no float atomics), applies 2**7 / global_scale, bias and LoRA, writes
y and resets its counter: the int32 counters are zero after every launch, so CUDA graphs replay the
kernel as captured. No memset, no second kernel.

**Fused LoRA.** The first `lora_units` CTAs (by an atomic ticket: whatever waits on them is already
running) compute t = x @ A.T over slices of K; the last sums them (times `lora_scale`, rows masked by
`lora_index == lora_slot`) and raises a flag; each tile's last CTA waits for it (a bounded spin: a
broken flag would give a wrong result, never a hang) and adds B_tile @ t (t split into two 16-bit
parts, ~16 significant bits). A is read once, not once per tile. Up to 3 output slices (vLLM's
q|k|v, gate|up), each with its own A [r, K] and B [n_i, r]: zero-copy views of vLLM's slot-0 LoRA
buffers.

`nvfp4_gemv` is the function, `register_op()` the torch custom op `qerl::nvfp4_gemv`. Tests:
tests/test_nvfp4_gemv.py (Triton's interpreter on the CPU; `-m gpu`); timing:
benchmarks/nvfp4_gemv.py; notes: docs/kernels.md.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from qerl_lib.kernels.gemv_args import check_args, define_op
from qerl_lib.kernels.nvfp4_triton import _mma, interpreter_mode

MAX_ROWS = 64
"""Largest M served (one row tile)."""
MAX_SLICES = 3
"""Most LoRA output slices (q|k|v)."""
COUNTER_HEAD = 4
"""int32 counters before the per-tile ones: ticket, LoRA arrivals, LoRA-ready flag, finished tiles."""
_HEAD = tl.constexpr(COUNTER_HEAD)
_MAX_TILES = 8192


def _decode_asm(shift: int, fma: str) -> str:
    """PTX: word $4 (bytes b0..b3, nibbles n0..n7) and a 16-bit pair scale $5 -> $0..$3, where $i holds
    (n_2i, n_2i+1) of byte i as 16-bit floats times the scale: prmt puts n_2i (from word << 4) at bits
    15..12 and n_2i+1 at 31..28; sign stays, e1 e0 m shift right by `shift` (6: bf16 bits 8..6, value
    e2m1 * 2**-126; 3: fp16 bits 11..9, e2m1 * 2**-14); one packed FMA with -0.0 multiplies exactly."""
    body = ["{", ".reg .b32 q4, d, t, nz;", "shl.b32 q4, $4, 4;", "mov.b32 nz, 0x80008000;"]
    for i in range(4):
        body += [f"prmt.b32 d, q4, $4, 0x{4 + i:x}0{i:x}0;", "and.b32 t, d, 0x70007000;", f"shr.b32 t, t, {shift};",
                 "lop3.b32 d, d, 0x80008000, t, 0xEA;", f"{fma} ${i}, d, $5, nz;"]
    return " ".join(body + ["}"])


_DECODE_BF16 = tl.constexpr(_decode_asm(6, "fma.rn.bf16x2"))
_DECODE_F16 = tl.constexpr(_decode_asm(3, "fma.rn.f16x2"))


# ---------------------------------------------------------------------------------------
# Device code
# ---------------------------------------------------------------------------------------


@triton.jit
def _w_tile(p_ptr, s_ptr, rows, k0, K, stride_pn, stride_sn,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MASK_K: tl.constexpr, DTYPE: tl.constexpr,
            INTERP: tl.constexpr):
    """W'' [BLOCK_N, BLOCK_K] = e2m1 * fp8 scale * 2**-7 (exact in DTYPE) in the logical K order of
    `_k_order`: byte j of scale group c of 64-block s -> k = 64 s + 16 (j // 2) + 8 (j % 2) + 2 c + e
    (e: nibble). `rows` must be valid row indices; groups past K read 0. INTERP: no PTX (the fp16
    bit trick of `nvfp4_triton`, e2m1 * 2**-14, and float32 products; same values)."""
    S: tl.constexpr = BLOCK_K // 64
    grp = k0 // 16 + tl.arange(0, S)[:, None] * 4 + tl.arange(0, 4)[None, :]  # [S, 4 c] group index
    r64 = rows.to(tl.int64)
    s_ptrs = s_ptr + r64[:, None, None] * stride_sn + grp[None]
    if MASK_K:
        s = tl.load(s_ptrs, mask=(grp * 16 < K)[None, :, :], other=0).to(tl.int32)
    else:
        s = tl.load(s_ptrs).to(tl.int32)
    # FP8 E4M3 byte s|eeee|mmm as fp16 bits s|0|eeee|mmm|0000000 = fp8 * 2**-8, subnormals included
    s16 = (((s & 0x80) << 8) | ((s & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True)
    if INTERP:
        cols = grp[:, :, None] * 8 + tl.arange(0, 8)[None, None, :]  # [S, 4, 8 j] byte columns
        b_ptrs = p_ptr + r64[:, None, None, None] * stride_pn + cols[None]
        if MASK_K:
            b = tl.load(b_ptrs, mask=(grp * 16 < K)[None, :, :, None], other=0).to(tl.uint32)
        else:
            b = tl.load(b_ptrs).to(tl.uint32)
        pair = ((b * 0x00200200) & 0x0E000E00) | ((b * 0x01001000) & 0x80008000)  # low nibble: bits 15..0
        lo = pair.to(tl.uint16).to(tl.float16, bitcast=True)
        hi = (pair >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
        sc = s16.to(tl.float32) * 32768.0  # fp8 * 2**7
        w = (tl.join(lo, hi).to(tl.float32) * sc[:, :, :, None, None]).to(DTYPE)  # [N, S, 4 c, 8 j, 2 e]
    else:
        # 32-bit words, 4 bytes each; one PTX block decodes a word into 4 registers of 16-bit pairs
        wcols = grp[:, :, None] * 2 + tl.arange(0, 2)[None, None, :]  # [S, 4, 2 w]
        q_ptrs = p_ptr.to(tl.pointer_type(tl.uint32)) + r64[:, None, None, None] * (stride_pn // 4) + wcols[None]
        if MASK_K:
            q = tl.load(q_ptrs, mask=(grp * 16 < K)[None, :, :, None], other=0)
        else:
            q = tl.load(q_ptrs)
        if DTYPE == tl.bfloat16:
            sc = (s16.to(tl.float32) * 1.7014118346046923e38).to(DTYPE)  # fp8 * 2**119, exact
            asm: tl.constexpr = _DECODE_BF16
        else:
            sc = (s16.to(tl.float32) * 32768.0).to(DTYPE)  # fp8 * 2**7, exact
            asm: tl.constexpr = _DECODE_F16
        sb = sc.to(tl.uint16, bitcast=True).to(tl.uint32)
        sb = tl.broadcast_to((sb | (sb << 16))[:, :, :, None], q.shape)
        o0, o1, o2, o3 = tl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r,r", [q, sb], dtype=(tl.uint32,) * 4,
                                                   is_pure=True, pack=1)
        pair = tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), [BLOCK_N, S, 4, 8])  # byte j = 4 w + i
        lo = pair.to(tl.uint16).to(DTYPE, bitcast=True)
        hi = (pair >> 16).to(tl.uint16).to(DTYPE, bitcast=True)
        w = tl.join(lo, hi)  # [N, S, 4 c, 8 j, 2 e]
    w = tl.permute(tl.reshape(w, [BLOCK_N, S, 4, 4, 2, 2]), (0, 1, 3, 4, 2, 5))  # [N, S, j//2, j%2, c, e]
    return tl.reshape(w, [BLOCK_N, BLOCK_K])


@triton.jit
def _k_order(k0, BLOCK_K: tl.constexpr):
    """Physical k of the logical positions 0..BLOCK_K-1 of `_w_tile` (a permutation inside each 64)."""
    kl = tl.arange(0, BLOCK_K)
    return k0 + (kl // 64) * 64 + ((kl // 2) % 4) * 16 + ((kl // 16) % 4) * 4 + ((kl // 8) % 2) * 2 + kl % 2


@triton.jit
def _x_tile(x_ptr, x_rows, k0, K, stride_xm, BLOCK_K: tl.constexpr, MASK_K: tl.constexpr, PERMUTED: tl.constexpr):
    """x.T tile [BLOCK_K, BLOCK_M] at k0, in the logical K order of `_w_tile` if PERMUTED. `x_rows` are
    clamped into [0, M) (padding rows repeat row M - 1; their outputs are never stored); k >= K reads 0."""
    if PERMUTED:
        ks = _k_order(k0, BLOCK_K)
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
    ptrs = x_ptr + x_rows[None, :] * stride_xm + ks[:, None]
    if MASK_K:
        return tl.load(ptrs, mask=(ks < K)[:, None], other=0.0)
    return tl.load(ptrs)


@triton.jit
def _shrink_slice(a_ptr, stride_a, rank, x_ptr, x_rows, s0, s1, K, stride_xm,
                  R_PAD: tl.constexpr, BLOCK_K: tl.constexpr, MASK_K: tl.constexpr, DOT_F32: tl.constexpr):
    """t.T [R_PAD, BLOCK_M] = A [rank, K] @ x.T over K steps [s0, s1) (float32); rows past `rank` are 0."""
    offs_r = tl.arange(0, R_PAD)
    r_ok = offs_r < rank
    ks = s0 * BLOCK_K + tl.arange(0, BLOCK_K)
    a = tl.load(a_ptr + offs_r[:, None] * stride_a + ks[None, :], mask=r_ok[:, None] & (ks < K)[None, :], other=0.0)
    t = _mma(a, _x_tile(x_ptr, x_rows, s0 * BLOCK_K, K, stride_xm, BLOCK_K, MASK_K, False), None, DOT_F32)
    for st in range(s0 + 1, s1):
        ks = st * BLOCK_K + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + offs_r[:, None] * stride_a + ks[None, :], mask=r_ok[:, None] & (ks < K)[None, :],
                    other=0.0)
        t = _mma(a, _x_tile(x_ptr, x_rows, st * BLOCK_K, K, stride_xm, BLOCK_K, MASK_K, False), t, DOT_F32)
    return t


@triton.jit
def _expand_slice(out, b_ptr, stride_b, rank, row0, row1, offs_n, t_ptr, t_tile,
                  DTYPE: tl.constexpr, R_PAD: tl.constexpr, DOT_F32: tl.constexpr):
    """out [BLOCK_N, BLOCK_M] + B[offs_n - row0] @ t for the rows of this slice ([row0, row1)); t [R_PAD,
    BLOCK_M] float32 is split into two 16-bit parts (hi + lo, about 16 significant bits) for the MMA."""
    offs_r = tl.arange(0, R_PAD)
    in_slice = (offs_n >= row0) & (offs_n < row1)
    rows = tl.where(in_slice, offs_n - row0, 0)
    b = tl.load(b_ptr + rows[:, None].to(tl.int64) * stride_b + offs_r[None, :],
                mask=in_slice[:, None] & (offs_r < rank)[None, :], other=0.0)
    t = tl.load(t_ptr + t_tile, cache_modifier=".cg")
    t_hi = t.to(DTYPE)
    t_lo = (t - t_hi.to(tl.float32)).to(DTYPE)
    out = _mma(b, t_hi, out, DOT_F32)
    return _mma(b, t_lo, out, DOT_F32)


# the row count, splits and LoRA geometry vary per call: one compiled kernel serves them all
_RUNTIME_INTS = ["M", "gs_stride", "n_tiles", "split", "split_steps", "lora_units", "lora_steps", "rank", "off1",
                 "off2", "lora_slot"]


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _nvfp4_gemv_kernel(
    x_ptr, p_ptr, s_ptr, gs_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
    a0_ptr, a1_ptr, a2_ptr, b0_ptr, b1_ptr, b2_ptr, t_ptr, idx_ptr,
    M, N, K, stride_xm, stride_pn, stride_sn, stride_ym, gs_stride,
    n_tiles, split, split_steps, lora_units, lora_steps,
    rank, off1, off2, sa0, sa1, sa2, sb0, sb1, sb2, lora_slot, lora_scale,
    HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, HAS_INDEX: tl.constexpr, N_SLICES: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    R_PAD: tl.constexpr, MASK_K: tl.constexpr, DOT_F32: tl.constexpr = False,
):
    """One CTA = one unit: a LoRA shrink slice of K (the first `lora_units` tickets) or a (column tile,
    K split) of the base product; the module docstring gives the protocol of the counters."""
    DTYPE: tl.constexpr = y_ptr.dtype.element_ty
    T_SIZE: tl.constexpr = R_PAD * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    x_rows = tl.minimum(offs_m, M - 1)
    t_tile = tl.arange(0, R_PAD)[:, None] * BLOCK_M + offs_m[None, :]
    steps = tl.cdiv(K, BLOCK_K)
    if HAS_LORA:
        u = tl.atomic_add(cnt_ptr, 1)  # ticket: shrink units first, so waiting on them cannot deadlock
        is_shrink = u < lora_units
    else:
        u = tl.program_id(0)
        is_shrink: tl.constexpr = False
    if is_shrink:
        s0 = u * lora_steps
        s1 = tl.minimum(s0 + lora_steps, steps)
        tpart = t_ptr + (u + 1) * (N_SLICES * T_SIZE)  # slot 0 holds the sums
        tl.store(tpart + t_tile, _shrink_slice(a0_ptr, sa0, rank, x_ptr, x_rows, s0, s1, K, stride_xm,
                                              R_PAD, BLOCK_K, MASK_K, DOT_F32))
        if N_SLICES > 1:
            tl.store(tpart + T_SIZE + t_tile, _shrink_slice(a1_ptr, sa1, rank, x_ptr, x_rows, s0, s1, K, stride_xm,
                                                           R_PAD, BLOCK_K, MASK_K, DOT_F32))
        if N_SLICES > 2:
            tl.store(tpart + 2 * T_SIZE + t_tile, _shrink_slice(a2_ptr, sa2, rank, x_ptr, x_rows, s0, s1, K,
                                                               stride_xm, R_PAD, BLOCK_K, MASK_K, DOT_F32))
        tl.debug_barrier()
        if tl.atomic_add(cnt_ptr + 1, 1) == lora_units - 1:  # the last shrink unit sums, in a fixed order
            rowsel = tl.where(m_mask, lora_scale, 0.0)
            if HAS_INDEX:
                slot = tl.load(idx_ptr + offs_m, mask=m_mask, other=-1)
                rowsel = tl.where(slot == lora_slot, rowsel, 0.0)
            for sl in tl.static_range(N_SLICES):
                t = tl.load(t_ptr + (N_SLICES + sl) * T_SIZE + t_tile, cache_modifier=".cg")
                for v in range(1, lora_units):
                    t += tl.load(t_ptr + ((v + 1) * N_SLICES + sl) * T_SIZE + t_tile, cache_modifier=".cg")
                tl.store(t_ptr + sl * T_SIZE + t_tile, t * rowsel[None, :])
            tl.debug_barrier()
            tl.atomic_xchg(cnt_ptr + 2, 1)  # LoRA ready (release)
    else:
        w = u - lora_units
        tile = w // split
        part = w - tile * split
        s0 = part * split_steps
        s1 = tl.minimum(s0 + split_steps, steps)
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        rows = tl.minimum(offs_n, N - 1)  # every row readable; rows past N are never stored
        # first K step peeled: the accumulator starts as a product (no zero-fill in the pipelined loop)
        wt = _w_tile(p_ptr, s_ptr, rows, s0 * BLOCK_K, K, stride_pn, stride_sn, BLOCK_N, BLOCK_K, MASK_K, DTYPE,
                     DOT_F32)
        acc = _mma(wt, _x_tile(x_ptr, x_rows, s0 * BLOCK_K, K, stride_xm, BLOCK_K, MASK_K, True), None, DOT_F32)
        for st in range(s0 + 1, s1):
            wt = _w_tile(p_ptr, s_ptr, rows, st * BLOCK_K, K, stride_pn, stride_sn, BLOCK_N, BLOCK_K, MASK_K,
                         DTYPE, DOT_F32)
            acc = _mma(wt, _x_tile(x_ptr, x_rows, st * BLOCK_K, K, stride_xm, BLOCK_K, MASK_K, True), acc, DOT_F32)
        out_mask = n_mask[:, None] & m_mask[None, :]
        mn = offs_m[None, :] * N + offs_n[:, None]  # [BLOCK_N, BLOCK_M] into an [M, N] partial
        last = True
        if SPLIT_K:
            tl.store(ws_ptr + part * M * N + mn, acc, mask=out_mask)
            tl.debug_barrier()
            last = tl.atomic_add(cnt_ptr + _HEAD + tile, 1) == split - 1
        if last:
            if SPLIT_K:  # fixed summation order: the same bits whichever CTA arrives last
                acc = tl.load(ws_ptr + mn, mask=out_mask, other=0.0, cache_modifier=".cg")
                for q in range(1, split):
                    acc += tl.load(ws_ptr + q * M * N + mn, mask=out_mask, other=0.0, cache_modifier=".cg")
                tl.atomic_xchg(cnt_ptr + _HEAD + tile, 0)
            out = acc * (128.0 / tl.load(gs_ptr + rows * gs_stride))[:, None]  # W'' carries 2**-7
            if HAS_BIAS:
                out += tl.load(bias_ptr + rows).to(tl.float32)[:, None]
            if HAS_LORA:
                ready = tl.atomic_add(cnt_ptr + 2, 0)
                spins = 0
                while (ready == 0) & (spins < 4194304):  # bounded (seconds): a broken flag fails, never hangs
                    ready = tl.atomic_add(cnt_ptr + 2, 0)
                    spins += 1
                out = _expand_slice(out, b0_ptr, sb0, rank, 0, off1, offs_n, t_ptr, t_tile, DTYPE, R_PAD, DOT_F32)
                if N_SLICES > 1:
                    out = _expand_slice(out, b1_ptr, sb1, rank, off1, off2, offs_n, t_ptr + T_SIZE, t_tile, DTYPE,
                                        R_PAD, DOT_F32)
                if N_SLICES > 2:
                    out = _expand_slice(out, b2_ptr, sb2, rank, off2, N, offs_n, t_ptr + 2 * T_SIZE, t_tile, DTYPE,
                                        R_PAD, DOT_F32)
            tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], out.to(DTYPE), mask=out_mask)
            if HAS_LORA:
                tl.debug_barrier()
                if tl.atomic_add(cnt_ptr + 3, 1) == n_tiles - 1:  # every tile done: counters back to zero
                    tl.atomic_xchg(cnt_ptr + 0, 0)
                    tl.atomic_xchg(cnt_ptr + 1, 0)
                    tl.atomic_xchg(cnt_ptr + 2, 0)
                    tl.atomic_xchg(cnt_ptr + 3, 0)


# ---------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------

_COUNTERS: dict[str, torch.Tensor] = {}
_SMS: dict[int, int] = {}


def counters(device: torch.device) -> torch.Tensor:
    """The int32 arrival counters of launches on `device` (all zero between launches).

    One buffer per device, allocated (zeroed) by the first call: make that call eagerly, before any
    CUDA-graph capture (the worker extension does it at load). Launches that share it must not overlap
    in time, i.e. run on one stream at a time (as a model's forward does; stream order serialises them).
    """
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    buf = _COUNTERS.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("nvfp4_gemv: call it once eagerly on this device before capturing a CUDA graph")
        buf = _COUNTERS[key] = torch.zeros(COUNTER_HEAD + _MAX_TILES, dtype=torch.int32, device=device)
    return buf


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def plan(m: int, n: int, k: int, num_sms: int = 132) -> dict:
    """Launch configuration for an M x N x K call (`_plan`, memoised: it runs on every eager call)."""
    return dict(_plan(m, n, k, num_sms))


@functools.lru_cache(maxsize=4096)
def _plan(m: int, n: int, k: int, num_sms: int) -> tuple:
    return tuple(sorted(plan_uncached(m, n, k, num_sms).items()))


def plan_uncached(m: int, n: int, k: int, num_sms: int = 132) -> dict:
    """Launch configuration for an M x N x K call (a heuristic; `benchmarks/nvfp4_gemv.py` sweeps others).

    M <= 16: 64 columns x 256 K per step (4 warps, 4 stages: 8 KB of codes per stage; 3 CTAs fit an
    SM); larger M: 128 columns x 128 K (8 warps, 2 CTAs per SM), so that x, which every column tile
    re-reads from L2, stays small against the codes. The K split minimises a wave model, waves x (codes
    per CTA + 8 KB of fixed cost + half the partials' L2 traffic), while the float32 partials
    (split * M * N * 8 bytes, through L2) stay below the codes' bytes: at M = 1 on the 7B shapes, 5-7
    splits of q|k|v, o and down, 2 of gate|up.
    """
    if m <= 16:
        cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4)
    else:
        cfg = dict(BLOCK_M=32 if m <= 32 else 64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)
    cfg["BLOCK_K"] = max(64, min(cfg["BLOCK_K"], triton.next_power_of_2(k)))
    steps = triton.cdiv(k, cfg["BLOCK_K"])
    tiles = triton.cdiv(n, cfg["BLOCK_N"])
    resident = (3 if cfg["num_warps"] == 4 else 2) * num_sms
    cap = max(1, min(steps, int(0.07 * k / max(m, 1))))  # split * m * n * 8 <= n * k * 0.5625
    best = None
    for split in range(1, cap + 1):
        per = triton.cdiv(steps, split)
        split = triton.cdiv(steps, per)
        cta_bytes = cfg["BLOCK_N"] * per * cfg["BLOCK_K"] * 0.5625 + 8192 + (4 * m * cfg["BLOCK_N"] if split > 1 else 0)
        cost = triton.cdiv(tiles * split, resident) * cta_bytes
        if best is None or cost < best[0]:
            best = (cost, split)
    cfg["split"] = best[1]
    return cfg


def nvfp4_gemv(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    lora_a: torch.Tensor | Sequence[torch.Tensor] | None = None,
    lora_b: torch.Tensor | Sequence[torch.Tensor] | None = None,
    lora_scale: float = 1.0,
    lora_index: torch.Tensor | None = None,
    lora_slot: int = 0,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W.T (+ bias) (+ lora_scale * (x @ A.T) @ B.T) in x.dtype, one launch.

    - x: bf16 or fp16 [..., K], at most `MAX_ROWS` rows in all;
    - packed: uint8 [N, K/2] (low nibble = even k); scale: float8_e4m3fn (or its uint8 view) [N, K/16];
      global_scale: float32 [1], or [N] (one per output row);
    - bias: [N] (any float dtype; added in float32) or None;
    - lora_a: [r, K], or up to 3 of them (one per output slice); lora_b: [N, r], or one [n_i, r] per
      slice with sum(n_i) = N (slice i covers rows n_0 + ... + n_{i-1} onward); x.dtype; row stride
      free, last dimension contiguous;
    - lora_index: integer [>= M]: row m gets the LoRA term only if lora_index[m] == lora_slot
      (vLLM's per-token LoRA slots; -1 = none); None: every row.
    `config` overrides `plan` (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, split).
    """
    args = check_args("nvfp4_gemv", x, packed, scale, global_scale, bias, lora_a, lora_b, lora_index,
                      max_rows=MAX_ROWS, max_slices=MAX_SLICES)
    lead, k, x2, m, n, scale = args.lead, args.k, args.x2, args.m, args.n, args.scale
    a_list, b_list = args.a_list, args.b_list
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    gs = global_scale.reshape(-1).to(device=x.device, dtype=torch.float32)
    if packed.stride(-1) != 1 or scale.stride(-1) != 1:
        packed, scale = packed.contiguous(), scale.contiguous()
    if packed.data_ptr() % 16 or packed.stride(0) % 4:  # the kernel reads 32-bit words of codes
        packed = packed.clone(memory_format=torch.contiguous_format)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.reshape(*lead, n)
    has_lora = bool(a_list)
    rank = 1
    offs = [n, n]
    if has_lora:
        rank = a_list[0].shape[0]
        widths = [b.shape[0] for b in b_list]
        bounds = [sum(widths[:i + 1]) for i in range(len(widths) - 1)]
        offs = (bounds + [n, n])[:2]

    cfg = dict(config) if config is not None else plan(m, n, k, _num_sms(x.device))
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if m > block_m:
        raise ValueError(f"BLOCK_M={block_m} < M={m}")
    steps = triton.cdiv(k, block_k)
    split_steps = triton.cdiv(steps, max(1, min(int(cfg.get("split", 1)), steps)))
    split = triton.cdiv(steps, split_steps)
    tiles = triton.cdiv(n, block_n)
    if tiles > _MAX_TILES:
        raise ValueError(f"N={n} needs {tiles} column tiles, at most {_MAX_TILES}")
    cnt = counters(x.device)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    r_pad = max(16, triton.next_power_of_2(rank))
    n_slices = max(1, len(a_list))
    lora_steps = triton.cdiv(steps, min(steps, 16))
    lora_units = triton.cdiv(steps, lora_steps) if has_lora else 0
    tbuf = (torch.empty(((lora_units + 1) * n_slices, r_pad, block_m), dtype=torch.float32, device=x.device)
            if has_lora else y)
    pad_a = a_list + [a_list[0]] * (MAX_SLICES - len(a_list)) if has_lora else [x2] * MAX_SLICES
    pad_b = b_list + [b_list[0]] * (MAX_SLICES - len(b_list)) if has_lora else [x2] * MAX_SLICES
    idx = lora_index if (has_lora and lora_index is not None) else y
    grid = (lora_units + tiles * split,)
    meta = dict(
        HAS_BIAS=bias is not None, HAS_LORA=has_lora, HAS_INDEX=has_lora and lora_index is not None,
        N_SLICES=n_slices, SPLIT_K=split > 1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        R_PAD=r_pad, MASK_K=k % block_k != 0, num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3),
    )
    if interpreter_mode():
        meta["DOT_F32"] = True  # the interpreter's dot does not take bf16
    launch = lambda: _nvfp4_gemv_kernel[grid](  # noqa: E731
        x2, packed, scale, gs, bias if bias is not None else y, y, ws, cnt,
        *pad_a, *pad_b, tbuf, idx,
        m, n, k, x2.stride(0), packed.stride(0), scale.stride(0), y.stride(0), 1 if gs.numel() > 1 else 0,
        tiles, split, split_steps, lora_units, lora_steps,
        rank, offs[0], offs[1], *(a.stride(0) for a in pad_a), *(b.stride(0) for b in pad_b),
        int(lora_slot), float(lora_scale), **meta,
    )
    if x.is_cuda:
        with torch.cuda.device(x.device):
            launch()
    else:
        launch()
    return y.reshape(*lead, n)


def register_op():
    """`torch.ops.qerl.nvfp4_gemv` (defined once; `gemv_args.define_op`)."""
    return _op()


@functools.cache
def _op():
    return define_op("nvfp4_gemv", nvfp4_gemv)
