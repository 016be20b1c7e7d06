// CPU check of the NVFP4 decode GEMM's per-lane code (nvfp4_gemv.cuh), no GPU needed:
//   nvcc -std=c++17 -O1 -o /tmp/qg_host_test qerl_lib/kernels/csrc/nvfp4_gemv_host_test.cu && /tmp/qg_host_test
// (tests/test_nvfp4_gemv_cuda.py builds and runs it). Every case runs twice: codes in compressed-tensors'
// layout, then the same codes repacked (repack_word). It replays the kernel's loop (lane_setup, the
// FULL / tail iterations of U chunks, load_row_chunk, load_x_chunk, scale_pair, a_fragment,
// b_fragment), runs the MMA m16n8k16 from the PTX ISA's fragment layout, reduces the warps with
// c_slot in the kernel's order and applies `epilogue`; then compares with x @ W.T (+ bias + LoRA) in
// double from the float32 dequantization (qerl_lib.nvfp4.dequantize_nvfp4's arithmetic), within one
// output ulp + 2**-20 of sum |x||W| + 2**-16 of the LoRA term's absolute sum. Last line:
// "N passed, M failed".
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <random>
#include <vector>

#include "nvfp4_gemv.cuh"

using namespace qg;

namespace {

const float kE2M1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

float fp8_value(uint8_t b) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(b), __NV_E4M3);
  return bits_to_float(h.x, false);
}

struct Case {
  const char* name;
  int M, N, K;
  bool bf16;
  int wr, wk;
  int slices, rank;  // LoRA: slices 0 = none
  int bias_kind;     // 0 none, 1 float32, 2 x.dtype
  bool per_row_gs, misalign, index;
  int kind;          // 0 random codes/scales, 1 all max, 2 zeros (+-0), 3 subnormal scales
};

// C [16 x 8] += A [16 x 16] B [16 x 8] from the lanes' fragments (mma.m16n8k16 .row.col, f32 accumulate).
void mma_emul(float (&acc)[32][4], const uint32_t (&a)[32][4], const uint32_t (&b)[32][2], bool bf16) {
  float A[16][16], B[16][8], C[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    for (int h = 0; h < 2; ++h) {
      A[g][2 * t + h] = bits_to_float(static_cast<uint16_t>(a[lane][0] >> (16 * h)), bf16);
      A[g + 8][2 * t + h] = bits_to_float(static_cast<uint16_t>(a[lane][1] >> (16 * h)), bf16);
      A[g][2 * t + 8 + h] = bits_to_float(static_cast<uint16_t>(a[lane][2] >> (16 * h)), bf16);
      A[g + 8][2 * t + 8 + h] = bits_to_float(static_cast<uint16_t>(a[lane][3] >> (16 * h)), bf16);
      B[2 * t + h][g] = bits_to_float(static_cast<uint16_t>(b[lane][0] >> (16 * h)), bf16);
      B[2 * t + 8 + h][g] = bits_to_float(static_cast<uint16_t>(b[lane][1] >> (16 * h)), bf16);
    }
    C[g][2 * t] = acc[lane][0];
    C[g][2 * t + 1] = acc[lane][1];
    C[g + 8][2 * t] = acc[lane][2];
    C[g + 8][2 * t + 1] = acc[lane][3];
  }
  for (int r = 0; r < 16; ++r)
    for (int n = 0; n < 8; ++n)
      for (int k = 0; k < 16; ++k) C[r][n] += A[r][k] * B[k][n];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    acc[lane][0] = C[g][2 * t];
    acc[lane][1] = C[g][2 * t + 1];
    acc[lane][2] = C[g + 8][2 * t];
    acc[lane][3] = C[g + 8][2 * t + 1];
  }
}

// The kernel's main loop for one warp, lane by lane (chunks c < nfull take the unchecked loads, as in
// the kernel's FULL iterations and its whole chunks of the others) (the MMA gathers all 32 lanes' fragments).
template <bool ALIGNED, bool REPACKED>
void warp_emul(const Params& p, int block, int warp, int mt_count, bool bf16, float (&acc)[2][32][4]) {
  Lane l[32];
  for (int lane = 0; lane < 32; ++lane) l[lane] = lane_setup(p, block, warp, lane, mt_count);
  const int nc = (p.K + kChunkK - 1) / kChunkK, nfull = p.K / kChunkK, groups = p.K >> 4;
  const int U = mt_count == 1 ? kUnroll : kUnroll / 2;
  for (int cb = l[0].wk; cb < nc; cb += p.wk * U) {
    const bool full = cb + (U - 1) * p.wk < nfull;
    for (int u = 0; u < U; ++u) {
      const int c = cb + u * p.wk;
      if (!full && c >= nc) break;
      RowChunk r0[32], r1[32];
      uint4 x0[32][4], x1[32][4];
      uint32_t s0[32][2], s1[32][2];
      for (int lane = 0; lane < 32; ++lane) {
        const Lane& L = l[lane];
        if (full || c < nfull) {
          load_row_chunk<ALIGNED, true>(r0[lane], L.cp0, L.sp0, c, groups, L.t);
          load_row_chunk<ALIGNED, true>(r1[lane], L.cp1, L.sp1, c, groups, L.t);
          load_x_chunk<true>(x0[lane], L.xp0, c, L.t, p.K, L.xok0);
          load_x_chunk<true>(x1[lane], L.xp1, c, L.t, p.K, L.xok1);
        } else {
          load_row_chunk<ALIGNED, false>(r0[lane], L.cp0, L.sp0, c, groups, L.t);
          load_row_chunk<ALIGNED, false>(r1[lane], L.cp1, L.sp1, c, groups, L.t);
          load_x_chunk<false>(x0[lane], L.xp0, c, L.t, p.K, L.xok0);
          load_x_chunk<false>(x1[lane], L.xp1, c, L.t, p.K, L.xok1);
        }
        if (bf16) {
          scale_pair<true>(r0[lane].s, s0[lane][0], s0[lane][1]);
          scale_pair<true>(r1[lane].s, s1[lane][0], s1[lane][1]);
        } else {
          scale_pair<false>(r0[lane].s, s0[lane][0], s0[lane][1]);
          scale_pair<false>(r1[lane].s, s1[lane][0], s1[lane][1]);
        }
      }
      for (int j = 0; j < 8; ++j) {
        uint32_t a[32][4], b0[32][2], b1[32][2];
        for (int lane = 0; lane < 32; ++lane) {
          if (bf16) a_fragment<true, REPACKED>(r0[lane], r1[lane], s0[lane], s1[lane], j, a[lane]);
          else a_fragment<false, REPACKED>(r0[lane], r1[lane], s0[lane], s1[lane], j, a[lane]);
          b_fragment(x0[lane], j, b0[lane][0], b0[lane][1]);
          b_fragment(x1[lane], j, b1[lane][0], b1[lane][1]);
        }
        mma_emul(acc[0], a, b0, bf16);
        if (mt_count == 2) mma_emul(acc[1], a, b1, bf16);
      }
    }
  }
}

uint16_t to_bits(float f, bool bf16) { return float_to_bits(f, bf16); }

bool run_case(const Case& cs, std::mt19937& rng, int& checked, bool repacked) {
  const int M = cs.M, N = cs.N, K = cs.K;
  const bool bf16 = cs.bf16;
  std::uniform_int_distribution<int> byte(0, 255);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t cstride = K / 2 + (cs.misalign ? 8 : 0), sstride = K / 16 + (cs.misalign ? 1 : 0);
  std::vector<uint8_t> codes(N * cstride + 16), scales(N * sstride + 16);
  for (int r = 0; r < N; ++r) {
    for (int i = 0; i < K / 2; ++i) {
      uint8_t v = static_cast<uint8_t>(byte(rng));
      if (cs.kind == 1) v = r % 2 ? 0xFF : 0x77;
      if (cs.kind == 2) v = byte(rng) < 128 ? 0x00 : 0x88;
      codes[r * cstride + i] = v;
    }
    for (int i = 0; i < K / 16; ++i) {
      uint8_t v = static_cast<uint8_t>(byte(rng) % 0x7F);  // 0x7F is NaN
      if (cs.kind == 1) v = 0x7E;
      if (cs.kind == 3) v = static_cast<uint8_t>(1 + byte(rng) % 7);
      scales[r * sstride + i] = v;
    }
  }
  std::vector<float> gs(cs.per_row_gs ? N : 1);
  for (size_t r = 0; r < gs.size(); ++r) gs[r] = (cs.kind == 3 ? 1.0f / 256 : 3.0f) * (1.0f + r % 3);
  const int64_t xstride = K + 8 * (cs.misalign ? 3 : 0);
  std::vector<uint16_t> x(M * xstride, bf16 ? 0x7FC0 : 0x7E00);  // NaN in the row padding: never read
  std::vector<double> xd(M * K);
  for (int m = 0; m < M; ++m)
    for (int k = 0; k < K; ++k) {
      const uint16_t b = to_bits(normal(rng) * (cs.kind == 3 ? 4.0f : 1.0f), bf16);
      x[m * xstride + k] = b;
      xd[m * K + k] = bits_to_float(b, bf16);
    }
  std::vector<float> bias32(N);
  std::vector<uint16_t> bias16(N);
  for (int r = 0; r < N; ++r) {
    bias16[r] = to_bits(normal(rng), bf16);
    bias32[r] = bits_to_float(bias16[r], bf16);
  }
  // reference: W = e2m1 * float32(fp8 / gs), float32 product, then double sums
  std::vector<double> ref(M * N, 0.0), bound(M * N, 0.0), lbound(M * N, 0.0);
  for (int r = 0; r < N; ++r) {
    const float g = gs[cs.per_row_gs ? r : 0];
    for (int k = 0; k < K; ++k) {
      const uint8_t byte_ = codes[r * cstride + k / 2];
      const int code = k % 2 ? byte_ >> 4 : byte_ & 15;
      const float eff = fp8_value(scales[r * sstride + k / 16]) / g;
      const float w = (code & 8 ? -kE2M1[code & 7] : kE2M1[code & 7]) * eff;
      for (int m = 0; m < M; ++m) {
        ref[m * N + r] += xd[m * K + k] * w;
        bound[m * N + r] += std::fabs(xd[m * K + k] * w);
      }
    }
    if (cs.bias_kind)
      for (int m = 0; m < M; ++m) {
        ref[m * N + r] += bias32[r];
        bound[m * N + r] += std::fabs(bias32[r]);
      }
  }
  // LoRA: slices of widths ~ N / S, A [rank, K], B [n_i, rank], scale 0.75, per-row slots
  const int S = cs.slices, R = cs.rank;
  const float lscale = 0.75f;
  std::vector<std::vector<uint16_t>> A(S), B(S);
  std::vector<int> off(S + 1, 0);
  std::vector<int64_t> index(M + 3);
  for (auto& v : index) v = byte(rng) % 3 - 1;
  std::vector<float> tvec(M * S * R, 0.0f);
  for (int s = 0; s < S; ++s) off[s + 1] = s + 1 == S ? N : off[s] + (N / S) - 3 * s;
  for (int s = 0; s < S; ++s) {
    const int w = off[s + 1] - off[s];
    A[s].resize(R * K);
    B[s].resize(w * R);
    for (auto& v : A[s]) v = to_bits(normal(rng) * 0.1f, bf16);
    for (auto& v : B[s]) v = to_bits(normal(rng) * 0.1f, bf16);
    for (int m = 0; m < M; ++m) {
      const bool on = !cs.index || index[m] == 0;
      for (int j = 0; j < R; ++j) {
        double tj = 0.0, tabs = 0.0;
        for (int k = 0; k < K; ++k) {
          const double av = bits_to_float(A[s][j * K + k], bf16);
          tj += xd[m * K + k] * av;
          tabs += std::fabs(xd[m * K + k] * av);
        }
        tvec[m * S * R + s * R + j] = on ? static_cast<float>(tj) * lscale : 0.0f;
        for (int r = off[s]; r < off[s + 1]; ++r) {
          const double bv = bits_to_float(B[s][(r - off[s]) * R + j], bf16);
          if (on) ref[m * N + r] += tj * bv * lscale;
          lbound[m * N + r] += tabs * std::fabs(bv) * lscale;
        }
      }
    }
  }

  if (repacked) {  // each row's 4-byte words (the kernel reads whole words at 4-byte offsets of a row)
    for (int r = 0; r < N; ++r)
      for (int w = 0; w < K / 8; ++w) {
        uint8_t* c = codes.data() + r * cstride + 4 * w;
        uint32_t q;
        std::memcpy(&q, c, 4);
        q = repack_word(q);
        std::memcpy(c, &q, 4);
      }
  }
  Params p = {};
  p.repacked = repacked ? 1 : 0;
  p.codes = codes.data();
  p.scales = scales.data();
  p.gs = gs.data();
  p.gs_stride = cs.per_row_gs ? 1 : 0;
  p.bias_kind = cs.bias_kind == 0 ? 0 : (cs.bias_kind == 1 ? 1 : (bf16 ? 2 : 3));
  p.bias = cs.bias_kind == 1 ? static_cast<const void*>(bias32.data()) : static_cast<const void*>(bias16.data());
  p.x = x.data();
  p.code_stride = cstride;
  p.scale_stride = sstride;
  p.x_stride = xstride;
  p.M = M; p.N = N; p.K = K;
  p.wr = cs.wr; p.wk = cs.wk;
  p.off1 = p.off2 = N;
  if (S) {
    p.t = tvec.data();
    p.t_stride = S * R;
    p.ks = 1;
    p.rank = R;
    p.lb0 = B[0].data(); p.sb0 = R;
    p.lb1 = B[S > 1 ? 1 : 0].data(); p.sb1 = R;
    p.lb2 = B[S > 2 ? 2 : 0].data(); p.sb2 = R;
    if (S > 1) p.off1 = off[1];
    if (S > 2) p.off2 = off[2];
  }
  const bool aligned = !cs.misalign && K % 32 == 0;
  const int mt = M > 8 ? 2 : 1, warps = p.wr * p.wk, rows_blk = p.wr * 16;
  const int blocks = ((N + 15) / 16 + p.wr - 1) / p.wr;
  int bad = 0;
  double worst = 0.0;
  for (int blk = 0; blk < blocks; ++blk) {
    std::vector<float> red(warps * mt * 4 * 32);
    for (int w = 0; w < warps; ++w) {
      float acc[2][32][4] = {};
      if (aligned) {
        if (repacked) warp_emul<true, true>(p, blk, w, mt, bf16, acc);
        else warp_emul<true, false>(p, blk, w, mt, bf16, acc);
      } else {
        if (repacked) warp_emul<false, true>(p, blk, w, mt, bf16, acc);
        else warp_emul<false, false>(p, blk, w, mt, bf16, acc);
      }
      for (int q = 0; q < mt; ++q)
        for (int i = 0; i < 4; ++i)
          for (int lane = 0; lane < 32; ++lane) red[((w * mt + q) * 4 + i) * 32 + lane] = acc[q][lane][i];
    }
    for (int o = 0; o < rows_blk * M; ++o) {
      const int m = o / rows_blk, rl = o - m * rows_blk, row = blk * rows_blk + rl;
      if (row >= N) continue;
      int q, ln, reg;
      c_slot(rl & 15, m, q, ln, reg);
      const int w0 = (rl >> 4) * p.wk;
      float s = 0.0f;
      for (int k = 0; k < p.wk; ++k) s += red[(((w0 + k) * mt + q) * 4 + reg) * 32 + ln];
      const double y = bits_to_float(to_bits(epilogue(p, s, row, m, bf16, tvec.data()), bf16), bf16);
      const double rv = ref[m * N + row];
      const double mag = std::fmax(std::fabs(rv), std::ldexp(1.0, -120));
      const double ulp = std::ldexp(1.0, static_cast<int>(std::floor(std::log2(mag))) - (bf16 ? 7 : 10));
      const double tol = ulp + std::ldexp(bound[m * N + row], -20) + std::ldexp(lbound[m * N + row], -16) + 1e-30;
      const double err = std::fabs(y - rv);
      ++checked;
      worst = std::fmax(worst, err / tol);
      if (!(err <= tol)) {
        if (bad < 3) std::printf("  %s: m=%d row=%d got %.8g ref %.8g tol %.3g\n", cs.name, m, row, y, rv, tol);
        ++bad;
      }
    }
  }
  std::printf("%-28s %s M=%2d N=%4d K=%4d %s wr=%d wk=%2d lora=%d/%d bias=%d: %s (max err/tol %.3f)\n", cs.name,
              repacked ? "repacked" : "ct      ", M, N, K, bf16 ? "bf16" : "fp16", cs.wr, cs.wk, S, R, cs.bias_kind,
              bad ? "FAIL" : "ok", worst);
  return bad == 0;
}

}  // namespace

// `--check-repack FILE`: FILE holds little-endian uint32 pairs (word, its repacked form) written by
// qerl_lib.kernels.nvfp4_gemv_cuda.repack_codes; every pair must match repack_word, and the repacked
// decode of every pair must equal the compressed-tensors decode. Last line "N passed, M failed".
int check_repack(const char* path) {
  FILE* f = std::fopen(path, "rb");
  if (!f) {
    std::printf("cannot open %s\n0 passed, 1 failed\n", path);
    return 1;
  }
  uint32_t pair[2];
  long n = 0, bad = 0;
  while (std::fread(pair, 4, 2, f) == 2) {
    ++n;
    bool ok = repack_word(pair[0]) == pair[1];
    for (int i = 0; i < 4; ++i) {
      ok = ok && decode_pair_repacked<true>(pair[1], i) == decode_pair<true>(pair[0], pair[0] << 4, i);
      ok = ok && decode_pair_repacked<false>(pair[1], i) == decode_pair<false>(pair[0], pair[0] << 4, i);
    }
    if (!ok && bad++ < 3) std::printf("  word %08x: repacked %08x, repack_word %08x\n", pair[0], pair[1], repack_word(pair[0]));
  }
  std::fclose(f);
  std::printf("%ld words checked\n%ld passed, %ld failed\n", n, n - bad, bad);
  return bad || n == 0 ? 1 : 0;
}

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--check-repack") return check_repack(argv[2]);
  std::mt19937 rng(1234);
  std::vector<Case> cases;
  for (int m = 1; m <= 16; ++m) cases.push_back({"rows", m, 40, 512, true, 1, 2, 0, 0, 1, false, false, false, 0});
  cases.push_back({"plain_wk8", 3, 64, 1024, true, 1, 8, 0, 0, 0, false, false, false, 0});
  cases.push_back({"full_iterations_wk1", 1, 32, 1536, true, 1, 1, 0, 0, 1, false, false, false, 0});
  cases.push_back({"full_iterations_wk2_tail", 6, 40, 2128, true, 1, 2, 1, 16, 2, true, false, true, 0});
  cases.push_back({"full_iterations_m11", 11, 32, 1280, true, 1, 2, 0, 0, 0, false, false, false, 0});
  cases.push_back({"wk_more_than_chunks", 2, 32, 256, true, 1, 8, 0, 0, 0, false, false, false, 0});
  cases.push_back({"wr2_n_tail", 5, 70, 384, true, 2, 3, 0, 0, 2, true, false, false, 0});
  cases.push_back({"k_tail_80", 4, 24, 80, true, 1, 2, 1, 8, 1, false, false, false, 0});
  cases.push_back({"k_tail_400", 9, 48, 400, true, 1, 4, 0, 0, 0, false, false, false, 0});
  cases.push_back({"k_odd32_misaligned", 7, 33, 208, true, 1, 3, 0, 0, 1, false, true, false, 0});
  cases.push_back({"misaligned_rows", 12, 40, 512, true, 2, 2, 2, 4, 2, true, true, true, 0});
  cases.push_back({"max", 8, 32, 256, true, 1, 2, 0, 0, 0, false, false, false, 1});
  cases.push_back({"zero", 6, 32, 256, true, 1, 2, 0, 0, 0, false, false, false, 2});
  cases.push_back({"subnormal", 5, 32, 384, true, 1, 3, 0, 0, 0, false, false, false, 3});
  cases.push_back({"lora3_index", 8, 96, 512, true, 1, 4, 3, 16, 2, true, false, true, 0});
  cases.push_back({"lora1_m16", 16, 48, 640, true, 1, 2, 1, 16, 0, false, false, true, 0});
  cases.push_back({"fp16", 5, 48, 384, false, 1, 2, 2, 8, 2, false, false, true, 0});
  cases.push_back({"fp16_max_m13", 13, 32, 256, false, 2, 1, 0, 0, 1, false, false, false, 1});
  cases.push_back({"fp16_subnormal", 3, 32, 256, false, 1, 2, 0, 0, 0, true, false, false, 3});
  cases.push_back({"fp16_misaligned_tail", 10, 40, 336, false, 1, 3, 1, 4, 2, false, true, true, 0});
  int passed = 0, failed = 0, checked = 0;
  for (bool repacked : {false, true})  // the codes as compressed-tensors writes them, then repacked
    for (const auto& c : cases) (run_case(c, rng, checked, repacked) ? passed : failed)++;
  std::printf("%d outputs checked\n%d passed, %d failed\n", checked, passed, failed);
  return failed ? 1 : 0;
}
