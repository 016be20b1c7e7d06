// NVFP4 W4A16 decode GEMM (qerl_lib/kernels/nvfp4_gemv_cuda.py): launch parameters shared by the CUDA
// source (nvfp4_gemv.cu), the torch binding (nvfp4_gemv_bind.cpp) and the host emulation test
// (nvfp4_gemv_host_test.cu). Plain C++: no CUDA or torch header.
#pragma once
#include <cstdint>

namespace qg {

constexpr int kChunkK = 128;    // k of one chunk: 4 lanes x 32 k (16 bytes of codes each) of a row
constexpr int kUnroll = 4;      // chunks whose loads a warp issues before it uses the first
constexpr int kMaxSlices = 3;   // LoRA output slices (q|k|v)
constexpr int kMaxWarps = 16;   // warps per block (WR x WK)
constexpr int kMaxRank = 64;    // LoRA rank (the GEMV stages t [M, slices * rank] in shared memory)
constexpr int kShrinkK = 4096;  // k per block of the LoRA shrink (K slices)

// The GEMV's K loop (Params::loop; repacked codes only, else always kRounds): nvfp4_gemv.cu.
constexpr int kRounds = 0;  // round by round: U chunks' loads, then their MMAs (the default)
constexpr int kRing = 1;    // U slots, each refilled as soon as its chunk is computed (ring_loop)
constexpr int kPipe = 2;    // two sets of U / 2 chunks, one computing while the other loads (pipe_loop)
constexpr int kPipe2 = 3;   // the same with sets of U chunks: two rounds' codes in registers
constexpr int kMaxWarpsPipe2 = 8;  // kPipe2's block limit: its codes need more than the 128 registers of 16 warps

// y [M, N] = x [M, K] @ W.T * (128 / gs) + bias + B_s . t  (W'' = e2m1 * fp8 * 2**-7 in the MMA)
struct Params {
  const uint8_t* codes;    // packed [N, K/2], low nibble = even k
  const uint8_t* scales;   // FP8 E4M3 bytes [N, K/16]
  const float* gs;         // global scale, [1] (gs_stride 0) or [N] (gs_stride 1)
  const void* bias;        // [N] or null; bias_kind 1 float32, 2 bf16, 3 fp16
  const void* x;           // [M, K] bf16/fp16, rows x_stride elements apart
  void* y;                 // [M, N] x.dtype, rows y_stride elements apart
  const float* t;          // LoRA shrink partials [ks, M, t_stride] float32 (scale, row mask applied), or null
  const void* lb0;         // LoRA B slices [n_i, rank] (x.dtype), rows sb_i elements apart
  const void* lb1;
  const void* lb2;
  int64_t code_stride, scale_stride, x_stride, y_stride, sb0, sb1, sb2;
  int M, N, K, gs_stride, bias_kind, rank, t_stride, ks, off1, off2;  // slice 1 starts at row off1, 2 at off2
  int wr, wk;              // row tiles (16 rows) per block, warps splitting K per row tile
  int wait_x;              // launched as a PDL secondary of the kernel that wrote x: wait before reading x
  int repacked;            // codes in the repacked layout (nvfp4_gemv.cuh repack_word), not compressed-tensors'
  int loop;                // repacked only: kRounds, kRing, kPipe or kPipe2 (the K loop, above)
};

// t [ks, M, S * rank]: partial sums of lora_scale * mask[m] * x @ A_s.T over K slices of `kslice` k (a
// multiple of 8), one block per (slice s and rank row j, K slice); the GEMV sums the ks partials.
struct ShrinkParams {
  const void* x;
  const void* a0;          // A slices [rank, K] (x.dtype), rows sa_i elements apart
  const void* a1;
  const void* a2;
  const void* index;       // per-row LoRA slot [>= M] or null; index_kind 1 int32, 2 int64
  float* t;
  int64_t x_stride, sa0, sa1, sa2;
  int M, K, rank, t_stride, index_kind, slot, kslice;
  float scale;
};

// Host launchers (nvfp4_gemv.cu); return a cudaError_t as int (0: launched).
int launch_gemv(const Params& p, bool bf16, bool aligned, bool pdl, void* stream);
int launch_lora_shrink(const ShrinkParams& p, bool bf16, int slices, void* stream);
// Registers per thread of the GEMV kernel of (bf16, mt, aligned, repacked, loop) (cudaFuncGetAttributes), or -1.
int gemv_kernel_regs(bool bf16, int mt, bool aligned, bool repacked, int loop = kRounds);

}  // namespace qg
