#!/usr/bin/env python3
"""The NVFP4 decode GEMM (`qerl_lib.kernels.nvfp4_gemv`) against Marlin and cuBLAS, per decode step.

Shapes: the Qwen2.5-7B linears as vLLM fuses them (q|k|v 4608 x 3584, o 3584 x 3584, gate|up 37888 x
3584, down 3584 x 18944), 28 layers of distinct random weights each (so no layer's weights sit in L2
for the next), at 1, 2, 4, 8, 16, 32, 48 and 64 rows. Per group, the 28 calls are captured in one CUDA
graph and replayed (mean of `--reps` replays after a warm-up): the per-step figure `rollout_throughput`'s
`gemm_profile` reports for Marlin and cuBLAS.

Arms: `gemv` (the new kernel, `plan`'s configuration), `gemv_best` (the fastest of a small sweep of
configurations, per group and row count), `marlin` (vLLM's NVFP4 Marlin W4A16, when vLLM imports;
else `triton_fused`, the project's training-side fused kernel), `cublas` (BF16 `F.linear` on dense
weights). With LoRA r16 on every projection (q|k|v in 3 slices, gate|up in 2, as vLLM stores them):
`gemv_lora` (fused in the launch, `lora_index` all active), `marlin_lora` / `cublas_lora` (base, then
x @ A.T and one (x @ A.T) @ B.T per slice: the stock sequence) and `cublas_lora_dual` (the LoRA ops on
a second stream, joined before the add; vLLM's VLLM_LORA_ENABLE_DUAL_STREAM).

The CUDA C++ kernel (`qerl_lib.kernels.nvfp4_gemv_cuda`, rows 1..16, built on first use; its arms are
left out, with the reason under "errors", when the extension does not build): `cuda` (`plan`'s
configuration), `cuda_best` (the fastest of `CUDA_SWEEP`), `cuda_lora` (LoRA shrink kernel, then the
GEMV with the expand in its epilogue) and `cuda_lora_pdl` (the same, the GEMV a programmatic dependent
launch overlapping the shrink); `cuda_repacked` / `cuda_lora_pdl_repacked`: the same on the codes in the
kernel's repacked layout (`repack_codes`, config `repacked`: same bits, fewer decode instructions); `cuda_pdl`: every GEMV a programmatic dependent launch of the one
before (it overlaps the previous call's tail: in an engine the kernel before a linear is another op,
so this arm bounds what PDL could gain, it is not what the engine gets).

Reported: ms per decode step of all linears, the share of the weight-read bound (codes + scales of the
step / the measured device-to-device copy bandwidth, divided by the time), and the crossovers: the
largest row count up to which `gemv` (`gemv_best`, `cuda`, `cuda_best`) is faster than the best of
Marlin and cuBLAS, without and with LoRA. One command, on a CUDA machine with torch + triton (vLLM optional):

    python benchmarks/nvfp4_gemv.py --out benchmarks/results/nvfp4_gemv.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.decode_gemm_profile import GLOBAL_SCALE, SHAPE, copy_bandwidth  # noqa: E402
from qerl_lib.io import atomic_write_json  # noqa: E402

ROWS = [1, 2, 4, 8, 16, 32, 48, 64]
GROUPS = {  # name: (N, K, LoRA output slices)
    "qkv": (4608, 3584, [3584, 512, 512]),
    "o": (3584, 3584, [3584]),
    "gate_up": (37888, 3584, [18944, 18944]),
    "down": (3584, 18944, [3584]),
}
RANK = 16
SWEEP = [  # alternatives to `plan` (split: None = plan's; a number = that split)
    dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=256, num_warps=8, num_stages=4, split=None),
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, split=None),
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3, split="x2"),
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4, split="/2"),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, split=None),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, split=None),
]


CUDA_SWEEP = [dict(WR=1, WK=w) for w in (1, 2, 4, 8, 16)] + [dict(WR=2, WK=w) for w in (1, 2, 4, 8)] + [
    dict(WR=4, WK=w) for w in (1, 2, 4)]
"""Launch configurations of the CUDA kernel tried for `cuda_best` (row tiles per block x warps splitting K)."""


def cuda_key(cfg: dict) -> str:
    return "WR{WR}xWK{WK}".format(**cfg)


def sweep_configs(m: int, n: int, k: int, sms: int) -> list[dict]:
    from qerl_lib.kernels.nvfp4_gemv import plan

    base = plan(m, n, k, sms)
    out = []
    for c in SWEEP:
        if c["BLOCK_M"] < m or (m > 16 and c["BLOCK_M"] == 16):
            continue
        cfg = dict(c)
        split = cfg.pop("split")
        cfg["split"] = (base["split"] if split is None else base["split"] * 2 if split == "x2"
                        else max(1, base["split"] // 2))
        if m <= 32 and cfg["BLOCK_M"] == 64:
            cfg["BLOCK_M"] = 32 if m > 16 else 16
        out.append(cfg)
    return out


def graph_ms(fn, reps: int) -> float:
    """Mean ms of one `fn()` replayed from a CUDA graph (captured after a warm-up on a side stream)."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    del graph
    return statistics.median(times)


def precompile(tasks: list, jobs: int) -> float:
    """Compile the Triton variants in `jobs` processes (each runs its calls once; Triton's on-disk cache
    then serves this process). Returns seconds."""
    import multiprocessing as mp

    t0 = time.perf_counter()
    if jobs > 1 and len(tasks) > 1:
        ctx = mp.get_context("spawn")
        with ctx.Pool(min(jobs, len(tasks))) as pool:
            pool.map(_compile_one, tasks)
    else:
        for t in tasks:
            _compile_one(t)
    return round(time.perf_counter() - t0, 1)


def _compile_one(task) -> None:
    import torch

    from qerl_lib.kernels.nvfp4_gemv import nvfp4_gemv

    m, n, k, widths, cfg = task
    dev = "cuda"
    p = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
    s = torch.full((n, k // 16), 0x38, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
    gs = torch.tensor([GLOBAL_SCALE], device=dev)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    a = b = idx = None
    if widths:
        a = [torch.randn(RANK, k, device=dev, dtype=torch.bfloat16) for _ in widths]
        b = [torch.randn(w, RANK, device=dev, dtype=torch.bfloat16) for w in widths]
        idx = torch.zeros(m, dtype=torch.long, device=dev)
    nvfp4_gemv(x, p, s, gs, None, a, b, 1.0, idx, 0, config=cfg)
    torch.cuda.synchronize()


def build(args, torch, F):
    """28 layers per group: NVFP4 (codes, scales), Marlin copies, dense bf16 weights, LoRA factors."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = {g: [] for g in GROUPS}
    for g, (n, k, widths) in GROUPS.items():
        for _ in range(args.layers):
            p = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
            s = (torch.rand((n, k // 16), device="cuda", generator=gen) + 0.5).to(torch.float8_e4m3fn)
            w = (torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02)
            a = [torch.randn(RANK, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.01 for _ in widths]
            b = [torch.randn(wd, RANK, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.01 for wd in widths]
            layers[g].append(dict(p=p, s=s, w=w, a=a, b=b, a_cat=torch.cat(a)))
    return layers


def marlin_setup(layers, torch):
    """vLLM's Marlin NVFP4 copies of every layer, or None (with the reason) when vLLM does not import."""
    try:
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import (
            apply_fp4_marlin_linear,
            prepare_fp4_layer_for_marlin,
        )
    except Exception as e:  # noqa: BLE001 - vLLM absent or another layout
        return None, f"vLLM Marlin not importable: {type(e).__name__}: {e}"[:300]
    for g, ls in layers.items():
        for L in ls:
            mod = torch.nn.Module()
            mod.weight = torch.nn.Parameter(L["p"].clone(), requires_grad=False)
            mod.weight_scale = torch.nn.Parameter(L["s"].clone(), requires_grad=False)
            mod.weight_global_scale = torch.nn.Parameter(torch.tensor([1.0 / GLOBAL_SCALE], device="cuda"),
                                                         requires_grad=False)
            mod.output_size_per_partition, mod.input_size_per_partition = L["p"].shape[0], 2 * L["p"].shape[1]
            mod.params_dtype = torch.bfloat16
            prepare_fp4_layer_for_marlin(mod)
            L["marlin"] = mod

    def run(mod, x):
        return apply_fp4_marlin_linear(input=x, weight=mod.weight, weight_scale=mod.weight_scale,
                                       weight_global_scale=mod.weight_global_scale, workspace=mod.workspace,
                                       size_n=mod.output_size_per_partition, size_k=mod.input_size_per_partition)
    return run, "vllm marlin"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/nvfp4_gemv.json"))
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--layers", type=int, default=SHAPE["layers"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="parallel Triton compiles")
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    import triton

    from qerl_lib.kernels.nvfp4_gemv import nvfp4_gemv, plan
    from qerl_lib.rollout.vllm_weights import dequantize_partitions

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/nvfp4_gemv.py needs a CUDA GPU")
    t_start = time.perf_counter()
    rows = [int(r) for r in args.rows.split(",")]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"command": "python " + " ".join(sys.argv),
           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": torch.cuda.get_device_name(0),
           "versions": {"torch": torch.__version__, "triton": triton.__version__}, "rows": rows,
           "layers": args.layers, "lora_rank": RANK, "groups": {g: list(v[:2]) for g, v in GROUPS.items()},
           "errors": {}}
    try:
        import vllm

        res["versions"]["vllm"] = vllm.__version__
    except Exception:  # noqa: BLE001
        pass

    # every Triton variant compiled up front, in parallel
    tasks = {}
    for m in rows:
        for g, (n, k, widths) in GROUPS.items():
            cfgs = [plan(m, n, k, sms)] + ([] if args.no_sweep else sweep_configs(m, n, k, sms))
            for c, wd in [(c, None) for c in cfgs] + [(cfgs[0], widths)]:
                variant = (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"],
                           c["split"] > 1 and triton.cdiv(k, c["BLOCK_K"]) > 1, len(wd or []), k % c["BLOCK_K"] != 0)
                tasks.setdefault(variant, (m, n, k, wd, c))
    res["compile_s"] = precompile(list(tasks.values()), args.jobs)
    print(f"compiled {len(tasks)} kernel variants in {res['compile_s']} s ({args.jobs} processes)", flush=True)

    from qerl_lib.kernels import nvfp4_gemv_cuda as C

    cuda_rows = [m for m in rows if m <= C.MAX_ROWS]
    t0 = time.perf_counter()
    try:
        C.load_extension()
        res["cuda_build_s"] = round(time.perf_counter() - t0, 1)
        res["cuda_regs"] = {f"bf16_mt{mt}": C.kernel_regs(True, mt, True) for mt in (1, 2)}
        print(f"CUDA extension ready in {res['cuda_build_s']} s, registers {res['cuda_regs']}", flush=True)
    except Exception as e:  # noqa: BLE001 - no nvcc / ninja: the table goes on without the CUDA arms
        res["errors"]["cuda_build"] = repr(e)[:2000]
        cuda_rows = []
        print(f"CUDA extension unavailable: {e!r}"[:500], flush=True)

    res["copy_bandwidth"] = copy_bandwidth()
    bw = res["copy_bandwidth"]["bytes_per_s"]
    print(f"copy bandwidth {res['copy_bandwidth']['tb_per_s']} TB/s", flush=True)
    layers = build(args, torch, F)
    gs = torch.tensor([GLOBAL_SCALE], device="cuda")
    marlin, res["base_4bit"] = marlin_setup(layers, torch)
    if marlin is None:  # the project's own fused Triton kernel instead (autotuned on its first, eager call)
        from qerl_lib.kernels.nvfp4_triton import nvfp4_matmul

        def marlin(L, x):  # noqa: F811
            return nvfp4_matmul(x, L["p"], L["s"], gs)
        for g, ls in layers.items():
            for L in ls:
                L["marlin"] = L
        res["base_4bit"] += "; timed instead: qerl_lib.kernels.nvfp4_triton.nvfp4_matmul (the training kernel)"
    if cuda_rows:  # the codes in the kernel's repacked layout too (another 3.7 GB at the 7B shapes)
        for ls in layers.values():
            for L in ls:
                L["p_r"] = C.repack_codes(L["p"])
    step_bytes = {g: args.layers * (n * k // 2 + n * k // 16) for g, (n, k, _) in GROUPS.items()}
    res["nvfp4_bytes_per_step"] = sum(step_bytes.values())

    # correctness on the timed weights: the kernel against cuBLAS on the dequantized bf16 weight
    res["rel_diff_vs_dequantized_cublas"] = {}
    for g, (n, k, widths) in GROUPS.items():
        L = layers[g][0]
        w = dequantize_partitions(L["p"], L["s"], gs, [n])
        x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
        a, b = nvfp4_gemv(x, L["p"], L["s"], gs).float(), F.linear(x, w).float()
        res["rel_diff_vs_dequantized_cublas"][g] = float((a - b).norm() / b.norm())
        if cuda_rows:
            c = C.nvfp4_gemv(x, L["p"], L["s"], gs).float()
            res.setdefault("cuda_rel_diff_vs_dequantized_cublas", {})[g] = float((c - b).norm() / b.norm())
        del w

    side = torch.cuda.Stream()

    def lora_torch(y, x, L, widths):  # the stock sequence: shrink of every slice at once, one expand per slice
        t = x @ L["a_cat"].T
        col = 0
        for i, wd in enumerate(widths):
            y[:, col:col + wd].addmm_(t[:, i * RANK:(i + 1) * RANK], L["b"][i].T)
            col += wd
        return y

    def arms_for(g, m, x):
        n, k, widths = GROUPS[g]
        ls = layers[g]
        idx = torch.zeros(m, dtype=torch.long, device="cuda")
        arms = {
            "gemv": lambda: [nvfp4_gemv(x, L["p"], L["s"], gs) for L in ls],
            "marlin": lambda: [marlin(L["marlin"], x) for L in ls],
            "cublas": lambda: [F.linear(x, L["w"]) for L in ls],
            "gemv_lora": lambda: [nvfp4_gemv(x, L["p"], L["s"], gs, None, L["a"], L["b"], 1.0, idx, 0) for L in ls],
            "marlin_lora": lambda: [lora_torch(marlin(L["marlin"], x), x, L, widths) for L in ls],
            "cublas_lora": lambda: [lora_torch(F.linear(x, L["w"]), x, L, widths) for L in ls],
        }

        def dual():
            for L in ls:
                ev = torch.cuda.Event()
                ev.record()
                with torch.cuda.stream(side):
                    side.wait_event(ev)
                    z = torch.zeros(m, n, device="cuda", dtype=torch.bfloat16)
                    lora_torch(z, x, L, widths)
                    done = torch.cuda.Event()
                    done.record()
                y = F.linear(x, L["w"])
                torch.cuda.current_stream().wait_event(done)
                y += z
        arms["cublas_lora_dual"] = dual
        if m in cuda_rows:
            arms["cuda"] = lambda: [C.nvfp4_gemv(x, L["p"], L["s"], gs) for L in ls]
            arms["cuda_pdl"] = lambda: [C.nvfp4_gemv(x, L["p"], L["s"], gs, config={"pdl": True}) for L in ls]
            arms["cuda_repacked"] = lambda: [C.nvfp4_gemv(x, L["p_r"], L["s"], gs, config={"repacked": True})
                                             for L in ls]
            arms["cuda_lora"] = lambda: [C.nvfp4_gemv(x, L["p"], L["s"], gs, None, L["a"], L["b"], 1.0, idx, 0)
                                         for L in ls]
            arms["cuda_lora_pdl"] = lambda: [C.nvfp4_gemv(x, L["p"], L["s"], gs, None, L["a"], L["b"], 1.0, idx, 0,
                                                          config={"pdl": True}) for L in ls]
            arms["cuda_lora_pdl_repacked"] = lambda: [
                C.nvfp4_gemv(x, L["p_r"], L["s"], gs, None, L["a"], L["b"], 1.0, idx, 0,
                             config={"pdl": True, "repacked": True}) for L in ls]
        return arms

    table = []
    for m in rows:
        row = {"rows": m, "ms": {}, "best_config": {}, "sweep_ms": {}}
        for g, (n, k, widths) in GROUPS.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for name, fn in arms_for(g, m, x).items():
                try:
                    row["ms"].setdefault(name, {})[g] = round(graph_ms(fn, args.reps), 4)
                except Exception as e:  # noqa: BLE001
                    res["errors"][f"{name}/{g}/m{m}"] = repr(e)[:300]
            best = (row["ms"].get("gemv", {}).get(g), plan(m, n, k, sms))
            if not args.no_sweep:
                for cfg in sweep_configs(m, n, k, sms):
                    key = "{BLOCK_M}x{BLOCK_N}x{BLOCK_K}/w{num_warps}s{num_stages}/split{split}".format(**cfg)
                    try:
                        t = round(graph_ms(lambda: [nvfp4_gemv(x, L["p"], L["s"], gs, config=cfg)
                                                    for L in layers[g]], args.reps), 4)
                    except Exception as e:  # noqa: BLE001 - out of resources for this configuration
                        res["errors"][f"sweep/{g}/m{m}/{key}"] = repr(e)[:300]
                        continue
                    row["sweep_ms"].setdefault(g, {})[key] = t
                    if best[0] is None or t < best[0]:
                        best = (t, cfg)
            row["ms"].setdefault("gemv_best", {})[g] = best[0]
            row["best_config"][g] = best[1]
            if m in cuda_rows and "cuda" in row["ms"] and g in row["ms"]["cuda"]:
                cplan = C.plan(m, n, k, sms, C.kernel_regs(True, 1 if m <= 8 else 2, True))
                cbest = (row["ms"]["cuda"][g], cuda_key(cplan))
                for cfg in ([] if args.no_sweep else CUDA_SWEEP):
                    if cfg["WR"] * cfg["WK"] > C.MAX_WARPS:
                        continue
                    try:
                        t = round(graph_ms(lambda: [C.nvfp4_gemv(x, L["p"], L["s"], gs, config=cfg)
                                                    for L in layers[g]], args.reps), 4)
                    except Exception as e:  # noqa: BLE001
                        res["errors"][f"cuda_sweep/{g}/m{m}/{cuda_key(cfg)}"] = repr(e)[:300]
                        continue
                    row.setdefault("cuda_sweep_ms", {}).setdefault(g, {})[cuda_key(cfg)] = t
                    if t < cbest[0]:
                        cbest = (t, cuda_key(cfg))
                row["ms"].setdefault("cuda_best", {})[g] = cbest[0]
                row.setdefault("cuda_plan", {})[g] = cuda_key(cplan)
                row.setdefault("cuda_best_config", {})[g] = cbest[1]
            torch.cuda.empty_cache()
        row["total_ms"] = {a: round(sum(v.values()), 4) for a, v in row["ms"].items() if len(v) == len(GROUPS)}
        for a in ("gemv", "gemv_best", "cuda", "cuda_best", "cuda_pdl", "cuda_repacked", "cuda_lora", "cuda_lora_pdl",
                  "cuda_lora_pdl_repacked", "marlin", "cublas"):
            if a in row["total_ms"]:
                row.setdefault("share_of_weight_read_bound", {})[a] = round(
                    res["nvfp4_bytes_per_step"] / bw * 1e3 / row["total_ms"][a], 3)
        if "gemv" in row["ms"]:
            row["gemv_share_by_group"] = {g: round(step_bytes[g] / bw * 1e3 / t, 3)
                                          for g, t in row["ms"]["gemv"].items()}
        for a in ("cuda", "cuda_repacked"):
            if a in row["ms"]:
                row[f"{a}_share_by_group"] = {g: round(step_bytes[g] / bw * 1e3 / t, 3) for g, t in row["ms"][a].items()}
        table.append(row)
        tm = row["total_ms"]
        print(f"rows {m:3d}: " + "  ".join(f"{a} {tm[a]:.3f}" for a in tm) + " ms/step", flush=True)
    res["table"] = table
    from qerl_lib.kernels import nvfp4_gemv as G

    assert all(int(c.abs().sum()) == 0 for c in G._COUNTERS.values()), "arrival counters not back to zero"

    def crossover(ours: str, others: tuple[str, ...]):
        last = None
        for row in table:
            t = row["total_ms"]
            if ours not in t or not any(o in t for o in others):
                break
            if t[ours] <= min(t[o] for o in others if o in t):
                last = row["rows"]
            else:
                break
        return last

    res["crossover_rows"] = {
        "gemv_vs_best_of_marlin_cublas": crossover("gemv", ("marlin", "cublas")),
        "gemv_best_vs_best_of_marlin_cublas": crossover("gemv_best", ("marlin", "cublas")),
        "gemv_lora_vs_best_lora": crossover("gemv_lora", ("marlin_lora", "cublas_lora", "cublas_lora_dual")),
        "cuda_vs_best_of_marlin_cublas": crossover("cuda", ("marlin", "cublas")),
        "cuda_best_vs_best_of_marlin_cublas": crossover("cuda_best", ("marlin", "cublas")),
        "cuda_lora_vs_best_lora": crossover("cuda_lora", ("marlin_lora", "cublas_lora", "cublas_lora_dual")),
        "cuda_lora_pdl_vs_best_lora": crossover("cuda_lora_pdl", ("marlin_lora", "cublas_lora", "cublas_lora_dual")),
        "note": "largest row count such that the kernel is at least as fast at every row count up to it "
                "(all linears of a decode step, CUDA-graph replay)",
    }
    first = table[0]
    res["summary"] = {
        "rows_1_share_of_weight_read_bound": first.get("share_of_weight_read_bound"),
        "rows_1_total_ms": first["total_ms"],
        "weight_read_bound_ms": round(res["nvfp4_bytes_per_step"] / bw * 1e3, 4),
        "rows_1_ms_by_group": {a: first["ms"][a] for a in ("cuda", "cuda_best", "cuda_repacked", "cuda_lora",
                                                           "cuda_lora_pdl_repacked", "gemv_best", "marlin")
                               if a in first["ms"]},
        "cuda_target_met": (first["total_ms"].get("cuda_best", float("inf"))
                            <= res["nvfp4_bytes_per_step"] / bw * 1e3 / 0.6),
    }
    res["seconds"] = round(time.perf_counter() - t_start, 1)
    atomic_write_json(args.out, res)
    print(f"crossovers {res['crossover_rows']}")
    print(f"rows 1 share of the weight-read bound: {res['summary']['rows_1_share_of_weight_read_bound']}")
    print(f"wrote {args.out} ({res['seconds']} s)")


if __name__ == "__main__":
    main()
