// NVFP4 W4A16 decode GEMM: the per-lane pieces of the kernel (loads, decode, MMA fragments, epilogue),
// host-and-device so that nvfp4_gemv_host_test.cu runs the same code on the CPU (device-only
// instructions have a host twin under `#ifndef __CUDA_ARCH__`, written from the PTX ISA).
//
// Data layout per warp (one MMA m16n8k16 per step; W rows are the MMA's M side, x rows its N side):
// lane = 4 g + t holds rows g and g + 8 of a 16-row tile. Chunk c of a row is 128 k = 64 bytes of
// codes; lane t owns bytes 16 t .. 16 t + 15 (k 128 c + 32 t + [0, 32): two scale groups, one 16-byte
// load and one 2-byte scale load). Step j (0..7) of a chunk uses bytes 2j, 2j+1 of the lane's 16,
// i.e. k 4j .. 4j+3 of its 32: the MMA's K slots {2t, 2t+1} get k 4j, 4j+1 (byte 2j: low nibble, high
// nibble) and {2t+8, 2t+9} get k 4j+2, 4j+3 (byte 2j+1). The same slots of B hold x[g][those k], which
// are x's contiguous bf16 pairs: the K order is permuted per lane, identically for W and x, so the
// MMA's sum is x . W over the chunk.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <vector_types.h>

#include <cstdint>
#include <cstring>

#include "nvfp4_gemv.h"

#define QG_HD __host__ __device__ __forceinline__

namespace qg {

// One row's share of a chunk in one lane: 16 code bytes (32 k) and 2 scale bytes (low: first group).
struct RowChunk {
  uint32_t q[4];
  uint32_t s;
};

// ------------------------------------------------------------------------------------------ loads
// Device loads are `asm volatile`: the compiler then keeps them where the source puts them, so all U
// chunks' loads are in flight before the first MMA (as plain loads, the codes of later chunks were
// sunk next to their use, leaving about one chunk in flight per warp).

QG_HD uint4 ld_stream16(const uint8_t* p) {  // codes: read once, keep them out of L1
#ifdef __CUDA_ARCH__
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
#else
  uint4 v;
  std::memcpy(&v, p, 16);
  return v;
#endif
}

QG_HD uint2 ld_stream8(const uint8_t* p) {
#ifdef __CUDA_ARCH__
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
#else
  uint2 v;
  std::memcpy(&v, p, 8);
  return v;
#endif
}

QG_HD uint32_t ld_u16(const uint8_t* p) {  // scales: 32-byte sectors shared with the neighbouring chunks
#ifdef __CUDA_ARCH__
  uint16_t v;
  asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
#else
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
#endif
}

QG_HD uint32_t ld_u8(const uint8_t* p) {
#ifdef __CUDA_ARCH__
  uint16_t v;
  asm volatile("ld.global.nc.u8 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
#else
  return *p;
#endif
}

// x: every block reads it (L1 keeps it). A plain (coherent) load, not .nc: under PDL x may be written by
// the previous kernel until griddepcontrol.wait, and ptxas moves .nc loads above that wait.
QG_HD uint4 ld_x16(const void* p) {
#ifdef __CUDA_ARCH__
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
#else
  uint4 v;
  std::memcpy(&v, p, 16);
  return v;
#endif
}

// Row chunk c: `cp` = the row's codes + 16 t, `sp` = its scales + 2 t; `groups` = K / 16. Groups past K
// read as code 0 with scale 0. ALIGNED: codes rows 16-byte aligned and scale rows 2-byte aligned. FULL:
// the chunk lies inside K (no checks).
template <bool ALIGNED, bool FULL>
QG_HD void load_row_chunk(RowChunk& r, const uint8_t* cp, const uint8_t* sp, int c, int groups, int t) {
  const int g0 = 8 * c + 2 * t;  // this lane's first group
  cp += 64 * static_cast<int64_t>(c);
  sp += 8 * c;
  if (ALIGNED && (FULL || g0 + 1 < groups)) {
    const uint4 v = ld_stream16(cp);
    r.q[0] = v.x; r.q[1] = v.y; r.q[2] = v.z; r.q[3] = v.w;
    r.s = ld_u16(sp);
    return;
  }
  r.s = 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (FULL || g0 + h < groups) {
      const uint2 v = ld_stream8(cp + 8 * h);
      r.q[2 * h] = v.x; r.q[2 * h + 1] = v.y;
      r.s |= ld_u8(sp + h) << (8 * h);
    } else {
      r.q[2 * h] = 0u; r.q[2 * h + 1] = 0u;
    }
  }
}

// x [row][32 t + 8 i .. + 7] of chunk c, i = 0..3 (`xp` = the row + 32 t). FULL: no checks (a padding
// row reads a real row: its MMA column is never stored); else zero past K or for a padding row.
template <bool FULL>
QG_HD void load_x_chunk(uint4 (&v)[4], const uint8_t* xp, int c, int t, int K, bool row_ok) {
  xp += 2 * static_cast<int64_t>(kChunkK) * c;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (FULL || (row_ok && kChunkK * c + 32 * t + 8 * i < K)) v[i] = ld_x16(xp + 16 * i);
    else v[i] = make_uint4(0u, 0u, 0u, 0u);
  }
}

// A lane's pointers into W's rows g, g+8 of its tile and x's rows g, g+8 (x rows past M: row 0).
struct Lane {
  const uint8_t *cp0, *cp1, *sp0, *sp1, *xp0, *xp1;
  bool xok0, xok1;
  int t, wk;
};

QG_HD Lane lane_setup(const Params& p, int block, int warp, int lane, int mt) {
  Lane l;
  const int g = lane >> 2, wr = warp / p.wk;
  l.t = lane & 3;
  l.wk = warp - wr * p.wk;
  const int tile0 = (block * p.wr + wr) * 16;
  // rows past N read row N - 1 (never stored): every lane loads, so the MMAs stay warp-wide
  const int64_t row0 = tile0 + g < p.N ? tile0 + g : p.N - 1, row1 = tile0 + g + 8 < p.N ? tile0 + g + 8 : p.N - 1;
  l.cp0 = p.codes + row0 * p.code_stride + 16 * l.t;
  l.cp1 = p.codes + row1 * p.code_stride + 16 * l.t;
  l.sp0 = p.scales + row0 * p.scale_stride + 2 * l.t;
  l.sp1 = p.scales + row1 * p.scale_stride + 2 * l.t;
  l.xok0 = g < p.M;
  l.xok1 = mt == 2 && g + 8 < p.M;
  l.xp0 = static_cast<const uint8_t*>(p.x) + 2 * ((l.xok0 ? g : 0) * p.x_stride + 32 * l.t);
  l.xp1 = static_cast<const uint8_t*>(p.x) + 2 * ((l.xok1 ? g + 8 : 0) * p.x_stride + 32 * l.t);
  return l;
}

// ----------------------------------------------------------------------------------------- decode

QG_HD uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
#ifdef __CUDA_ARCH__
  return __byte_perm(a, b, sel);
#else
  const uint64_t v = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<uint32_t>((v >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
#endif
}

// Byte `i` (0..3) of word q (nibbles n0 = low, n1 = high) as a 16-bit float pair (low half n0): prmt puts
// n0 at bits 15..12 (from q << 4) and n1 at 31..28; the sign stays, e1 e0 m shift to bf16 bits 8..6
// (value e2m1 * 2**-126, a subnormal for e = 0) or fp16 bits 11..9 (e2m1 * 2**-14).
template <bool BF16>
QG_HD uint32_t decode_pair(uint32_t q, uint32_t q4, int i) {
  const uint32_t d = prmt(q4, q, (static_cast<uint32_t>(4 + i) << 12) | (static_cast<uint32_t>(i) << 4));
  return (d & 0x80008000u) | ((d & 0x70007000u) >> (BF16 ? 6 : 3));
}

QG_HD float bits_to_float(uint16_t h, bool bf16) {
  if (bf16) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  __half_raw r;
  r.x = h;
  return __half2float(__half(r));
}

QG_HD uint16_t float_to_bits(float f, bool bf16) {
  if (bf16) {
    __nv_bfloat16 b = __float2bfloat16_rn(f);
    uint16_t u;
    std::memcpy(&u, &b, 2);
    return u;
  }
  __half h = __float2half_rn(f);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}

// w * s per 16-bit half (the products are exact: at most 6 significant bits); -0.0 as the addend keeps
// the sign of zero products, as in the Triton kernel's decode.
template <bool BF16>
QG_HD uint32_t mul_pair(uint32_t w, uint32_t s) {
#ifdef __CUDA_ARCH__
  uint32_t r;
  if constexpr (BF16) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(w), "r"(s), "r"(0x80008000u));
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(w), "r"(s), "r"(0x80008000u));
  }
  return r;
#else
  uint32_t r = 0;
  for (int h = 0; h < 2; ++h) {
    const float a = bits_to_float(static_cast<uint16_t>(w >> (16 * h)), BF16);
    const float b = bits_to_float(static_cast<uint16_t>(s >> (16 * h)), BF16);
    r |= static_cast<uint32_t>(float_to_bits(a * b + (-0.0f), BF16)) << (16 * h);
  }
  return r;
#endif
}

// Two FP8 E4M3 scale bytes (low byte: the lane's first group) -> one 16-bit pair per group, the scale in
// both halves, times 2**119 (bf16: with the decode's 2**-126, W'' = e2m1 * fp8 * 2**-7) or 2**7 (fp16).
// Exact: fp8 has 4 significant bits and 448 * 2**119 < 2**128.
template <bool BF16>
QG_HD void scale_pair(uint32_t s2, uint32_t& lo, uint32_t& hi) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(s2 & 0xFFFFu), __NV_E4M3);
  const float mult = BF16 ? 6.64613997892457936451903530140172288e35f : 128.0f;  // 2**119 : 2**7
  const uint32_t a = float_to_bits(bits_to_float(h.x, false) * mult, BF16);
  const uint32_t b = float_to_bits(bits_to_float(h.y, false) * mult, BF16);
  lo = a | (a << 16);
  hi = b | (b << 16);
}

// ------------------------------------------------------------------------------ the repacked layout
// The compressed-tensors word (bytes p = 0..3, byte p = two codes: low nibble n_2p, high n_2p+1) costs
// the decode a PRMT and three more integer instructions per pair, all on the SM's integer pipe, which
// runs at half the issue rate and bounds the kernel at one row (docs/gpu.md, session 13). The repacked
// word holds the same 8 codes with magnitude and sign apart, placed so that one shift each brings a
// pair's two magnitudes and two signs to their 16-bit float positions:
//   bits 3p .. 3p+2: magnitude (e m m) of n_2p     bit 12 + p: its sign
//   bits 16+3p .. 16+3p+2: magnitude of n_2p+1     bit 28 + p: its sign
// Shifts by a constant go to the FMA pipe (IMAD.SHL / IMAD.HI), so a pair costs two integer
// instructions (two LOP3) instead of four. qerl_lib.kernels.nvfp4_gemv_cuda.repack_codes writes it.
QG_HD uint32_t repack_word(uint32_t q) {
  uint32_t r = 0;
  for (int p = 0; p < 4; ++p) {
    const uint32_t lo = (q >> (8 * p)) & 15u, hi = (q >> (8 * p + 4)) & 15u;
    r |= (lo & 7u) << (3 * p) | (lo >> 3) << (12 + p) | (hi & 7u) << (16 + 3 * p) | (hi >> 3) << (28 + p);
  }
  return r;
}

// decode_pair's bits for pair p (0..3) of a repacked word: magnitudes to bf16 bits 8..6 (fp16 11..9),
// signs to bit 15 of each half.
template <bool BF16>
QG_HD uint32_t decode_pair_repacked(uint32_t r, int p) {
  const int up = (BF16 ? 6 : 9) - 3 * p;  // bf16: 6, 3, 0, -3; fp16: 9, 6, 3, 0
#ifdef __CUDA_ARCH__
  const uint32_t mag = up >= 0 ? r << up : __umulhi(r, 1u << (32 + up));  // IMAD.HI: a right shift on the FMA pipe
#else
  const uint32_t mag = up >= 0 ? r << up : r >> -up;
#endif
  const uint32_t sign = r << (3 - p);
  return (mag & (BF16 ? 0x01C001C0u : 0x0E000E00u)) | (sign & 0x80008000u);
}

// A fragment of step j (0..7): {row g k-slots 2t,2t+1; row g+8 same; row g slots 2t+8,2t+9; row g+8 same}.
// REPACKED: the words are in the repacked layout.
template <bool BF16, bool REPACKED = false>
QG_HD void a_fragment(const RowChunk& r0, const RowChunk& r1, const uint32_t (&s0)[2], const uint32_t (&s1)[2],
                      int j, uint32_t (&a)[4]) {
  const int w = j >> 1, b = (j & 1) * 2, grp = j >> 2;
  const uint32_t q0 = r0.q[w], q1 = r1.q[w];
  if constexpr (REPACKED) {
    a[0] = mul_pair<BF16>(decode_pair_repacked<BF16>(q0, b), s0[grp]);
    a[1] = mul_pair<BF16>(decode_pair_repacked<BF16>(q1, b), s1[grp]);
    a[2] = mul_pair<BF16>(decode_pair_repacked<BF16>(q0, b + 1), s0[grp]);
    a[3] = mul_pair<BF16>(decode_pair_repacked<BF16>(q1, b + 1), s1[grp]);
  } else {
    a[0] = mul_pair<BF16>(decode_pair<BF16>(q0, q0 << 4, b), s0[grp]);
    a[1] = mul_pair<BF16>(decode_pair<BF16>(q1, q1 << 4, b), s1[grp]);
    a[2] = mul_pair<BF16>(decode_pair<BF16>(q0, q0 << 4, b + 1), s0[grp]);
    a[3] = mul_pair<BF16>(decode_pair<BF16>(q1, q1 << 4, b + 1), s1[grp]);
  }
}

// B fragment of step j: x at k 4j, 4j+1 and 4j+2, 4j+3 of the lane's 32 (v[i] holds k 8i .. 8i+7).
QG_HD void b_fragment(const uint4 (&v)[4], int j, uint32_t& b0, uint32_t& b1) {
  const uint4 u = v[j >> 1];
  b0 = (j & 1) ? u.z : u.x;
  b1 = (j & 1) ? u.w : u.y;
}

// Where the MMA accumulator keeps (tile row rr 0..15, x row m 0..15): n-tile m / 8, lane, register.
QG_HD void c_slot(int rr, int m, int& mt, int& lane, int& reg) {
  const int mm = m & 7;
  mt = m >> 3;
  lane = ((rr & 7) << 2) | (mm >> 1);
  reg = ((rr >> 3) << 1) | (mm & 1);
}

// ---------------------------------------------------------------------------------------- epilogue

QG_HD float load_f(const void* p, int64_t i, int kind) {  // kind 1 float32, 2 bf16, 3 fp16
  if (kind == 1) return static_cast<const float*>(p)[i];
  return bits_to_float(static_cast<const uint16_t*>(p)[i], kind == 2);
}

// Output (x row m, W row `row`) from the reduced accumulator: * 128 / gs (W'' carries 2**-7), + bias,
// + B_s[row] . t[m] (the LoRA slice s holding the row; t [M, t_stride], the shrink's partials summed,
// already scaled and masked; used when p.t is set).
QG_HD float epilogue(const Params& p, float acc, int row, int m, bool bf16, const float* t) {
  float v = acc * (128.0f / p.gs[static_cast<int64_t>(row) * p.gs_stride]);
  if (p.bias_kind) v += load_f(p.bias, row, p.bias_kind);
  if (p.t != nullptr) {
    const int s = row < p.off1 ? 0 : (row < p.off2 ? 1 : 2);
    const int r0 = s == 0 ? 0 : (s == 1 ? p.off1 : p.off2);
    const void* b = s == 0 ? p.lb0 : (s == 1 ? p.lb1 : p.lb2);
    const int64_t sb = s == 0 ? p.sb0 : (s == 1 ? p.sb1 : p.sb2);
    const int64_t b0 = static_cast<int64_t>(row - r0) * sb;
    const float* tt = t + m * p.t_stride + s * p.rank;
    float l = 0.0f;
    for (int j = 0; j < p.rank; ++j) l += load_f(b, b0 + j, bf16 ? 2 : 3) * tt[j];
    v += l;
  }
  return v;
}

}  // namespace qg
