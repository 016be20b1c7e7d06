"""Seconds per RL step when every stage is its own process talking to one rollout server, against
one `qerl run` process, in the same call (issue: one engine for every door).

    python benchmarks/orchestrated_step.py --config .device/rl/bench.yaml --steps 3 \
        --out benchmarks/results/orchestrated_step.json

Both arms start from copies of one prepared workspace (prepare, convert, init_adapter done: the
config's run.root) and run the same steps:
- orchestrated: `qerl serve` once, then per step `qerl stage rollout|reward|update` as separate
  processes, the way a Prefect task or `dvc repro --single-item` runs them (DVC's own ~1 s per
  stage is not in it: its wheels do not travel to the GPU machine). A step's seconds are the wall
  seconds of its three processes.
- single process: `qerl run` with the in-process engine; a step's seconds are its three stages'
  (`reports/stage_times.jsonl`). Its engine starts in eval@0, before the first step.

Engine starts are counted from the processes' logs ("vLLM engine for ... started" of an in-process
engine) plus the one server. Writes `orchestrated_s_per_step`, `single_process_s_per_step`,
`ratio`, `engine_starts` and the per-step breakdown.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP_STAGES = ("rollout", "reward", "update")
ENGINE_START = "vLLM engine for"


def _qerl(*args: str) -> list[str]:
    return [sys.executable, "-m", "qerl_lib", "-v", *args]


def _copy_prepared(src: Path, dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for sub in ("data", "models", "adapters"):
        shutil.copytree(src / sub, dest / sub)


def _run(cmd: list[str], log, env: dict) -> tuple[float, str]:
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    log.write(f"$ {' '.join(cmd[2:])}\n{res.stdout}{res.stderr}\n")
    log.flush()
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[2:])} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return wall, res.stdout + res.stderr


def _work_seconds(root: Path, step: int) -> dict:
    """The seconds each stage measured for its own work (the rest of a process's wall time is
    start-up: interpreter, imports, config, model load)."""
    from qerl_lib.paths import Layout

    lay = Layout(root)
    out = {}
    for name, path in (("rollout_work_s", lay.rollout_provenance(step)), ("update_work_s", lay.update_metrics(step))):
        try:
            out[name] = json.loads(path.read_text()).get("seconds")
        except (OSError, ValueError):
            out[name] = None
    return out


def orchestrated(cfg: Path, root: Path, steps: int, sets: list[str], log, env: dict) -> dict:
    serve_log = open(root.parent / f"{root.name}.serve.log", "w")
    t0 = time.perf_counter()
    server = subprocess.Popen(_qerl("serve", "-c", str(cfg), "--root", str(root), *sets), cwd=ROOT, env=env,
                              stdout=serve_log, stderr=subprocess.STDOUT, start_new_session=True)
    addr = root / "rollout_server.json"
    try:
        while not addr.is_file():
            if server.poll() is not None:
                raise SystemExit(f"qerl serve exited with {server.returncode}: see {serve_log.name}")
            time.sleep(0.5)
        startup = time.perf_counter() - t0
        per_step, starts = [], 0
        for i in range(steps):
            rec = {"step": i}
            for stage in STEP_STAGES:
                wall, out = _run(_qerl("stage", stage, "--step", str(i), "-c", str(cfg), "--root", str(root), *sets),
                                 log, env)
                rec[f"{stage}_s"] = round(wall, 3)
                starts += out.count(ENGINE_START)
            rec["step_s"] = round(sum(rec[f"{s}_s"] for s in STEP_STAGES), 3)
            rec.update(_work_seconds(root, i))
            per_step.append(rec)
            print(f"orchestrated step {i}: {rec}", flush=True)
        client = json.loads((root / "rollout_client.json").read_text()) if (root / "rollout_client.json").is_file() else {}
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
        serve_log.close()
    return {"server_startup_s": round(startup, 3), "steps": per_step, "engine_starts": 1 + starts, "client": client}


def single_process(cfg: Path, root: Path, steps: int, sets: list[str], log, env: dict) -> dict:
    t0 = time.perf_counter()
    _, out = _run(_qerl("run", "-c", str(cfg), "--root", str(root), *sets), log, env)
    wall = time.perf_counter() - t0
    recs = [json.loads(line) for line in (root / "reports" / "stage_times.jsonl").read_text().splitlines() if line]
    per_step = []
    for i in range(steps):
        rec = {"step": i}
        for stage in STEP_STAGES:
            rec[f"{stage}_s"] = round(sum(r["seconds"] for r in recs if r["stage"] == stage and r["step"] == i), 3)
        rec["step_s"] = round(sum(rec[f"{s}_s"] for s in STEP_STAGES), 3)
        per_step.append(rec)
    evals = {r["step"]: r["seconds"] for r in recs if r["stage"] == "eval"}
    engine = json.loads((root / "vllm_engine.json").read_text()) if (root / "vllm_engine.json").is_file() else {}
    return {"wall_s": round(wall, 3), "steps": per_step, "eval_s": evals, "engine_starts": out.count(ENGINE_START),
            "engine": engine}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", "-c", type=Path, required=True, help="qerl config of a prepared workspace (run.root)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--set", "-s", dest="sets", action="append", default=[], help="config override for both arms")
    p.add_argument("--work", type=Path, default=Path("/tmp/qerl-orchestrated"), help="scratch directory")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/orchestrated_step.json")
    args = p.parse_args(argv)
    import yaml

    from qerl_lib.io import atomic_write_json

    tree = yaml.safe_load(args.config.read_text())
    src = (ROOT / tree["run"]["root"]).resolve()
    sets = [x for kv in [*args.sets, f"run.steps={args.steps}"] for x in ("-s", kv)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("QERL_ROLLOUT_SERVER", None)
    args.work.mkdir(parents=True, exist_ok=True)
    log = open(args.work / "stages.log", "w")
    a, b = args.work / "orchestrated", args.work / "single"
    _copy_prepared(src, a)
    _copy_prepared(src, b)
    orch = orchestrated(args.config.resolve(), a, args.steps, sets, log, env)
    single = single_process(args.config.resolve(), b, args.steps, sets, log, {**env, "QERL_ROLLOUT_SERVER": "off"})

    def mean(rs):
        return sum(r["step_s"] for r in rs) / max(len(rs), 1)

    import pyarrow.parquet as pq

    # Rows, not file bytes: the files' metadata holds the git commit, which a dirty tree changes.
    same = all(pq.read_table(a / f"rollouts/step={i}/rollouts.parquet").equals(
        pq.read_table(b / f"rollouts/step={i}/rollouts.parquet")) for i in range(args.steps))
    result = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        "config": tree, "overrides": args.sets, "steps": args.steps,
        "orchestrated_s_per_step": round(mean(orch["steps"]), 3),
        "single_process_s_per_step": round(mean(single["steps"]), 3),
        "ratio": round(mean(orch["steps"]) / max(mean(single["steps"]), 1e-9), 3),
        "engine_starts": orch["engine_starts"],
        "single_process_engine_starts": single["engine_starts"],
        "rollouts_identical": same,
        "orchestrated": orch, "single_process": single,
        "host": os.uname().nodename, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, result)
    print(json.dumps({k: result[k] for k in ("orchestrated_s_per_step", "single_process_s_per_step", "ratio",
                                             "engine_starts", "rollouts_identical")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
