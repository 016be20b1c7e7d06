"""Seconds per stage of the embedded default, and resident weight bytes NVFP4 vs BF16.

    python benchmarks/embedded_default.py [--root /tmp/qerl-bench] [--set key=value ...]

Runs `qerl run` with the default config (plus overrides) in a fresh workspace,
reads the per-stage timings it logs, then loads the NVFP4 base (packed) and the BF16
base of the same model side by side and counts the bytes of their resident weights
(parameters and buffers). Prints a table and writes
benchmarks/results/embedded_default.json with the exact command, the git commit and the config
hash it ran (`qerl_lib.config.config_hash`), the peak resident memory of the run (before the
side-by-side load) and its three-line result (`qerl_lib.outcome`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/tmp/qerl-bench-default")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "embedded_default.json"))
    args = ap.parse_args()

    from qerl_lib.config import config_hash, load_config
    from qerl_lib.outcome import result_lines
    from qerl_lib.stages.common import git_commit
    from qerl_lib.convert import convert
    from qerl_lib.io import atomic_write_json
    from qerl_lib.model import load_base
    from qerl_lib.nvfp4_linear import resident_weight_bytes
    from qerl_lib.paths import Layout
    from qerl_lib.policy import clear_policy_cache
    from qerl_lib.run import run_all

    shutil.rmtree(args.root, ignore_errors=True)
    cfg = load_config(None, [*args.overrides, f"run.root={args.root}"])
    if cfg.run.threads:  # as `qerl run` does (qerl_lib.cli._load)
        from qerl_lib.model import set_threads

        set_threads(cfg.run.threads)
    t0 = time.perf_counter()
    records = run_all(cfg)
    total = time.perf_counter() - t0
    peak_rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: kB
    clear_policy_cache()

    per_stage: dict[str, list[float]] = defaultdict(list)
    for r in records:
        per_stage[r["stage"]].append(r["seconds"])
    layout = Layout(args.root)
    steps = [json.loads(layout.update_metrics(i).read_text()) for i in range(cfg.run.steps)]
    rewards = [json.loads(layout.reward_metrics(i).read_text()) for i in range(cfg.run.steps)]
    evals = {k: json.loads(layout.eval_metrics(k).read_text()) for k in (0, cfg.run.steps)}

    # Resident bytes of the two bases, loaded the way training loads them.
    if not layout.checkpoint("bf16").is_dir():
        convert(layout.base_model, layout.checkpoint("bf16"), "bf16")
    cpu = torch.device("cpu")
    nv = resident_weight_bytes(load_base(layout.checkpoint("nvfp4"), "nvfp4", torch.bfloat16, cpu))
    bf = resident_weight_bytes(load_base(layout.checkpoint("bf16"), "bf16", torch.bfloat16, cpu))

    result = {
        "command": "python benchmarks/embedded_default.py " + " ".join(sys.argv[1:]),
        "git_commit": git_commit(),
        "config_hash": config_hash(cfg),
        "overrides": args.overrides,
        "peak_rss_mb": round(peak_rss_kb / 1024, 1),
        "result": result_lines(args.root, cfg.run.steps),
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
                    "torch": torch.__version__},
        "config": {"steps": cfg.run.steps, "prompts_per_step": cfg.rollout.prompts_per_step,
                   "group_size": cfg.rollout.group_size, "max_new_tokens": cfg.rollout.max_new_tokens,
                   "eval_prompts": cfg.eval.max_prompts, "eval_k": cfg.eval.k, "quant": cfg.model.quant,
                   "lr": cfg.optim.lr, "aqn": cfg.aqn.enabled, "scale_rewards": cfg.algo.scale_rewards,
                   "format_weight": cfg.reward.format_weight, "threads": cfg.run.threads,
                   "eval_max_new_tokens": cfg.eval.max_new_tokens},
        "seconds_total": round(total, 2),
        "seconds_per_stage": {k: {"calls": len(v), "mean": round(sum(v) / len(v), 2), "total": round(sum(v), 2)}
                              for k, v in per_stage.items()},
        "reward_mean_per_step": [r["reward_mean"] for r in rewards],
        "correct_rate_per_step": [r["correct_rate"] for r in rewards],
        "loss_per_step": [s["loss"] for s in steps],
        "eval": evals,
        "resident_weight_bytes": {"nvfp4": nv, "bf16": bf, "ratio_total": nv["total"] / bf["total"]},
    }
    atomic_write_json(args.out, result)
    print(json.dumps({k: result[k] for k in ("seconds_total", "seconds_per_stage", "reward_mean_per_step",
                                              "correct_rate_per_step")}, indent=1))
    print(f"resident weight bytes: nvfp4 {nv['total']:,} vs bf16 {bf['total']:,} "
          f"({nv['total'] / bf['total']:.3f}x)")
    print(f"eval: {evals}")
    print("\n".join(result["result"]))
    print(f"peak RSS of the run: {result['peak_rss_mb']:.0f} MB")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
