"""Decode-side profile of the Qwen2.5-7B shape on a GPU, for `rollout_throughput.py`: the
device-to-device copy bandwidth (the weight-read bound's denominator) and the decode GEMMs of
all 28 layers (q|k|v, o, gate|up, down, and the lm_head), Marlin NVFP4 against cuBLAS BF16 on
the same weights, each replayed from a CUDA graph. The crossover row count sets the engine's
dense regime (`--dense-above`)."""

from __future__ import annotations

import statistics

SHAPE = dict(hidden=3584, inter=18944, layers=28, heads=28, kv_heads=4, head_dim=128, vocab=152064)
"""Qwen2.5-7B."""

GLOBAL_SCALE = 150.0
"""compressed-tensors divisor of the synthetic weights: element = fp4 * block_scale / 150 (std ~0.02)."""


def kv_bytes_per_token(shape: dict) -> int:
    """K and V of one token over all of `shape`'s layers, in bf16."""
    return 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * 2


def copy_bandwidth() -> dict:
    import torch

    n = 4 << 30
    a = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(5):
            b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 5 / 1e3)
    t = statistics.median(times)
    del a, b
    torch.cuda.empty_cache()
    return {"bytes_per_s": round(2 * n / t), "tb_per_s": round(2 * n / t / 1e12, 3), "buffer_bytes": n,
            "note": "device-to-device copy of 4 GiB, bytes read + written, median of 5 x 5 copies"}


def gemm_profile(layers: list[dict], ms: list[int]) -> dict:
    """Time of the decode GEMMs of all layers, per shape group and batch rows, Marlin NVFP4 vs cuBLAS BF16."""
    import torch
    import torch.nn.functional as F
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import (
        apply_fp4_marlin_linear,
        prepare_fp4_layer_for_marlin,
    )

    from qerl_lib.rollout.vllm_weights import dequantize_partitions

    groups = {"qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "o": ["self_attn.o_proj"],
              "gate_up": ["mlp.gate_proj", "mlp.up_proj"], "down": ["mlp.down_proj"]}
    marlin, dense = {g: [] for g in groups}, {g: [] for g in groups}
    for gpu in layers:
        for g, mods in groups.items():
            packed = torch.cat([gpu[m][0] for m in mods])
            scale = torch.cat([gpu[m][1] for m in mods])
            widths = [gpu[m][0].shape[0] for m in mods]
            w = dequantize_partitions(packed, scale, torch.full((len(mods),), GLOBAL_SCALE, device="cuda"), widths)
            layer = torch.nn.Module()
            layer.weight = torch.nn.Parameter(packed, requires_grad=False)
            layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
            layer.weight_global_scale = torch.nn.Parameter(torch.tensor([1.0 / GLOBAL_SCALE], device="cuda"),
                                                           requires_grad=False)
            layer.output_size_per_partition, layer.input_size_per_partition = w.shape
            layer.params_dtype = torch.bfloat16
            prepare_fp4_layer_for_marlin(layer)
            marlin[g].append(layer)
            dense[g].append(w)

    def run_marlin(layer, x):
        return apply_fp4_marlin_linear(input=x, weight=layer.weight, weight_scale=layer.weight_scale,
                                       weight_global_scale=layer.weight_global_scale, workspace=layer.workspace,
                                       size_n=layer.output_size_per_partition, size_k=layer.input_size_per_partition)

    # correctness of the two paths on the same weights
    x = torch.randn(64, SHAPE["hidden"], device="cuda", dtype=torch.bfloat16)
    a, b = run_marlin(marlin["qkv"][0], x).float(), F.linear(x, dense["qkv"][0]).float()
    rel = float((a - b).norm() / b.norm())

    lm_head = torch.randn(SHAPE["vocab"], SHAPE["hidden"], device="cuda", dtype=torch.bfloat16) * 0.02

    def timed(fn, reps=10) -> float:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        del graph
        return start.elapsed_time(end) / reps

    table = []
    for m in ms:
        xh = torch.randn(m, SHAPE["hidden"], device="cuda", dtype=torch.bfloat16)
        xi = torch.randn(m, SHAPE["inter"], device="cuda", dtype=torch.bfloat16)
        row = {"rows": m, "marlin_ms": {}, "cublas_ms": {}}
        for g in groups:
            xin = xi if g == "down" else xh
            row["marlin_ms"][g] = round(timed(lambda: [run_marlin(l, xin) for l in marlin[g]]), 4)
            row["cublas_ms"][g] = round(timed(lambda: [F.linear(xin, w) for w in dense[g]]), 4)
        row["lm_head_ms"] = round(timed(lambda: F.linear(xh, lm_head)), 4)
        row["marlin_total_ms"] = round(sum(row["marlin_ms"].values()), 4)
        row["cublas_total_ms"] = round(sum(row["cublas_ms"].values()), 4)
        table.append(row)
        print(f"  gemm rows {m:4d}: marlin {row['marlin_total_ms']:7.3f} ms  cublas {row['cublas_total_ms']:7.3f} ms"
              f"  lm_head {row['lm_head_ms']:.3f} ms", flush=True)
        torch.cuda.empty_cache()
    crossover = None
    for row in table:
        if row["marlin_total_ms"] <= row["cublas_total_ms"]:
            crossover = row["rows"]
        else:
            break
    del marlin, dense, lm_head
    torch.cuda.empty_cache()
    return {"table": table, "marlin_vs_dense_rel_diff_rows64": rel,
            "largest_rows_marlin_wins": crossover,
            "note": "per decode step: all 28 layers of each group, CUDA-graph replay, median-free mean of 10"}
