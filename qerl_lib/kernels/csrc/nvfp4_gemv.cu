// NVFP4 W4A16 decode GEMM for 1..16 rows (qerl_lib/kernels/nvfp4_gemv_cuda.py; the layout of a warp's
// work is in nvfp4_gemv.cuh).
//
// Block: WR row tiles of 16 W rows x WK warps; warp (wr, wk) takes the chunks c = wk, wk + WK, ... of
// its tile (the block's warps walk K side by side, so a row is read in long runs), issuing the loads
// of kUnroll chunks (2 x 16 bytes of codes and 2 x 2 bytes of scales per lane each) before decoding
// the first; x (L1-cached) is loaded one chunk ahead. Per step: 4 decoded registers of W'' (8
// weights), 1 MMA m16n8k16 (2 for M > 8). The warps' float32 accumulators are summed through shared
// memory in a fixed order (deterministic, no atomics) and the epilogue applies 128 / gs, bias and
// the LoRA expand B_s[row] . t[m], t from `lora_shrink_kernel` (launched first).
//
// PDL (programmatic dependent launch, `pdl`): the GEMV is launched as a dependent of the kernel before
// it and lets its own dependents start at once (griddepcontrol.launch_dependents: correctness never
// rests on the trigger, a dependent waits for the whole grid). With LoRA, its primary is the shrink,
// launched normally (so x is complete): the GEMV streams weights and x while the shrink runs and waits
// only before the epilogue. Without LoRA (wait_x), its primary may be x's producer: each lane
// prefetches its first chunks' codes into L2, then waits before reading x or writing y (whose memory
// the primary may still use).
#include <cuda_runtime.h>

#include <type_traits>

#include "nvfp4_gemv.cuh"

namespace qg {

__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2::evict_normal [%0];" ::"l"(p));
}

__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

template <bool BF16>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (BF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// One chunk: 8 MMA steps over the lane's 32 k of rows g, g+8 (and x rows g, g+8 when MT == 2).
template <bool BF16, int MT, bool REPACKED>
__device__ __forceinline__ void chunk_mma(float (&acc)[MT][4], const RowChunk& r0, const RowChunk& r1,
                                          const uint4 (&x0)[4], const uint4 (&x1)[4]) {
  uint32_t s0[2], s1[2];
  scale_pair<BF16>(r0.s, s0[0], s0[1]);
  scale_pair<BF16>(r1.s, s1[0], s1[1]);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    uint32_t a[4], b0, b1;
    a_fragment<BF16, REPACKED>(r0, r1, s0, s1, j, a);
    b_fragment(x0, j, b0, b1);
    mma16816<BF16>(acc[0], a, b0, b1);
    if constexpr (MT == 2) {
      b_fragment(x1, j, b0, b1);
      mma16816<BF16>(acc[MT - 1], a, b0, b1);
    }
  }
}

// Chunk c's x. FULL: a whole chunk inside K. Else each chunk is whole (c < nfull: no checks; x rows past M
// read row 0, whose MMA columns are never stored), the partial last one (groups past K read zero, x
// past K or M reads zero) or past K (skipped).
template <bool MT2, bool FULL>
__device__ __forceinline__ void load_x(uint4 (&x0)[4], uint4 (&x1)[4], const Lane& l, int c, int nfull, int K) {
  if (FULL || c < nfull) {
    load_x_chunk<true>(x0, l.xp0, c, l.t, K, l.xok0);
    if constexpr (MT2) load_x_chunk<true>(x1, l.xp1, c, l.t, K, l.xok1);
  } else {
    load_x_chunk<false>(x0, l.xp0, c, l.t, K, l.xok0);
    if constexpr (MT2) load_x_chunk<false>(x1, l.xp1, c, l.t, K, l.xok1);
  }
}

// Chunk c's codes and scales of rows g and g + 8. FULL: c lies inside K (no checks); else nothing is
// loaded past K (the slot keeps stale data that is never used, since the loops stop at nc).
template <bool ALIGNED, bool FULL = false>
__device__ __forceinline__ void load_rows(RowChunk& a, RowChunk& b, const Lane& l, int c, int nc, int nfull,
                                          int groups) {
  if (FULL || c < nfull) {
    load_row_chunk<ALIGNED, true>(a, l.cp0, l.sp0, c, groups, l.t);
    load_row_chunk<ALIGNED, true>(b, l.cp1, l.sp1, c, groups, l.t);
  } else if (c < nc) {
    load_row_chunk<ALIGNED, false>(a, l.cp0, l.sp0, c, groups, l.t);
    load_row_chunk<ALIGNED, false>(b, l.cp1, l.sp1, c, groups, l.t);
  }
}

// H chunks c = cb, cb + step, ...: their codes and scales (`load_set`), then their MMAs (`compute_set`: x of a
// set's first chunk at its start, then one chunk ahead). FULL: the set's chunks all lie inside K (no checks).
template <bool ALIGNED, bool FULL, int H>
__device__ __forceinline__ void load_set(RowChunk (&ra)[H], RowChunk (&rb)[H], const Lane& l, int cb, int step,
                                         int nc, int nfull, int groups) {
#pragma unroll
  for (int h = 0; h < H; ++h) load_rows<ALIGNED, FULL>(ra[h], rb[h], l, cb + h * step, nc, nfull, groups);
}

template <bool BF16, int MT, bool REPACKED, bool FULL, int H>
__device__ __forceinline__ void compute_set(float (&acc)[MT][4], const RowChunk (&ra)[H], const RowChunk (&rb)[H],
                                            const Lane& l, int cb, int step, int nc, int nfull, int K) {
  uint4 xa[2][4], xb[2][4];
  load_x<MT == 2, FULL>(xa[0], xb[0], l, cb, nfull, K);
#pragma unroll
  for (int h = 0; h < H; ++h) {
    const int c = cb + h * step;
    if (!FULL && c >= nc) break;
    if (h + 1 < H && (FULL || c + step < nc)) {  // x of the next chunk while this one computes
      load_x<MT == 2, FULL>(xa[(h + 1) & 1], xb[(h + 1) & 1], l, c + step, nfull, K);
    }
    chunk_mma<BF16, MT, REPACKED>(acc, ra[h], rb[h], xa[h & 1], xb[h & 1]);
  }
}

// A round of the default loop: U chunks' loads, then their MMAs.
template <bool BF16, int MT, bool ALIGNED, bool REPACKED, bool FULL, int U>
__device__ __forceinline__ void iteration(float (&acc)[MT][4], const Lane& l, int cb, int step, int nc, int nfull,
                                          int groups, int K) {
  RowChunk ra[U], rb[U];
  load_set<ALIGNED, FULL, U>(ra, rb, l, cb, step, nc, nfull, groups);
  compute_set<BF16, MT, REPACKED, FULL, U>(acc, ra, rb, l, cb, step, nc, nfull, K);
}

// The ring (config `ring`): U slots of chunks in flight all the time. `iteration` issues a round's U loads,
// then computes them, so every round waits one whole memory latency with nothing of its own to issue (the
// profile's long_sb stalls on the first decode instruction of a round, docs/gpu.md session 20). Here slot u
// is refilled with chunk c + U * step as soon as chunk c is computed, so a load has U - 1 chunks of the
// warp's own arithmetic to hide behind. Same chunk order, so the same sums bit for bit at the same WK.
// Measured slower (H100, q|k|v +5 %, o +16 %, at the same occupancy; docs/gpu.md session 20): its
// per-chunk branches cost more than the latency it hides, and it takes 118 registers, not 103. Off by default.
template <bool BF16, int MT, bool ALIGNED, bool REPACKED, int U>
__device__ __forceinline__ void ring_loop(float (&acc)[MT][4], const Lane& l, int step, int nc, int nfull,
                                          int groups, int K) {
  RowChunk ra[U], rb[U];
#pragma unroll
  for (int u = 0; u < U; ++u) load_rows<ALIGNED>(ra[u], rb[u], l, l.wk + u * step, nc, nfull, groups);
  uint4 xa[2][4], xb[2][4];
  load_x<MT == 2, false>(xa[0], xb[0], l, l.wk, nfull, K);
  for (int cb = l.wk; cb < nc; cb += U * step) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = cb + u * step;
      if (c >= nc) break;
      if (c + step < nc) load_x<MT == 2, false>(xa[(u + 1) & 1], xb[(u + 1) & 1], l, c + step, nfull, K);
      chunk_mma<BF16, MT, REPACKED>(acc, ra[u], rb[u], xa[u & 1], xb[u & 1]);
      load_rows<ALIGNED>(ra[u], rb[u], l, c + U * step, nc, nfull, groups);
    }
  }
}

// The pipe (config `loop: pipe` or `pipe2`): two sets of H chunks' codes in registers, A and B. A's chunks
// compute while B's loads are in flight, then B's while A's next loads are: every load has a whole set of
// the warp's own arithmetic in front of it, and the checks are made once per set (a set wholly inside K
// takes the unchecked path), not per chunk as in the ring. H = U / 2 (`pipe`) keeps the rounds' count of
// code registers; H = U (`pipe2`) holds two rounds' codes (160-171 registers, so at most kMaxWarpsPipe2
// warps a block). Same chunk order, so the same sums bit for bit at the same WK; x as in a round
// (`compute_set`). Measured slower (H100, all linears at 1 row: pipe +9.2 %, pipe2 +13.8 %; at the same WK
// pipe loses 8-9 % on DRAM-resident weights but not on L2-resident ones, so fewer bytes in flight per warp
// is the likely cost; docs/gpu.md session 26). Off by default.
template <bool BF16, int MT, bool ALIGNED, bool REPACKED, int H>
__device__ __forceinline__ void pipe_loop(float (&acc)[MT][4], const Lane& l, int step, int nc, int nfull,
                                          int groups, int K) {
  RowChunk ra[H], rb[H], sa[H], sb[H];  // set A, set B
  const int span = H * step, last = (H - 1) * step;
  if (l.wk + last < nfull) load_set<ALIGNED, true, H>(ra, rb, l, l.wk, step, nc, nfull, groups);
  else load_set<ALIGNED, false, H>(ra, rb, l, l.wk, step, nc, nfull, groups);
  for (int cb = l.wk; cb < nc; cb += 2 * span) {
    const int cs = cb + span, cn = cb + 2 * span;
    if (cs + last < nfull) load_set<ALIGNED, true, H>(sa, sb, l, cs, step, nc, nfull, groups);
    else load_set<ALIGNED, false, H>(sa, sb, l, cs, step, nc, nfull, groups);
    if (cb + last < nfull) compute_set<BF16, MT, REPACKED, true, H>(acc, ra, rb, l, cb, step, nc, nfull, K);
    else compute_set<BF16, MT, REPACKED, false, H>(acc, ra, rb, l, cb, step, nc, nfull, K);
    if (cs >= nc) break;
    if (cn + last < nfull) load_set<ALIGNED, true, H>(ra, rb, l, cn, step, nc, nfull, groups);
    else load_set<ALIGNED, false, H>(ra, rb, l, cn, step, nc, nfull, groups);
    if (cs + last < nfull) compute_set<BF16, MT, REPACKED, true, H>(acc, sa, sb, l, cs, step, nc, nfull, K);
    else compute_set<BF16, MT, REPACKED, false, H>(acc, sa, sb, l, cs, step, nc, nfull, K);
  }
}

// LOOP: kRounds (`iteration` round by round), kRing, kPipe (sets of U / 2) or kPipe2 (sets of U).
template <bool BF16, int MT, bool ALIGNED, bool REPACKED, int LOOP>
__global__ void __launch_bounds__(LOOP == kPipe2 ? kMaxWarpsPipe2 * 32 : kMaxWarps * 32) gemv_kernel(const Params p) {
  using T = std::conditional_t<BF16, __nv_bfloat16, __half>;
  extern __shared__ float red[];  // [warp][MT][4 registers][32 lanes], then LoRA t [M][t_stride]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  griddep_launch_dependents();
  const Lane l = lane_setup(p, blockIdx.x, warp, lane, MT);
  const int nc = (p.K + kChunkK - 1) / kChunkK, nfull = p.K / kChunkK, groups = p.K >> 4;

  float acc[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.0f;

  constexpr int U = MT == 1 ? kUnroll : kUnroll / 2;  // registers: 16 rows' codes x U chunks in flight
  if (p.wait_x) {  // PDL without LoRA: pull the first chunks into L2 (no registers), then wait for x
    for (int u = 0; u < U; ++u) {
      const int c = l.wk + u * p.wk;
      if (c < nc) {
        prefetch_l2(l.cp0 + 64 * static_cast<int64_t>(c));
        prefetch_l2(l.cp1 + 64 * static_cast<int64_t>(c));
      }
    }
    griddep_wait();
  }
  if constexpr (LOOP == kRing) {
    ring_loop<BF16, MT, ALIGNED, REPACKED, U>(acc, l, p.wk, nc, nfull, groups, p.K);
  } else if constexpr (LOOP == kPipe) {
    pipe_loop<BF16, MT, ALIGNED, REPACKED, U / 2>(acc, l, p.wk, nc, nfull, groups, p.K);
  } else if constexpr (LOOP == kPipe2) {
    pipe_loop<BF16, MT, ALIGNED, REPACKED, U>(acc, l, p.wk, nc, nfull, groups, p.K);
  } else {
    for (int cb = l.wk; cb < nc; cb += p.wk * U) {
      if (cb + (U - 1) * p.wk < nfull) {
        iteration<BF16, MT, ALIGNED, REPACKED, true, U>(acc, l, cb, p.wk, nc, nfull, groups, p.K);
      } else {
        iteration<BF16, MT, ALIGNED, REPACKED, false, U>(acc, l, cb, p.wk, nc, nfull, groups, p.K);
      }
    }
  }

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) red[((warp * MT + mt) * 4 + i) * 32 + lane] = acc[mt][i];
  float* tsum = red + 32 * 4 * MT * (blockDim.x >> 5);
  if (p.t != nullptr) {  // the shrink's partials, summed in a fixed order
    griddep_wait();  // the LoRA shrink (a PDL primary) has finished and is visible
    const int n_t = p.M * p.t_stride;
    for (int i = threadIdx.x; i < n_t; i += blockDim.x) {
      float v = 0.0f;
      for (int kb = 0; kb < p.ks; ++kb) v += p.t[kb * n_t + i];
      tsum[i] = v;
    }
  }
  __syncthreads();

  const int rows_blk = p.wr * 16;
  T* y = static_cast<T*>(p.y);
  for (int o = threadIdx.x; o < rows_blk * p.M; o += blockDim.x) {
    const int m = o / rows_blk, rl = o - m * rows_blk;
    const int row = blockIdx.x * rows_blk + rl;
    if (row >= p.N) continue;
    int mt, ln, reg;
    c_slot(rl & 15, m, mt, ln, reg);
    const int w0 = (rl >> 4) * p.wk;
    float s = 0.0f;
    for (int k = 0; k < p.wk; ++k) s += red[(((w0 + k) * MT + mt) * 4 + reg) * 32 + ln];  // fixed order
    const float v = epilogue(p, s, row, m, BF16, tsum);
    if constexpr (BF16) y[m * p.y_stride + row] = __float2bfloat16_rn(v);
    else y[m * p.y_stride + row] = __float2half_rn(v);
  }
}

// t[kb, m, s * rank + j] = scale * (index[m] == slot) * x[m, K slice kb] . A_s[j, K slice kb]: one block of
// 256 threads per (s * rank + j, kb), 8 k per thread and step (16-byte loads of A and of every x row, four
// steps' loads in flight), float32, a fixed-order reduction.
template <bool BF16, int MAXM>
__global__ void __launch_bounds__(256) lora_shrink_kernel(const ShrinkParams p) {
  using T = std::conditional_t<BF16, __nv_bfloat16, __half>;
  griddep_launch_dependents();  // the GEMV may start streaming its weights now
  __shared__ float red[MAXM][8];
  const int s = blockIdx.x / p.rank, j = blockIdx.x - s * p.rank;
  const int k8_0 = blockIdx.y * (p.kslice / 8), k8_1 = min(p.K, (blockIdx.y + 1) * p.kslice) / 8;
  const T* a = static_cast<const T*>(s == 0 ? p.a0 : (s == 1 ? p.a1 : p.a2)) +
               j * (s == 0 ? p.sa0 : (s == 1 ? p.sa1 : p.sa2));
  const T* x = static_cast<const T*>(p.x);
  float acc[MAXM];
#pragma unroll
  for (int m = 0; m < MAXM; ++m) acc[m] = 0.0f;
  constexpr int V = 4;  // steps whose A loads are in flight together
  for (int k80 = k8_0 + threadIdx.x; k80 < k8_1; k80 += V * blockDim.x) {
    uint4 av[V];
#pragma unroll
    for (int v = 0; v < V; ++v) {
      const int k8 = k80 + v * blockDim.x;
      av[v] = k8 < k8_1 ? __ldg(reinterpret_cast<const uint4*>(a + 8 * k8)) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int m = 0; m < MAXM; ++m) {
      if (m < p.M) {
        uint4 xv[V];
#pragma unroll
        for (int v = 0; v < V; ++v) {
          const int k8 = k80 + v * blockDim.x;
          xv[v] = k8 < k8_1 ? __ldg(reinterpret_cast<const uint4*>(x + m * p.x_stride + 8 * k8))
                            : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int v = 0; v < V; ++v) {
          const uint32_t aw[4] = {av[v].x, av[v].y, av[v].z, av[v].w};
          const uint32_t xw[4] = {xv[v].x, xv[v].y, xv[v].z, xv[v].w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            acc[m] = fmaf(bits_to_float(static_cast<uint16_t>(aw[i]), BF16),
                          bits_to_float(static_cast<uint16_t>(xw[i]), BF16), acc[m]);
            acc[m] = fmaf(bits_to_float(static_cast<uint16_t>(aw[i] >> 16), BF16),
                          bits_to_float(static_cast<uint16_t>(xw[i] >> 16), BF16), acc[m]);
          }
        }
      }
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int m = 0; m < MAXM; ++m) {
    float v = acc[m];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0) red[m][warp] = v;
  }
  __syncthreads();
  if (threadIdx.x < p.M) {
    const int m = threadIdx.x;
    float v = 0.0f;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) v += red[m][w];
    bool on = true;
    if (p.index_kind == 1) on = static_cast<const int32_t*>(p.index)[m] == p.slot;
    else if (p.index_kind == 2) on = static_cast<const int64_t*>(p.index)[m] == static_cast<int64_t>(p.slot);
    p.t[(blockIdx.y * p.M + m) * p.t_stride + blockIdx.x] = on ? v * p.scale : 0.0f;
  }
}

// ------------------------------------------------------------------------------------------ host

template <typename K, typename P>
static int launch(K kernel, const P& p, dim3 grid, dim3 block, size_t smem, bool pdl, void* stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, p);
  return err == cudaSuccess ? static_cast<int>(cudaGetLastError()) : static_cast<int>(err);
}

template <bool BF16, int MT, bool ALIGNED, bool REPACKED, int LOOP>
static int launch_t(const Params& p, bool pdl, void* stream) {
  const int warps = p.wr * p.wk;
  const int tiles = (p.N + 15) / 16;
  const dim3 grid((tiles + p.wr - 1) / p.wr), block(32 * warps);
  const size_t smem = sizeof(float) * (warps * MT * 4 * 32 + (p.t != nullptr ? p.M * p.t_stride : 0));
  return launch(gemv_kernel<BF16, MT, ALIGNED, REPACKED, LOOP>, p, grid, block, smem, pdl, stream);
}

int launch_gemv(const Params& p, bool bf16, bool aligned, bool pdl, void* stream) {
  if (p.M < 1 || p.M > 16 || p.wr < 1 || p.wk < 1 || p.wr * p.wk > kMaxWarps || p.K % 16 || p.loop < kRounds ||
      p.loop > kPipe2 || (p.repacked && p.loop == kPipe2 && p.wr * p.wk > kMaxWarpsPipe2) ||
      (p.t != nullptr && (p.rank < 1 || p.rank > kMaxRank || p.ks < 1))) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const bool two = p.M > 8;
#define QG_CASE(B, MT_, A)                                                                                   \
  if (bf16 == B && (MT_ == 2) == two && aligned == A) {                                                      \
    if (!p.repacked) return launch_t<B, MT_, A, false, kRounds>(p, pdl, stream);                             \
    switch (p.loop) {                                                                                        \
      case kRing: return launch_t<B, MT_, A, true, kRing>(p, pdl, stream);                                   \
      case kPipe: return launch_t<B, MT_, A, true, kPipe>(p, pdl, stream);                                   \
      case kPipe2: return launch_t<B, MT_, A, true, kPipe2>(p, pdl, stream);                                 \
      default: return launch_t<B, MT_, A, true, kRounds>(p, pdl, stream);                                    \
    }                                                                                                        \
  }
  QG_CASE(true, 1, true) QG_CASE(true, 1, false) QG_CASE(true, 2, true) QG_CASE(true, 2, false)
  QG_CASE(false, 1, true) QG_CASE(false, 1, false) QG_CASE(false, 2, true) QG_CASE(false, 2, false)
#undef QG_CASE
  return static_cast<int>(cudaErrorInvalidValue);
}

int launch_lora_shrink(const ShrinkParams& p, bool bf16, int slices, void* stream) {
  if (p.M < 1 || p.M > 16 || slices < 1 || slices > kMaxSlices || p.rank < 1 || p.rank > kMaxRank || p.K % 8 ||
      p.kslice < 8 || p.kslice % 8) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const dim3 grid(slices * p.rank, (p.K + p.kslice - 1) / p.kslice), block(256);
  if (bf16) {
    return p.M > 8 ? launch(lora_shrink_kernel<true, 16>, p, grid, block, 0, false, stream)
                   : launch(lora_shrink_kernel<true, 8>, p, grid, block, 0, false, stream);
  }
  return p.M > 8 ? launch(lora_shrink_kernel<false, 16>, p, grid, block, 0, false, stream)
                 : launch(lora_shrink_kernel<false, 8>, p, grid, block, 0, false, stream);
}

int gemv_kernel_regs(bool bf16, int mt, bool aligned, bool repacked, int loop) {
  cudaFuncAttributes a;
  cudaError_t err = cudaErrorInvalidValue;
#define QG_CASE(B, MT_, A)                                                                                   \
  if (bf16 == B && mt == MT_ && aligned == A) {                                                              \
    if (!repacked) err = cudaFuncGetAttributes(&a, gemv_kernel<B, MT_, A, false, kRounds>);                  \
    else if (loop == kRing) err = cudaFuncGetAttributes(&a, gemv_kernel<B, MT_, A, true, kRing>);            \
    else if (loop == kPipe) err = cudaFuncGetAttributes(&a, gemv_kernel<B, MT_, A, true, kPipe>);            \
    else if (loop == kPipe2) err = cudaFuncGetAttributes(&a, gemv_kernel<B, MT_, A, true, kPipe2>);          \
    else err = cudaFuncGetAttributes(&a, gemv_kernel<B, MT_, A, true, kRounds>);                             \
  }
  QG_CASE(true, 1, true) QG_CASE(true, 1, false) QG_CASE(true, 2, true) QG_CASE(true, 2, false)
  QG_CASE(false, 1, true) QG_CASE(false, 1, false) QG_CASE(false, 2, true) QG_CASE(false, 2, false)
#undef QG_CASE
  return err == cudaSuccess ? a.numRegs : -1;
}

}  // namespace qg
