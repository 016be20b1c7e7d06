#!/usr/bin/env python3
"""Rollout decode throughput of the project's vLLM engine: NVFP4 (+ LoRA) against BF16 (+ LoRA).

Model: the Qwen2.5-7B shape (hidden 3584, intermediate 18944, 28 layers, 28 heads / 4 KV heads,
vocab 152064, q/k/v biases, untied lm_head) with random weights (speed does not depend on
their values; `benchmarks/rollout_checkpoints.py` writes them). The NVFP4 checkpoint is written
synthetically in compressed-tensors layout, packed directly on the GPU (random FP4 codes, FP8 block
scales, one global scale per fused group), never through a 16-bit copy; embeddings and lm_head are
bf16, as llm-compressor leaves them. The BF16 engine uses vLLM's own random initialisation (`load_format="dummy"`), so no
16 GB file is written at all.

Rollout settings are the project's (`qerl_lib.rollout.vllm_engine.VLLMEngine.generate`): per-request
seeds, temperature 1, top-p 1, the sampled token's logprob returned, token-id prompts, no
tokenizer; plus fixed lengths: prompt 256 random tokens, completion exactly `--decode` tokens
(no EOS exists without a tokenizer, and lengths are checked), prefix caching off, fresh
prompts per trial. Per cell: one short warm-up, `--trials` prefill-only runs (max 1 token)
and `--trials` full runs; decode tokens/s = batch * (decode - 1) / (full - median prefill);
end-to-end tokens/s = batch * decode / full. Median and min..max over trials.

Engines (`--engines`, measured one at a time, each in its own process, CUDA graphs on, capture
sizes = the batch sizes; `--overlap-starts` starts them all at once, `--stagger-s` apart, and hands
the GPU to one at a time once they are up, so a short call pays one start-up, not one per engine;
each then needs its own share of memory, `--mem` at most 0.95 / engines):
  bf16-rR     BF16 weights, LoRA slots of rank R; measures LoRA rank R (and no LoRA if R = 16)
  nvfp4-rR    NVFP4 as vLLM ships it (Marlin W4A16 for every batch)
  nf4-rR      bitsandbytes NF4 (QLoRA's format): vLLM quantizes a random BF16 checkpoint, written
              once per work directory (15 GB for the 7B shape), as it loads it
  nvfp4h-rR   the project's regime (`qerl_lib.rollout.vllm_worker`): Marlin + LoRA kernels up to
              `--dense-above` sequences per step; above, one dense BF16 GEMM per linear with
              the adapter merged in (no LoRA kernels)
  nvfp4g-rR   nvfp4h with the project's NVFP4 decode GEMM (`qerl_lib.kernels.nvfp4_gemv`, LoRA fused
              in the launch) for steps of at most `--gemv-rows` sequences instead of Marlin + LoRA kernels
              (`--gemv-kernel cuda`: the CUDA C++ kernel `nvfp4_gemv_cuda` for steps of at most 16)
  ...-ds      suffix: vLLM's LoRA kernels on a second CUDA stream (VLLM_LORA_ENABLE_DUAL_STREAM)
  ...-pdl     suffix (nvfp4g with `--gemv-kernel cuda`): the CUDA decode GEMM as a programmatic dependent
              launch (QERL_GEMV_PDL=1, `qerl_lib.kernels.nvfp4_gemv_cuda`)
  ...-rp      suffix, last (nvfp4g with `--gemv-kernel cuda`, `--gemv-rows` <= 16): the decode GEMM on its
              repacked codes (QERL_VLLM_GEMV_REPACK=1, `nvfp4_gemv_cuda.repack_codes`)
"No LoRA" is measured on the rank-16 engines with requests that carry no adapter (vLLM
captures separate CUDA graphs for batches without LoRA).

Also measured: the device-to-device copy bandwidth (bytes read + written), and a profile of
the decode GEMMs: all 28 layers' q|k|v, o, gate|up and down products (and the lm_head) at
each batch size, Marlin NVFP4 vs cuBLAS BF16, each replayed from a CUDA graph. The crossover
sets `--dense-above` when it is not given. The weight-read bound of a format is
batch * bandwidth / (bytes of weights read per decode step).

    python benchmarks/rollout_throughput.py --out benchmarks/results/rollout_throughput.json
    python benchmarks/rollout_throughput.py --merge A.json B.json --out C.json   (combine runs)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_children import run_child, run_overlapped, wait_for_turn  # noqa: E402
from benchmarks.decode_gemm_profile import SHAPE, copy_bandwidth, gemm_profile  # noqa: E402
from benchmarks.rollout_checkpoints import (write_adapter, write_bf16_weights,  # noqa: E402
                                            write_synthetic)
from benchmarks.rollout_plan import (DENSE_COPY_FORMATS, cell_deadline, cell_fits, cell_need, check_overlap,  # noqa: E402
                                     check_overlap_memory, kv_bytes_per_step, kv_cache_bytes, linear_params,
                                     parse_spec, reads_dense, weight_bytes_per_step)
from qerl_lib.io import atomic_write_json  # noqa: E402

STOCK_REFERENCE = {
    "source": "the issue: stock vLLM 0.26 on this H200, prompt 256 / decode 512 / CUDA graphs / LoRA r16",
    "bf16_lora_r16_tok_s": {"1": 157, "8": 1279, "64": 9191},
    "nvfp4_lora_r16_tok_s": {"1": 205, "8": 1676, "64": 8776},
    "nvfp4_over_bf16_no_lora": {"1": 1.43, "8": 1.39, "64": 0.94, "256": 0.68},
}


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2),
            "max": round(max(values), 2), "n": len(values)}


# ----------------------------------------------------------------------------- one engine (child process)


def run_engine(args) -> None:
    import torch

    from qerl_lib.rollout.sampling import SamplingParams
    from qerl_lib.rollout.vllm_engine import VLLMEngine

    fmt, rank, dual, pdl, repack = parse_spec(args.child)
    work = Path(args.work)
    out_path = work / f"engine-{args.child}.json"
    loras = [int(x) for x in args.loras.split(",")] if args.loras else ([rank, 0] if rank == 16 else [rank])
    batches = [int(b) for b in args.batches.split(",")]
    run_deadline = float(args.deadline)
    result = {"spec": args.child, "format": fmt, "max_lora_rank": rank, "lora_dual_stream": dual, "gemv_pdl": pdl,
              "gemv_repacked": repack,
              "cells": [], "skipped": []}

    def save():
        out_path.write_text(json.dumps(result, indent=1))

    kwargs = {"max_num_seqs": max(batches), "enable_prefix_caching": False,
              "compilation_config": {"cudagraph_capture_sizes": sorted(batches)}}
    if fmt == "bf16":
        kwargs["load_format"] = "dummy"
    if fmt == "nf4":
        # vLLM quantizes a 16-bit checkpoint to NF4 as it loads it; dummy weights have no file to quantize.
        kwargs["quantization"] = "bitsandbytes"
    if args.turn_dir:
        kwargs["kv_cache_memory_bytes"] = kv_cache_bytes(max(batches), args.prompt + args.decode + 16)
    ckpt = work / {"bf16": "bf16", "nf4": "bf16-weights"}.get(fmt, "nvfp4")
    dense_above = args.dense_above if fmt in DENSE_COPY_FORMATS else None
    gemv_rows = args.gemv_rows if fmt == "nvfp4g" else None
    eng = VLLMEngine(ckpt, max_lora_rank=rank, gpu_memory_utilization=args.mem, enforce_eager=False, seed=0,
                     max_model_len=args.prompt + args.decode + 16, dense_above=dense_above, lora_dual_stream=dual,
                     gemv_rows=gemv_rows, gemv_kernel=args.gemv_kernel, gemv_pdl=pdl, gemv_repack=repack,
                     engine_kwargs=kwargs)
    result["startup_seconds"] = eng.stats.startup_seconds
    result["linear_info"] = eng.rpc("qerl_linear_info")
    result["dense_above"] = dense_above
    result["gemv_rows"] = gemv_rows
    result["gemv_kernel"] = args.gemv_kernel if gemv_rows else None
    result["gpu_memory_utilization"] = args.mem
    result["kv_cache_memory_bytes"] = kwargs.get("kv_cache_memory_bytes")
    print(f"[{args.child}] engine up in {eng.stats.startup_seconds:.1f} s: {result['linear_info']}", flush=True)
    save()
    first = cell_need(batches[0], args.trials_large if batches[0] >= args.large_batch else args.trials, args.decode)
    later_startup = eng.stats.startup_seconds
    if args.turn_dir:  # overlapped starts: the later engines are up (or starting) already; wait for the GPU
        t_wait = time.time()
        if not wait_for_turn(Path(args.turn_dir), args.child, run_deadline - first):
            result["skipped"].append({"reason": "no turn before the deadline"})
            save()
            eng.close()
            return
        result["turn_wait_seconds"] = round(time.time() - t_wait, 1)
        later_startup = 0.0
    share_end = cell_deadline(time.time(), run_deadline, args.engines_after, later_startup, first)
    result["cell_deadline_in_s"] = round(share_end - time.time(), 1)
    gen = torch.Generator().manual_seed(1234)

    def prompts(b):
        return torch.randint(0, SHAPE["vocab"], (b, args.prompt), generator=gen).tolist()

    params = SamplingParams(1.0, 1.0, args.decode)
    for lora in loras:
        adapter = work / f"adapter-r{lora}" if lora else None
        eng.set_policy(adapter, lora)
        for b in batches:
            trials = args.trials_large if b >= args.large_batch else args.trials
            need = cell_need(b, trials, args.decode)
            if not cell_fits(time.time(), need, share_end, run_deadline, first=not result["cells"]):
                result["skipped"].append({"lora_rank": lora, "batch": b, "reason": f"deadline ({need:.0f} s needed)"})
                print(f"[{args.child}] skip lora {lora} batch {b}: deadline", flush=True)
                continue
            seeds = list(range(b))
            eng.generate(prompts(b), seeds, SamplingParams(1.0, 1.0, 8))  # warm-up
            trials = args.trials_large if b >= args.large_batch else args.trials
            pre, full = [], []
            for _ in range(trials):
                t0 = time.perf_counter()
                eng.generate(prompts(b), seeds, SamplingParams(1.0, 1.0, 1))
                pre.append(time.perf_counter() - t0)
            for _ in range(trials):
                t0 = time.perf_counter()
                comps = eng.generate(prompts(b), seeds, params)
                full.append(time.perf_counter() - t0)
                lengths = {len(c.token_ids) for c in comps}
                if lengths != {args.decode}:
                    raise RuntimeError(f"completion lengths {lengths} != {args.decode}")
            p = statistics.median(pre)
            cell = {
                "lora_rank": lora, "batch": b, "prompt": args.prompt, "decode": args.decode,
                "prefill_s": [round(x, 4) for x in pre], "full_s": [round(x, 4) for x in full],
                "decode_tok_s": spread([b * (args.decode - 1) / (f - p) for f in full]),
                "e2e_tok_s": spread([b * args.decode / f for f in full]),
            }
            result["cells"].append(cell)
            save()
            print(f"[{args.child}] lora {lora:2d} batch {b:3d}: decode {cell['decode_tok_s']['median']:9.1f} tok/s "
                  f"({cell['decode_tok_s']['min']:.1f}..{cell['decode_tok_s']['max']:.1f}), "
                  f"e2e {cell['e2e_tok_s']['median']:9.1f}", flush=True)
    result["engine_stats"] = eng.stats_dict()
    save()
    eng.close()


# ----------------------------------------------------------------------------- driver


def summarize(res: dict) -> dict:
    """One row per (engine, LoRA rank, batch); `over_bf16` against the stock BF16 engine of the same
    LoRA slot rank (`bf16-rR`) at the same LoRA rank and batch."""
    bw = res.get("copy_bandwidth", {}).get("bytes_per_s")
    engines = res.get("engines", {})
    by = {}
    for spec, e in engines.items():
        for c in e.get("cells", []):
            by[(spec, c["lora_rank"], c["batch"])] = (c, e)
    rows = []
    for (spec, lora, b), (c, e) in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        fmt, slot = e["format"], e["max_lora_rank"]
        med = c["decode_tok_s"]["median"]
        row = {"engine": spec, "format": fmt, "lora_rank": lora, "lora_slots": slot, "batch": b,
               "lora_dual_stream": e.get("lora_dual_stream", False), "decode_tok_s": med,
               "decode_min": c["decode_tok_s"]["min"], "decode_max": c["decode_tok_s"]["max"],
               "e2e_tok_s": c["e2e_tok_s"]["median"]}
        ref = by.get((f"bf16-r{slot}", lora, b))
        if ref is not None:
            row["over_bf16"] = round(med / ref[0]["decode_tok_s"]["median"], 3)
        if bw:
            dense_above = e.get("dense_above")
            merged = reads_dense(fmt, b, dense_above)
            wb = weight_bytes_per_step(fmt, b, slot if lora and not merged else 0, dense_above)
            kvb = kv_bytes_per_step(b, c["prompt"], c["decode"])
            row["weight_bytes_per_step"] = wb
            row["weight_read_bound_tok_s"] = round(b * bw / wb, 1)
            row["share_of_weight_bound"] = round(med / (b * bw / wb), 3)
            row["weight_kv_read_bound_tok_s"] = round(b * bw / (wb + kvb), 1)
            row["share_of_weight_kv_bound"] = round(med / (b * bw / (wb + kvb)), 3)
        rows.append(row)
    return {"rows": rows}


def print_table(summary: dict) -> None:
    print(f"{'engine':15s} {'lora':>4s} {'batch':>5s} {'decode tok/s':>13s} {'min..max':>19s} {'/bf16':>6s} "
          f"{'bound':>9s} {'share':>6s}")
    for r in summary["rows"]:
        print(f"{r['engine']:15s} {r['lora_rank']:4d} {r['batch']:5d} {r['decode_tok_s']:13.1f} "
              f"{r['decode_min']:9.1f}..{r['decode_max']:<9.1f} {r.get('over_bf16', float('nan')):6.3f} "
              f"{r.get('weight_read_bound_tok_s', float('nan')):9.1f} {r.get('share_of_weight_bound', float('nan')):6.3f}")


def child_cmd(args, spec: str, work: Path, deadline: float, after: int, dense_above: int) -> list[str]:
    """The command line of the child process that measures engine `spec`."""
    cmd = [sys.executable, __file__, "--child", spec, "--work", str(work),
           "--deadline", str(deadline - 5), "--engines-after", str(after),
           "--dense-above", str(dense_above), "--prompt", str(args.prompt), "--decode", str(args.decode),
           "--batches", args.batches, "--trials", str(args.trials), "--trials-large", str(args.trials_large),
           "--large-batch", str(args.large_batch), "--mem", str(args.mem), "--gemv-rows", str(args.gemv_rows),
           "--gemv-kernel", args.gemv_kernel]
    if args.loras:
        cmd += ["--loras", args.loras]
    return cmd


def driver(args) -> None:
    import torch

    t_start = time.time()
    deadline = t_start + args.deadline_s
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res: dict = {
        "command": "python " + " ".join([sys.argv[0]] + sys.argv[1:]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": torch.cuda.get_device_name(0),
        "versions": {},
        "model": {"shape": "Qwen2.5-7B", **SHAPE, "linear_params": linear_params(), "weights": "random"},
        "settings": {"prompt": args.prompt, "decode": args.decode, "batches": args.batches, "trials": args.trials,
                     "trials_at_large_batch": args.trials_large, "large_batch": args.large_batch,
                     "gpu_memory_utilization": args.mem, "sampling": "temperature 1, top-p 1, per-request seeds, "
                     "sampled-token logprob", "prefix_caching": False, "cuda_graphs": True},
        "stock_reference": STOCK_REFERENCE,
        "engines": {}, "errors": {},
    }
    for name in ("vllm", "torch", "transformers"):
        try:
            from importlib.metadata import version

            res["versions"][name] = version(name)
        except Exception:
            res["versions"][name] = ""
    marker = work / "nvfp4" / "model.safetensors"
    res["copy_bandwidth"] = copy_bandwidth()  # a few seconds; the weight-read bound needs this run's own figure
    print(f"copy bandwidth {res['copy_bandwidth']['tb_per_s']} TB/s", flush=True)
    if marker.is_file() and args.no_profile:
        print("synthetic checkpoint present, profile skipped", flush=True)
    else:
        synth = write_synthetic(work)
        res["synthetic_checkpoint"] = {"seconds": synth["seconds"], "nvfp4_file_bytes": synth["nvfp4_file_bytes"]}
        print(f"synthetic NVFP4 checkpoint: {synth['nvfp4_file_bytes'] / 1e9:.2f} GB in {synth['seconds']} s", flush=True)
        if not args.no_profile:
            try:
                res["gemm_profile"] = gemm_profile(synth["layers"], [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256])
            except Exception as e:  # the engines still run
                res["errors"]["gemm_profile"] = repr(e)
                print(f"gemm profile failed: {e!r}", flush=True)
        del synth
        torch.cuda.empty_cache()
    if any(parse_spec(spec)[0] == "nf4" for spec in args.engines.split(",")) and \
            not (work / "bf16-weights" / "model.safetensors.index.json").is_file():
        res["bf16_weights"] = write_bf16_weights(work / "bf16-weights")
        print(f"random BF16 checkpoint for the NF4 engine: {res['bf16_weights']}", flush=True)
    for r in (16, 64):
        if not (work / f"adapter-r{r}" / "adapter_config.json").is_file():
            write_adapter(work / f"adapter-r{r}", r, seed=r)
    dense_above = args.dense_above
    if dense_above is None:
        dense_above = (res.get("gemm_profile") or {}).get("largest_rows_marlin_wins") or 32
    res["dense_above"] = dense_above
    atomic_write_json(out, res)
    specs = args.engines.split(",")

    def record(spec: str, rc: int | str) -> None:  # an engine's child has ended: its file into the result
        path = work / f"engine-{spec}.json"
        res["engines"][spec] = json.loads(path.read_text()) if path.is_file() else {}
        if rc != 0:
            res["errors"][spec] = f"exit {rc}"
        res["summary"] = summarize(res)
        res["seconds"] = round(time.time() - t_start, 1)
        atomic_write_json(out, res)

    # each engine gets a fair share of what is left after the later engines' start-up (taken by the child once
    # it is up: `cell_deadline`), so a cut falls on every engine's last cells
    def after(n: int) -> int:
        return 0 if args.no_share else len(specs) - n - 1

    if args.overlap_starts:
        check_overlap_memory(specs, max(int(b) for b in args.batches.split(",")), args.prompt + args.decode + 16,
                             dense_above, args.gemv_rows, torch.cuda.get_device_properties(0).total_memory, args.mem)
        res["settings"]["overlap_starts"] = {"stagger_s": args.stagger_s}
        turns = work / "turns"
        cmds = [(spec, child_cmd(args, spec, work, deadline, after(n), dense_above) + ["--turn-dir", str(turns)])
                for n, spec in enumerate(specs)]
        print(f"== {len(specs)} engines starting together ({deadline - time.time():.0f} s left)", flush=True)
        rcs = run_overlapped(cmds, turns, deadline, args.stagger_s)
        for spec in specs:
            record(spec, rcs[spec])
    else:
        for n, spec in enumerate(specs):
            left = deadline - time.time()
            if left < args.min_engine_s:
                res["engines"][spec] = {"skipped": f"deadline: {left:.0f} s left"}
                print(f"skip engine {spec}: {left:.0f} s left", flush=True)
                continue
            print(f"== engine {spec} ({left:.0f} s left)", flush=True)
            record(spec, run_child(child_cmd(args, spec, work, deadline, after(n), dense_above), timeout=max(left, 1)))
    res["summary"] = summarize(res)
    atomic_write_json(out, res)
    print_table(res["summary"])


def merge(paths: list[str], out: str) -> None:
    """Combine the engines of several runs (same settings) into one result; commands are kept in order.

    An engine measured in several runs keeps the cells of all of them (a later run's cell replaces an
    earlier one of the same LoRA rank and batch); each cell records its run's index in `run`.
    """
    runs = [json.loads(Path(p).read_text()) for p in paths]
    res = dict(runs[0])
    res["command"] = [r["command"] for r in runs]
    res["runs"] = [{k: r.get(k) for k in ("command", "started", "seconds", "dense_above", "errors")} for r in runs]
    res["engines"] = {}
    for i, r in enumerate(runs):
        for spec, e in r["engines"].items():
            cells = [dict(c, run=i) for c in e.get("cells", [])]
            if spec not in res["engines"] or not res["engines"][spec].get("cells"):
                res["engines"][spec] = dict(e, cells=cells)
            elif cells:
                mine = {(c["lora_rank"], c["batch"]): c for c in res["engines"][spec]["cells"]}
                mine.update({(c["lora_rank"], c["batch"]): c for c in cells})
                res["engines"][spec] = dict(e, cells=sorted(mine.values(), key=lambda c: (c["lora_rank"], c["batch"])))
        for key in ("copy_bandwidth", "gemm_profile", "synthetic_checkpoint"):
            if key in r and key not in res:
                res[key] = r[key]
    res["summary"] = summarize(res)
    atomic_write_json(Path(out), res)
    print_table(res["summary"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/rollout_throughput.json"))
    p.add_argument("--work", default="/dev/shm/qerl-bench" if Path("/dev/shm").is_dir() else "/tmp/qerl-bench")
    p.add_argument("--engines", default="bf16-r16,nvfp4h-r16,bf16-r64,nvfp4h-r64,nvfp4-r16,nvfp4-r64")
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--decode", type=int, default=512)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--trials-large", type=int, default=3, help="trials at batches >= --large-batch")
    p.add_argument("--large-batch", type=int, default=256)
    p.add_argument("--mem", type=float, default=0.5, help="gpu_memory_utilization of each engine")
    p.add_argument("--dense-above", type=int, default=None, help="rows above which nvfp4h runs dense (default: profile)")
    p.add_argument("--gemv-rows", type=int, default=16, help="rows up to which nvfp4g runs the NVFP4 decode GEMM")
    p.add_argument("--gemv-kernel", choices=("triton", "cuda", "auto"), default="triton",
                   help="nvfp4g's decode GEMM: Triton, or the CUDA C++ kernel for steps of at most 16 rows "
                        "(auto: cuda when it builds, else none)")
    p.add_argument("--deadline-s", type=float, default=540.0, help="stop starting work after this many seconds")
    p.add_argument("--min-engine-s", type=float, default=100.0, help="start an engine only with this much time left")
    p.add_argument("--no-share", action="store_true", help="let each engine use all the time left (default: a fair share)")
    p.add_argument("--overlap-starts", action="store_true",
                   help="start every engine at once, then measure them one at a time (needs --mem <= 0.95 / engines)")
    p.add_argument("--stagger-s", type=float, default=30.0, help="with --overlap-starts: seconds between engine starts")
    p.add_argument("--no-profile", action="store_true", help="skip the GEMM profile and reuse the synthetic checkpoint if present")
    p.add_argument("--merge", nargs="+", default=None, help="combine these result files into --out")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--engines-after", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--deadline", default=None, help=argparse.SUPPRESS)
    p.add_argument("--turn-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--loras", default=None, help="LoRA ranks each engine measures, 0 = none (default: R and 0 on rank-16 engines, R else)")
    args = p.parse_args()
    if args.overlap_starts and not args.child and not args.merge:
        check_overlap(len(args.engines.split(",")), args.mem)
    if args.merge:
        merge(args.merge, args.out)
    elif args.child:
        run_engine(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
