"""Seconds of Prefect orchestration per RL step: the "prefect" column of
benchmarks/results/orchestration_overhead.json (benchmarks/orchestration_overhead.py measures
the DVC side and calls `measure()` below; this script alone measures only the Prefect side).

    python benchmarks/prefect_overhead.py [--steps 3] [--base tiny|smollm2|PATH] [--set key=value ...]

Builds a temporary git + DVC repository laid out like this one, writes params.yaml with
`qerl plan` from the same config as orchestration_overhead.py, and runs the `qerl-train` flow
in this process (an ephemeral Prefect server, or the one PREFECT_API_URL names). Each stage is
one Prefect task running `dvc repro --single-item STAGE`; the task records (tasks/stage.py,
flows/common.py):

- task_s: the task call as the flow sees it (task run bookkeeping, GPU slot, the dvc process);
- gap_s: the flow's own work since the previous stage (progress and table artifacts);
- dvc_s: the `dvc repro --single-item` process (DVC start-up, hashing, locks, dvc.lock, the command);
- cmd_s: the stage command as seen in DVC's output (from "> qerl stage ..." to "Updating lock file");
- work_s: the seconds the stage recorded for its own work (rollout / eval: provenance.json,
  update: update.json; the rest record none: their command time counts as work).

Per stage: Prefect = task_s - dvc_s + gap_s; DVC = dvc_s - cmd_s; stage start-up (Python, imports,
model load) = cmd_s - work_s. Per RL step i: sums over rollout@i, reward@i, update@i. Once per
flow run: the Prefect start-up (ephemeral server, flow run) and the flow's set-up (`qerl plan`,
`dvc stage list`, `dvc status`). Then the flow again on the finished workspace (the cost of a
resume that finds nothing to do).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

ENV = {"DVC_NO_ANALYTICS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
       "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false",
       "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120", "GIT_TERMINAL_PROMPT": "0",
       "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@example.invalid",
       "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@example.invalid"}
STEP_STAGES = ("rollout", "reward", "update")


def _run(args, cwd, env):
    res = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, args))} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res


def make_repo(dest: Path, tree: dict, env: dict, overrides: list[str] = ()) -> Path:
    """A git + DVC repository laid out like the project, params.yaml from `tree`."""
    import yaml

    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    _run(["git", "init", "-q"], dest, env)
    _run(["dvc", "init", "-q"], dest, env)
    for name in ("dvc.yaml", ".dvcignore", ".gitignore"):
        shutil.copy(ROOT / name, dest / name)
    shutil.copytree(ROOT / "qerl_lib", dest / "qerl_lib", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (dest / "bench.yaml").write_text(yaml.safe_dump(tree))
    _run(["qerl", "plan", "-c", "bench.yaml", *sum((["-s", o] for o in overrides), [])], dest, env)
    return dest


def bench_tree(base: str, smollm2: bool = False) -> dict:
    """The config of orchestration_overhead.py (kept equal by hand: same numbers, same column)."""
    tree = {
        "model": {"base": base},
        "data": {"synthetic_train": 64, "synthetic_test": 8},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 16, "batch_size": 16},
        "reward": {"overlong_buffer": 16},
        "eval": {"max_prompts": 4, "k": 1, "max_new_tokens": 16},
        "aqn": {"stages": 2},
    }
    if smollm2:
        tree["reward"] = {}
        tree["rollout"]["max_new_tokens"] = 32
    return tree


def _stage_rows(records: list[dict]) -> list[dict]:
    rows = []
    for r in records:
        if r.get("status") != "ran":
            continue
        cmd = r.get("cmd_s")
        work = r.get("work_s")
        rows.append({
            "stage": r["stage"],
            "prefect_s": round(r["task_s"] - r["dvc_s"] + (r.get("gap_s") or 0.0), 3),
            "dvc_s": round(r["dvc_s"] - cmd, 3) if cmd is not None else None,
            "command_s": cmd,
            "work_s": round(work if work is not None else cmd, 3) if cmd is not None else None,
            "work_recorded": work is not None,
            "startup_s": round(cmd - work, 3) if (cmd is not None and work is not None) else 0.0,
            "gpu_slot_wait_s": r.get("slot_wait_s", 0.0),
        })
    return rows


def measure(tree: dict, work: Path, steps: int, overrides: list[str] = ()) -> dict:
    """Run the qerl-train flow on a fresh repository of `tree` (run.steps = `steps`) and on the
    finished one again; return the "prefect" record of orchestration_overhead.json."""
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    from importlib.metadata import version

    from flows.train import train  # after the environment: Prefect reads its settings at import

    env = dict(os.environ)
    tree = json.loads(json.dumps(tree))
    tree.setdefault("run", {})["steps"] = steps
    repo = make_repo(work / "prefect_repo", tree, env, overrides)

    t0 = time.perf_counter()
    result = train(workspace=str(repo))
    wall = time.perf_counter() - t0
    t1 = time.perf_counter()
    again = train(workspace=str(repo))
    noop = time.perf_counter() - t1
    assert not [r for r in again["stages"] if r["status"] == "ran"], "the second flow run re-ran a stage"

    per_stage = _stage_rows(result["stages"])
    per_step = []
    for i in range(steps):
        rows = [r for r in per_stage if r["stage"] in {f"{n}@{i}" for n in STEP_STAGES}]
        per_step.append({"step": i, **{k: round(sum(r[k] or 0.0 for r in rows), 3)
                                       for k in ("prefect_s", "dvc_s", "command_s", "work_s", "startup_s")}})
    o = result["overhead"]
    mean = lambda key: round(statistics.mean(s[key] for s in per_step), 3)  # noqa: E731
    return {
        "version": version("prefect"),
        "server": os.environ.get("PREFECT_API_URL") or "ephemeral (started by the flow)",
        "flow_wall_s": round(wall, 3),
        "prefect_startup_s": round(wall - o["flow_s"], 3),
        "flow_setup_s": o["flow_setup_s"],
        "stages_wall_s": round(sum(r["task_s"] for r in result["stages"] if r.get("task_s") is not None), 3),
        "per_step_mean": {
            "prefect_s": mean("prefect_s"),
            "dvc_s": mean("dvc_s"),
            "command_s": mean("command_s"),
            "work_s": mean("work_s"),
            "startup_s": mean("startup_s"),
            "prefect_per_stage_s": round(statistics.mean(r["prefect_s"] for r in per_stage), 3),
            "dvc_single_item_per_stage_s": round(statistics.mean(r["dvc_s"] for r in per_stage
                                                                 if r["dvc_s"] is not None), 3),
        },
        "per_step": per_step,
        "per_stage": per_stage,
        "noop_flow_s": round(noop, 3),
        "noop_flow": {"stages_skipped": again["overhead"]["stages_skipped"],
                      "flow_s": again["overhead"]["flow_s"]},
    }


def describe(p: dict) -> str:
    m = p["per_step_mean"]
    return (f"Prefect per RL step {m['prefect_s']:.2f} s ({m['prefect_per_stage_s']:.2f} s a stage), DVC "
            f"--single-item {m['dvc_s']:.2f} s, stage start-up {m['startup_s']:.2f} s, stage work {m['work_s']:.2f} s; "
            f"once per flow run: Prefect start-up {p['prefect_startup_s']:.1f} s, set-up {p['flow_setup_s']:.1f} s; "
            f"no-op flow (resume with nothing to do) {p['noop_flow_s']:.1f} s")


def merge_into(out: Path, prefect: dict, extra: dict | None = None, key: str = "prefect") -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    merged = json.loads(out.read_text()) if out.is_file() else {}
    merged.update(extra or {})
    merged[key] = prefect
    out.write_text(json.dumps(merged, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--base", default="tiny", help="tiny (random, built in code), smollm2, or a model path")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--work", default=None, help="scratch directory (default: a temporary one, removed)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "orchestration_overhead.json"))
    ap.add_argument("--key", default=None,
                    help='JSON key to write (default: "prefect" for the tiny model, "prefect_<base>" otherwise)')
    args = ap.parse_args()
    from orchestration_overhead import base_model

    work = Path(args.work or tempfile.mkdtemp(prefix="qerl-prefect-"))
    work.mkdir(parents=True, exist_ok=True)
    tree = bench_tree(base_model(args.base, work), args.base == "smollm2")
    p = measure(tree, work, args.steps, args.overrides)
    p["config"] = {"steps": args.steps, "base": args.base, **{k: v for k, v in tree.items() if k != "model"}}
    key = args.key or ("prefect" if args.base == "tiny" else f"prefect_{Path(args.base).name}")
    merge_into(Path(args.out), p, {"machine_prefect": {"cpus": os.cpu_count(), "platform": platform.platform()}}, key)
    print(f"{'stage':<14}{'prefect_s':>10}{'dvc_s':>8}{'command_s':>11}{'work_s':>9}")
    for r in p["per_stage"]:
        print(f"{r['stage']:<14}{r['prefect_s']:>10.2f}{(r['dvc_s'] or 0):>8.2f}{(r['command_s'] or 0):>11.2f}"
              f"{(r['work_s'] or 0):>9.2f}")
    print(describe(p))
    print(f"-> {args.out}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
