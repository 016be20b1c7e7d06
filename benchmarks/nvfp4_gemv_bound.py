#!/usr/bin/env python3
"""Where the CUDA decode GEMM's time goes at 1 row: its memory side and its arithmetic side, timed apart.

For each Qwen2.5-7B linear group (the shapes of `benchmarks/nvfp4_gemv.py`, 28 layers of distinct
weights, replayed from one CUDA graph, as there), in ms per decode step:

- `gemv`: the kernel as the engine runs it (`plan`'s configuration).
- `read_pattern`: a kernel that reads exactly the GEMV's bytes in the GEMV's order (a block per 16-row
  tile, WK warps, lane (g, t) reads rows g and g + 8: 16 bytes of codes at 64 c + 16 t and 2 bytes of
  scales per chunk c, U chunks in flight) and only XORs them: the memory side of the GEMV, without
  its arithmetic. A hand copy of csrc/nvfp4_gemv.cu's loop of rounds (U = 4): it must follow that
  loop when the loop changes.
- `read_contiguous`: the same bytes read in address order (16 bytes per thread, grid-stride): what
  the memory system gives a plain stream of that size.
- `gemv_l2_resident`: the GEMV on weights whose rows are all the same row (a stride-0 view of one row,
  so its few KB stay in L2): every instruction of the real call, almost no DRAM traffic: the
  arithmetic side.
- `gemv_repacked` / `gemv_repacked_l2_resident`: the same two on the codes in the kernel's repacked
  layout (`repack_codes`, config `repacked`), which halves the decode's integer instructions.
- `gemv_ring` / `gemv_ring_l2_resident`: the repacked kernel with config `ring`: U chunks' loads in
  flight all the time (a slot is refilled as soon as its chunk is computed) instead of round by round.
  Checked bit-equal to `gemv_repacked` first.
- `gemv_pipe` / `gemv_pipe2` (and `_l2_resident`): the repacked kernel with config `loop` "pipe" / "pipe2":
  two sets of U / 2 (U) chunks' codes in registers, one set computing while the other's loads are in
  flight, the bounds checks made per set (csrc/nvfp4_gemv.cu `pipe_loop`). Checked bit-equal to
  `gemv_repacked` first, at the repacked plan's WK.

If `gemv` sits near `gemv_l2_resident`, the kernel is bound by its instructions; near `read_pattern`,
by its access pattern; `read_contiguous` is the bound any layout could reach. Shares of the
weight-read bound use the copy bandwidth, as in nvfp4_gemv.py.

    python benchmarks/nvfp4_gemv_bound.py --out benchmarks/results/nvfp4_gemv_bound.json

`--arms gemv_repacked,gemv_pipe` times only the arms named (`ARMS`; the bit-equality checks still run).

`--once` runs each group's GEMV once per layer without a graph and exits (for a profiler, e.g.
`ncu -k regex:gemv_kernel python benchmarks/nvfp4_gemv_bound.py --once`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.decode_gemm_profile import GLOBAL_SCALE, SHAPE, copy_bandwidth  # noqa: E402
from benchmarks.nvfp4_gemv import GROUPS, graph_ms  # noqa: E402
from qerl_lib.io import atomic_write_json  # noqa: E402

CUDA_SRC = r"""
#include <cstdint>
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

__device__ __forceinline__ uint4 ld16(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t ld2(const uint8_t* p) {
  uint16_t v;
  asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}

// The GEMV's reads (nvfp4_gemv.cu: rounds of U chunks per warp, chunks c = wk, wk + WK, ...), XORed.
template <int U>
__global__ void read_pattern(const uint8_t* codes, const uint8_t* scales, int K, int wk, uint32_t* sink) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int64_t row0 = blockIdx.x * 16 + g, row1 = row0 + 8;
  const uint8_t* c0 = codes + row0 * (K / 2) + 16 * t;
  const uint8_t* c1 = codes + row1 * (K / 2) + 16 * t;
  const uint8_t* s0 = scales + row0 * (K / 16) + 2 * t;
  const uint8_t* s1 = scales + row1 * (K / 16) + 2 * t;
  const int nc = K / 128;
  uint32_t acc = 0;
  for (int cb = warp; cb < nc; cb += wk * U) {
    uint4 a[U], b[U];
    uint32_t sa[U], sb[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = cb + u * wk;
      if (c < nc) {
        a[u] = ld16(c0 + 64 * static_cast<int64_t>(c));
        b[u] = ld16(c1 + 64 * static_cast<int64_t>(c));
        sa[u] = ld2(s0 + 8 * c);
        sb[u] = ld2(s1 + 8 * c);
      } else {
        a[u] = b[u] = make_uint4(0, 0, 0, 0);
        sa[u] = sb[u] = 0;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= a[u].x ^ a[u].y ^ a[u].z ^ a[u].w ^ b[u].x ^ b[u].y ^ b[u].z ^ b[u].w ^ sa[u] ^ sb[u];
  }
  if (acc == 0x9E3779B9u) sink[blockIdx.x] = acc;  // never in practice; keeps the loads
}

// The same bytes in address order: 16 bytes per thread and step, 4 steps in flight.
__global__ void read_contiguous(const uint8_t* a, int64_t na, const uint8_t* b, int64_t nb, uint32_t* sink) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * 16;
  uint32_t acc = 0;
  for (int part = 0; part < 2; ++part) {
    const uint8_t* p = part == 0 ? a : b;
    const int64_t n = part == 0 ? na : nb;
    for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 16; i < n; i += 4 * stride) {
      uint4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = i + u * stride < n ? ld16(p + i + u * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
  }
  if (acc == 0x9E3779B9u) sink[blockIdx.x] = acc;
}

void pattern(torch::Tensor codes, torch::Tensor scales, int64_t wk, torch::Tensor sink) {
  const int N = codes.size(0), K = codes.size(1) * 2;
  auto stream = c10::cuda::getCurrentCUDAStream();
  read_pattern<4><<<N / 16, 32 * wk, 0, stream>>>(codes.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), K, wk,
                                                  reinterpret_cast<uint32_t*>(sink.data_ptr<int32_t>()));
}

void contiguous(torch::Tensor codes, torch::Tensor scales, int64_t blocks, torch::Tensor sink) {
  auto stream = c10::cuda::getCurrentCUDAStream();
  read_contiguous<<<blocks, 256, 0, stream>>>(codes.data_ptr<uint8_t>(), codes.numel(), scales.data_ptr<uint8_t>(),
                                              scales.numel(), reinterpret_cast<uint32_t*>(sink.data_ptr<int32_t>()));
}
"""
CPP_SRC = """
void pattern(torch::Tensor codes, torch::Tensor scales, int64_t wk, torch::Tensor sink);
void contiguous(torch::Tensor codes, torch::Tensor scales, int64_t blocks, torch::Tensor sink);
"""


RING = {"repacked": True, "ring": True}
LOOPS = {"ring": RING, "pipe": {"repacked": True, "loop": "pipe"}, "pipe2": {"repacked": True, "loop": "pipe2"}}
ARMS = ("gemv", "read_pattern", "read_contiguous", "gemv_l2_resident", "gemv_repacked", "gemv_repacked_l2_resident",
        *(f"gemv_{loop}{tail}" for loop in LOOPS for tail in ("", "_l2_resident")))
"""Every arm, in the order timed (module docstring)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/nvfp4_gemv_bound.json"))
    ap.add_argument("--layers", type=int, default=SHAPE["layers"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--once", action="store_true", help="one eager GEMV per layer and group, then exit (profilers)")
    ap.add_argument("--groups", default=",".join(GROUPS), help="with --once: the groups to run")
    ap.add_argument("--config", default="{}", help="with --once: the GEMV's config as JSON, e.g. '{\"WK\": 2}'")
    ap.add_argument("--arms", default="", help="comma-separated arms to time (default: all; module docstring)")
    args = ap.parse_args()
    chosen = [a for a in args.arms.split(",") if a] or list(ARMS)
    unknown = sorted(set(chosen) - set(ARMS))
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; known: {', '.join(ARMS)}")

    import torch
    from torch.utils.cpp_extension import load_inline

    from qerl_lib.kernels import nvfp4_gemv_cuda as C

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/nvfp4_gemv_bound.py needs a CUDA GPU")
    t_start = time.perf_counter()
    gen = torch.Generator(device="cuda").manual_seed(0)
    gs = torch.tensor([GLOBAL_SCALE], device="cuda")
    layers = {}
    for g, (n, k, _) in GROUPS.items():
        layers[g] = [(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen),
                      (torch.rand((n, k // 16), device="cuda", generator=gen) + 0.5).to(torch.float8_e4m3fn))
                     for _ in range(args.layers)]
    xs = {g: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for g, (n, k, _) in GROUPS.items()}
    if args.once:
        config = json.loads(args.config) or None
        for g in args.groups.split(","):
            for p, s in layers[g]:
                C.nvfp4_gemv(xs[g], C.repack_codes(p) if (config or {}).get("repacked") else p, s, gs, config=config)
        torch.cuda.synchronize()
        return

    t0 = time.perf_counter()
    ext = load_inline("qerl_gemv_bound", CPP_SRC, cuda_sources=CUDA_SRC, functions=["pattern", "contiguous"],
                      extra_cuda_cflags=["-O3", "-std=c++17"], verbose=False)
    C.load_extension()
    build_s = round(time.perf_counter() - t0, 1)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sink = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    bw = copy_bandwidth()
    res = {"command": "python " + " ".join(sys.argv), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "layers": args.layers,
           "build_s": build_s, "copy_bandwidth": bw, "groups": {}}
    totals: dict[str, float] = {}
    step_bytes = 0
    for g, (n, k, _) in GROUPS.items():
        assert n % 16 == 0 and k % 128 == 0, f"{g}: read_pattern covers whole 16-row tiles and 128-k chunks"
        ls, x = layers[g], xs[g]
        plan = C.plan(1, n, k, sms, C.kernel_regs(True, 1, True))
        wk = plan["WK"]
        one = [(p[:1].expand(n, k // 2), s[:1].expand(n, k // 16)) for p, s in ls]
        ls_r = [(C.repack_codes(p), s) for p, s in ls]
        one_r = [(p[:1].expand(n, k // 2), s[:1].expand(n, k // 16)) for p, s in ls_r]
        arms = {
            "gemv": lambda: [C.nvfp4_gemv(x, p, s, gs) for p, s in ls],
            "read_pattern": lambda: [ext.pattern(p, s.view(torch.uint8), wk, sink) for p, s in ls],
            "read_contiguous": lambda: [ext.contiguous(p, s.view(torch.uint8), sms * 8, sink) for p, s in ls],
            "gemv_l2_resident": lambda: [C.nvfp4_gemv(x, p, s, gs) for p, s in one],
            "gemv_repacked": lambda: [C.nvfp4_gemv(x, p, s, gs, config={"repacked": True}) for p, s in ls_r],
            "gemv_repacked_l2_resident": lambda: [C.nvfp4_gemv(x, p, s, gs, config={"repacked": True})
                                                  for p, s in one_r],
        }
        for loop, cfg in LOOPS.items():  # default arguments bind this iteration's config
            arms[f"gemv_{loop}"] = lambda cfg=cfg: [C.nvfp4_gemv(x, p, s, gs, config=cfg) for p, s in ls_r]
            arms[f"gemv_{loop}_l2_resident"] = lambda cfg=cfg: [C.nvfp4_gemv(x, p, s, gs, config=cfg) for p, s in one_r]
        assert list(arms) == list(ARMS), "ARMS must name every arm, in order"
        arms = {a: f for a, f in arms.items() if a in chosen}
        # at one WK every loop computes the same chunks in the same order: the same bits (its own plan may pick
        # another WK, its registers being more: gate|up WK 8 against 2 at 118 / 103 registers, another sum order)
        pin = {"WR": 1, "WK": C.plan(1, n, k, sms, C.kernel_regs(True, 1, True, True))["WK"]}
        for loop, cfg in LOOPS.items():
            wk_pin = min(pin["WK"], C.loop_max_warps(loop))
            for p, s in ls_r[:2]:
                a = C.nvfp4_gemv(x, p, s, gs, config={"repacked": True, "WR": 1, "WK": wk_pin})
                b = C.nvfp4_gemv(x, p, s, gs, config={**cfg, "WR": 1, "WK": wk_pin})
                if not torch.equal(a, b):
                    raise SystemExit(f"{g}: {loop} and round-by-round differ by up to "
                                     f"{(a.float() - b.float()).abs().max()}")
        nbytes = args.layers * (n * k // 2 + n * k // 16)
        step_bytes += nbytes
        row = {"N": n, "K": k, "plan": f"WR{plan['WR']}xWK{wk}", "bytes_per_step": nbytes, "ms": {}, "share": {},
               "loop_plans": {loop: "WK%d" % C.plan(1, n, k, sms, C.kernel_regs(True, 1, True, True, loop),
                                                  C.loop_max_warps(loop))["WK"] for loop in LOOPS}}
        for name, fn in arms.items():
            ms = round(graph_ms(fn, args.reps), 4)
            row["ms"][name] = ms
            row["share"][name] = round(nbytes / bw["bytes_per_s"] * 1e3 / ms, 3)
            totals[name] = round(totals.get(name, 0.0) + ms, 4)
        res["groups"][g] = row
        print(f"{g:8s} " + "  ".join(f"{a} {v:.4f} ms ({row['share'][a]:.3f})" for a, v in row["ms"].items()), flush=True)
    res["bytes_per_step"] = step_bytes
    res["weight_read_bound_ms"] = round(step_bytes / bw["bytes_per_s"] * 1e3, 4)
    res["total_ms"] = totals
    res["total_share"] = {a: round(res["weight_read_bound_ms"] / v, 3) for a, v in totals.items()}
    res["seconds"] = round(time.perf_counter() - t_start, 1)
    atomic_write_json(args.out, res)
    print("total " + "  ".join(f"{a} {v:.4f} ms ({res['total_share'][a]:.3f})" for a, v in totals.items()))
    print(f"wrote {args.out} ({res['seconds']} s)")


if __name__ == "__main__":
    main()
