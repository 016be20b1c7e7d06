"""Short probes of the embedded default's training knobs: one `qerl run` per arm, one shared base.

    python benchmarks/embedded_sweep.py [--work /tmp/qerl-sweep] [--set key=value ...] \
        --arm "NAME key=value key=value" [--arm ...] [--out benchmarks/results/embedded_sweep.json]

`--set` applies to every arm (and to the base); `--arm` names one configuration (whitespace-separated
overrides after its name; a bare name is the defaults plus `--set`). The stages that no arm may change
(prepare, convert, init_adapter and the evaluation of adapter 0: their params in
`qerl_lib.stages.registry`) run once, with `qerl stage`, in `<work>/_base-<hash of --set>`; each arm's
workspace starts as hard links to those outputs, so its `qerl run` skips them and pays only its own
steps and final evaluation. An arm that changes one of those params is refused (put it in `--set`).

Each arm runs `nice -n 10 qerl run` under `/usr/bin/time` (its peak RSS), one at a time. Per arm the
JSON holds: the overrides, the config hash, greedy accuracy and pass@1 before/after with their standard
errors, the paired greedy gain (mean over prompts of after - before) with its standard error, the
training reward and correct rate per step, the update's learning rate and kept samples, seconds per
stage and in all, and the peak RSS. Results merge into `--out` by arm name (a later run of the same
name replaces it). Arm workspaces are left in `--work` for `qerl audit` / `qerl compare`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASE_STAGES = ("prepare", "convert", "init_adapter", "eval")


def _qerl() -> list[str]:
    exe = Path(sys.executable).with_name("qerl")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "qerl_lib"]


def _base_params() -> tuple[str, ...]:
    from qerl_lib.stages import registry

    keys: list[str] = []
    for name in BASE_STAGES:
        keys.extend(registry.get(name).params)
    return tuple(dict.fromkeys(keys))


NEUTRAL_FOR_ACCURACY = ("reward.correct_weight", "reward.format_weight", "reward.overlong_buffer",
                        "reward.overlong_penalty", "reward.mask_truncated")
"""Base params that change the eval's reward column but not its accuracies (graded by correctness
alone): an arm may set them; its eval@0 is the shared one."""


def _touches(key: str, params: tuple[str, ...]) -> bool:
    if key in NEUTRAL_FOR_ACCURACY:
        return False
    return any(key == p or key.startswith(p + ".") or p.startswith(key + ".") for p in params)


def _sh(cmd: list[str], log: Path) -> float:
    t0 = time.perf_counter()
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        res = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(f"failed (rc {res.returncode}): {' '.join(cmd)}; see {log}")
    return time.perf_counter() - t0


def build_base(work: Path, common: list[str]) -> Path:
    from qerl_lib.seeds import stable_id

    base = work / f"_base-{stable_id(*common) if common else 'defaults'}"
    if (base / "eval" / "step=0" / "metrics.json").is_file():
        return base
    sets = [a for kv in common for a in ("-s", kv)]
    log = work / "base.log"
    for name in BASE_STAGES:
        extra = ["--step", "0"] if name == "eval" else []
        secs = _sh(["nice", "-n", "10", *_qerl(), "stage", name, *extra, *sets, "--root", str(base)], log)
        print(f"base {name}: {secs:.1f}s", flush=True)
    return base


def _link_tree(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, copy_function=os.link)


def _per_prompt_greedy(path: Path) -> dict[str, float]:
    import pyarrow.parquet as pq

    t = pq.read_table(path, columns=["prompt_id", "temperature", "reward_correct"]).to_pylist()
    return {r["prompt_id"]: float(r["reward_correct"] > 0) for r in t if r["temperature"] == 0.0}


def paired_gain(before: dict[str, float], after: dict[str, float]) -> tuple[float, float, int]:
    """Mean and standard error over prompts of after - before (greedy, 0/1 per prompt)."""
    import numpy as np

    ids = sorted(set(before) & set(after))
    d = np.array([after[i] - before[i] for i in ids], dtype=np.float64)
    if len(d) < 2:
        return float(d.mean()) if len(d) else 0.0, 0.0, len(d)
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d))), len(d)


def run_arm(work: Path, base: Path, name: str, common: list[str], arm: list[str]) -> dict:
    from qerl_lib.config import config_hash, load_config
    from qerl_lib.paths import Layout

    root = work / name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for sub in ("data", "models", "adapters/step=0", "eval/step=0"):
        _link_tree(base / sub, root / sub)
    overrides = [*common, *arm]
    cfg = load_config(None, [*overrides, f"run.root={root}"])
    sets = [a for kv in overrides for a in ("-s", kv)]
    rss_file = work / f"{name}.rss"
    log = work / f"{name}.log"
    log.unlink(missing_ok=True)
    secs = _sh(["/usr/bin/time", "-f", "%M", "-o", str(rss_file), "nice", "-n", "10", *_qerl(), "run", *sets,
                "--root", str(root)], log)
    lay = Layout(root)
    steps = cfg.run.steps
    ev0 = json.loads(lay.eval_metrics(0).read_text())
    evn = json.loads(lay.eval_metrics(steps).read_text())
    gain, gain_se, n = paired_gain(_per_prompt_greedy(lay.eval_samples(0)), _per_prompt_greedy(lay.eval_samples(steps)))
    rewards = [json.loads(lay.reward_metrics(i).read_text()) for i in range(steps)]
    updates = [json.loads(lay.update_metrics(i).read_text()) for i in range(steps)]
    per_stage: dict[str, float] = defaultdict(float)
    for line in lay.stage_times.read_text().splitlines():
        rec = json.loads(line)
        per_stage[rec["stage"]] += rec["seconds"]
    result = {
        "overrides": overrides, "config_hash": config_hash(cfg),
        "greedy": [round(ev0["greedy_acc"], 4), round(evn["greedy_acc"], 4)],
        "greedy_se": [round(ev0["greedy_acc_se"], 4), round(evn["greedy_acc_se"], 4)],
        "greedy_gain_paired": round(gain, 4), "greedy_gain_paired_se": round(gain_se, 4), "n_prompts": n,
        "pass_at_1": [round(ev0["pass_at_1"], 4), round(evn["pass_at_1"], 4)],
        "pass_at_1_se": [round(ev0["pass_at_1_se"], 4), round(evn["pass_at_1_se"], 4)],
        "reward_mean_per_step": [round(r["reward_mean"], 4) for r in rewards],
        "correct_rate_per_step": [round(r["correct_rate"], 4) for r in rewards],
        "lr_per_step": [u.get("lr") for u in updates],
        "kept_per_step": [u.get("kept_samples") for u in updates],
        "kl_per_step": [None if u.get("kl") is None else round(u["kl"], 5) for u in updates],
        "seconds_per_stage": {k: round(v, 1) for k, v in per_stage.items()},
        "seconds_run": round(secs, 1),
        "peak_rss_mb": round(int(rss_file.read_text().split()[-1]) / 1024, 1),
    }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/qerl-sweep")
    ap.add_argument("--set", dest="common", action="append", default=[])
    ap.add_argument("--arm", action="append", default=[], required=True)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "embedded_sweep.json"))
    args = ap.parse_args()

    from qerl_lib.io import atomic_write_json
    from qerl_lib.stages.common import git_commit

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    fixed = _base_params()
    arms = []
    for spec in args.arm:
        name, *kv = spec.split()
        bad = [k for k in kv if _touches(k.split("=", 1)[0], fixed)]
        if bad:
            raise SystemExit(f"arm {name}: {bad} change the shared base (prepare/convert/init_adapter/eval@0); "
                             "give them with --set")
        arms.append((name, kv))
    base = build_base(work, args.common)
    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.is_file() else {"arms": {}}
    for name, kv in arms:
        t0 = time.perf_counter()
        res = run_arm(work, base, name, args.common, kv)
        res.update({"command": "python benchmarks/embedded_sweep.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
                    "arm": " ".join([name, *kv]), "git_commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M")})
        doc["arms"][name] = res
        atomic_write_json(out, doc)
        print(f"{name}: greedy {res['greedy'][0]:.3f} -> {res['greedy'][1]:.3f} "
              f"(paired {res['greedy_gain_paired']:+.3f} ± {res['greedy_gain_paired_se']:.3f}), "
              f"pass@1 {res['pass_at_1'][0]:.3f} -> {res['pass_at_1'][1]:.3f}, "
              f"reward {res['reward_mean_per_step']}, {res['seconds_run']:.0f}s run "
              f"({time.perf_counter() - t0:.0f}s), peak RSS {res['peak_rss_mb']:.0f} MB", flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
