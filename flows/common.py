"""What the three flows share: the workspace, its lock, params.yaml, the stage list, the
artifacts shown in the Prefect UI, and the orchestration timing summary.

A workspace is a git + DVC repository holding `dvc.yaml` and `params.yaml` (the project's
repository root is one; the tests make temporary ones). Flows write params.yaml through
`qerl plan` (so its `plan` lists match `run.steps` / `eval.every`) and run DVC stages in
the order of `qerl_lib.run.plan`, one Prefect task per stage (`tasks.stage.run_stage`).
"""

from __future__ import annotations

import base64
import json
import math
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

FLOW_LOCK = ".dvc/tmp/qerl-flow.lock"  # inside .dvc/tmp: ignored by git and by DVC
SPARK = "▁▂▃▄▅▆▇█"


class WorkspaceError(RuntimeError):
    """The workspace cannot be used (not a DVC repository, busy, bad params)."""


# ----------------------------------------------------------------------------- workspace


def resolve_workspace(workspace: str | os.PathLike) -> Path:
    ws = Path(workspace).expanduser().resolve()
    if not ws.is_dir():
        raise WorkspaceError(f"workspace {ws} does not exist")
    missing = [name for name in ("dvc.yaml", ".dvc") if not (ws / name).exists()]
    if missing:
        raise WorkspaceError(
            f"workspace {ws} is not a qerl DVC workspace (no {', '.join(missing)}): use the qerl repository "
            "root, or make one with `git init && dvc init` and a copy of qerl's dvc.yaml"
        )
    return ws


@contextmanager
def flow_lock(ws: Path, label: str) -> Iterator[None]:
    """One flow per workspace, and no `qerl run` beside it.

    - an exclusive `flock` on `.dvc/tmp/qerl-flow.lock`: a second flow in the same workspace
      is refused at once, with the holder named;
    - a shared `flock` on `.qerl.lock` for the whole flow, the lock `qerl stage` shares and
      `qerl run` takes exclusively: a whole-run `qerl run` is refused while the flow runs
      (and the flow is refused while one runs).
    The kernel drops both when the holder dies (SIGKILL included): a killed flow never
    blocks the next one.
    """
    from qerl_lib import locks

    note = f"{label} (pid {os.getpid()})"
    try:
        fd = locks.acquire(ws / FLOW_LOCK, True, note)
    except locks.Busy as e:
        raise WorkspaceError(
            f"workspace {ws} is in use by {e.holder}: a second run was not started. Wait for it to finish "
            "(or kill it; running this again then resumes where it stopped), or use another workspace."
        ) from None
    try:
        try:
            run_fd = locks.acquire(locks.workspace_lock_path(ws), False, note)
        except locks.Busy as e:
            raise WorkspaceError(
                f"workspace {ws} is in use by {e.holder} (a whole `qerl run`): the flow was not started"
            ) from None
        try:
            yield
        finally:
            locks.release(run_fd)
    finally:
        locks.release(fd)


def _qerl() -> list[str]:
    return [sys.executable, "-m", "qerl_lib"]


def dump_value(value: Any) -> str:
    """A value for `--set key=VALUE` (parsed as YAML there; JSON is YAML)."""
    return json.dumps(value)


def flatten(tree: dict, prefix: str = "") -> list[str]:
    """{"rollout": {"group_size": 8}} -> ["rollout.group_size=8"]."""
    out = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out += flatten(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={dump_value(value)}")
    return out


def write_params(ws: Path, config: str | None, overrides: list[str] | None, settings: dict | None, log) -> Path:
    """Write `ws/params.yaml` with `qerl plan` from `config` (a YAML path, relative to the
    workspace; None or params.yaml itself: the current params.yaml), `overrides`
    (`section.key=value`) and `settings` (a nested dict, applied last). Returns its path."""
    cmd = [*_qerl(), "plan", "--params", "params.yaml"]
    if config:
        src = Path(config).expanduser()
        src = src if src.is_absolute() else ws / src
        if not src.is_file():
            raise WorkspaceError(f"config file not found: {src}")
        cmd += ["--config", str(src)]
    for pair in [*(overrides or []), *flatten(settings or {})]:
        cmd += ["--set", pair]
    from tasks.stage import stage_env

    out = subprocess.run(cmd, cwd=ws, env=stage_env(), capture_output=True, text=True, timeout=300)
    for line in (out.stdout + out.stderr).splitlines():
        if line.strip():
            log.info(line)
    if out.returncode != 0:
        why = (out.stderr.strip() or out.stdout.strip()).replace("qerl: error: ", "")
        raise WorkspaceError(f"qerl plan refused the config: {why}")
    return ws / "params.yaml"


def load_params(ws: Path):
    from qerl_lib.config import load_config

    return load_config(ws / "params.yaml")


@contextmanager
def workspace_run(workspace: str, config: str | None, overrides: list[str] | None, settings: dict | None,
                  log) -> Iterator[tuple[Path, Any]]:
    """The preamble of every flow: the workspace resolved and locked for this flow run, its
    params.yaml written from (config, overrides, settings); yields (workspace, resolved config)."""
    from prefect.runtime import flow_run

    ws = resolve_workspace(workspace)
    with flow_lock(ws, f"Prefect flow run {flow_run.name!r} ({flow_run.id})"):
        write_params(ws, config, overrides, settings, log)
        yield ws, load_params(ws)


def stage_list(cfg, ws: Path) -> list[str]:
    """DVC stage names in the order `qerl run` runs them (topological: `--single-item` runs
    no upstream stage, so the order carries the dependencies)."""
    from qerl_lib.paths import Layout
    from qerl_lib.run import plan

    return [call.label for call in plan(cfg, Layout(ws))]


def dvc_stage_names(ws: Path) -> set[str]:
    from tasks.stage import _sibling, stage_env

    out = subprocess.run([_sibling("dvc"), "stage", "list", "--name-only"], cwd=ws, env=stage_env(),
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise WorkspaceError(f"`dvc stage list` failed in {ws}: {(out.stderr or out.stdout).strip()[-800:]}")
    return {line.strip() for line in out.stdout.splitlines() if line.strip()}


def dvc_changed(ws: Path, log=None) -> set[str] | None:
    """Names of the stages `dvc status` reports as changed (None if it could not tell)."""
    from tasks.stage import _sibling, stage_env

    t0 = time.perf_counter()
    out = subprocess.run([_sibling("dvc"), "status", "--json"], cwd=ws, env=stage_env(), capture_output=True,
                         text=True, timeout=600)
    try:
        changed = set(json.loads(out.stdout or "{}")) if out.returncode == 0 else None
    except ValueError:
        changed = None
    if log is not None:
        log.info("dvc status: %s changed stage(s) (%.1fs)", "?" if changed is None else len(changed),
                 time.perf_counter() - t0)
    return changed


def check_stages(ws: Path, stages: list[str]) -> None:
    known = dvc_stage_names(ws)
    missing = [s for s in stages if s not in known]
    if missing:
        raise WorkspaceError(
            f"dvc.yaml of {ws} has no stage {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; "
            "is params.yaml's plan current (`qerl plan`) and dvc.yaml qerl's?"
        )


# ----------------------------------------------------------------------------- artifacts

STEP_TABLE_COLUMNS = ("step", "reward_mean", "reward_std", "correct_rate", "format_rate", "kept_frac",
                      "truncated_frac", "entropy", "kl", "clip_frac", "loss", "grad_norm", "sigma", "lr",
                      "tokens", "rollout_seconds", "seconds", "step_seconds")
EVAL_TABLE_COLUMNS = ("step", "pass_at_1", "greedy_acc", "n_prompts", "k", "seconds")


def _clean(value: Any) -> Any:
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return float(f"{value:.4g}")
    return value


def step_rows(ws: Path, steps: int) -> list[dict]:
    """Per-step metrics (update + reward files of each step done so far)."""
    from qerl_lib.paths import Layout
    from qerl_lib.report import collect_steps

    rows = collect_steps(Layout(ws), steps)
    return [{c: _clean(r.get(c)) for c in STEP_TABLE_COLUMNS if c in r or c == "step"} for r in rows]


def eval_rows(ws: Path, steps: int) -> list[dict]:
    from qerl_lib.paths import Layout
    from qerl_lib.report import collect_evals

    rows = collect_evals(Layout(ws), steps)
    return [{c: _clean(r.get(c)) for c in EVAL_TABLE_COLUMNS if c in r or c == "step"} for r in rows]


def sparkline(values: list[float | None]) -> str:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    span = hi - lo
    out = []
    for v in values:
        if v is None or not math.isfinite(v):
            out.append(" ")
        else:
            out.append(SPARK[int(round((v - lo) / span * (len(SPARK) - 1)))] if span > 0 else SPARK[3])
    return "".join(out)


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def png_data_uri(path: Path) -> str | None:
    try:
        return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    except OSError:
        return None


def curves_markdown(ws: Path, cfg, title: str, plots: tuple[str, ...] = ("reward", "entropy")) -> str:
    """The run report: summary, the curves as embedded PNGs (data URIs) and as text sparklines,
    the per-step and per-eval tables."""
    steps = cfg.run.steps
    rows, evals = step_rows(ws, steps), eval_rows(ws, steps)
    summary_path = ws / "reports" / "metrics.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    prog = summary.get("progress", {})
    md = [f"# {title}", ""]
    md.append(f"workspace `{ws}` · base `{cfg.model.base}` ({cfg.model.quant}) · loss `{cfg.algo.loss}` · "
              f"LoRA r={cfg.lora.r} · AQN {'on' if cfg.aqn.enabled else 'off'} "
              f"(K={cfg.aqn.stages}, {cfg.aqn.sigma_start:g} → {cfg.aqn.sigma_end:g}, {cfg.aqn.schedule}) · "
              f"{cfg.rollout.prompts_per_step} prompts × G={cfg.rollout.group_size} per step")
    md.append("")
    md.append(f"steps updated **{prog.get('steps_updated', len(rows))} / {steps}**, evaluations "
              f"**{prog.get('evals', len(evals))}**")
    md.append("")
    # Curves as text: render anywhere, whatever the viewer does with images.
    series = [("reward_mean", [r.get("reward_mean") for r in rows]),
              ("correct_rate", [r.get("correct_rate") for r in rows]),
              ("entropy", [r.get("entropy") for r in rows]),
              ("kl", [r.get("kl") for r in rows]),
              ("sigma (AQN)", [r.get("sigma") for r in rows]),
              ("eval pass@1", [e.get("pass_at_1") for e in evals]),
              ("eval greedy", [e.get("greedy_acc") for e in evals])]
    md += ["| curve | first | last | min | max | trend |", "| --- | --- | --- | --- | --- | --- |"]
    for name, ys in series:
        finite = [y for y in ys if y is not None]
        if not finite:
            continue
        md.append(f"| {name} | {_fmt(finite[0])} | {_fmt(finite[-1])} | {_fmt(min(finite))} | {_fmt(max(finite))} "
                  f"| `{sparkline(ys)}` |")
    md.append("")
    for name in plots:
        uri = png_data_uri(ws / "reports" / "plots" / f"{name}.png")
        if uri:
            md += [f"## {name}", "", f"![{name} curve]({uri})", ""]
    if rows:
        cols = [c for c in ("step", "reward_mean", "correct_rate", "format_rate", "entropy", "kl", "clip_frac",
                            "sigma", "loss", "kept_frac", "step_seconds") if any(c in r for r in rows)]
        md += ["## per step", "", "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
        md += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
        md.append("")
    if evals:
        md += ["## evaluation (adapter k = after k updates)", "", "| k | pass@1 | greedy | prompts | samples/prompt |",
               "| --- | --- | --- | --- | --- |"]
        md += [f"| {e['step']} | {_fmt(e.get('pass_at_1'))} | {_fmt(e.get('greedy_acc'))} | {_fmt(e.get('n_prompts'))} "
               f"| {_fmt(e.get('k'))} |" for e in evals]
        md.append("")
    md += ["## where the artifacts are", "",
           f"rollouts `{ws}/rollouts/step=*/rollouts.parquet` (audit: `qerl audit summary`), scored rollouts "
           f"`rewards/step=*/scored.parquet`, adapters `adapters/step=*` (PEFT), metrics `metrics/step=*/update.json`, "
           f"evaluation `eval/step=*/`, report `reports/` (`dvc plots show`, `dvc metrics show`)."]
    return "\n".join(md) + "\n"


def timing_markdown(records: list[dict]) -> str:
    md = ["## orchestration", "",
          "| stage | status | task s | dvc s | command s | own work s | GPU slot wait s |",
          "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        md.append(f"| {r['stage']} | {r['status']} | {_fmt(r.get('task_s'))} | {_fmt(r.get('dvc_s'))} | "
                  f"{_fmt(r.get('cmd_s'))} | {_fmt(r.get('work_s'))} | {_fmt(r.get('slot_wait_s'))} |")
    s = overhead_summary(records)
    if s["stages_ran"]:
        md += ["", f"Per executed stage, on average: Prefect {s['prefect_s_per_stage']:.2f} s, DVC "
                   f"{s['dvc_s_per_stage']:.2f} s, stage process start-up {_fmt(s['startup_s_per_stage'])} s, "
                   f"stage's own work {_fmt(s['work_s_per_stage'])} s."]
    return "\n".join(md) + "\n"


def overhead_summary(records: list[dict]) -> dict:
    """Seconds of orchestration against the stages' own work, from the task records.

    task_s (flow side, around the task call) - dvc_s + gap_s (the flow's own work between two
    stages: progress and table artifacts) = Prefect's share (task run bookkeeping, API calls,
    GPU slot, artifacts); dvc_s - cmd_s = DVC's (start-up, hashing, locks, dvc.lock);
    cmd_s - work_s = the stage process's start-up (imports, model load) that its own
    timer does not see; work_s = what the stage measured itself.
    """
    ran = [r for r in records if r.get("status") == "ran"]
    skipped = [r for r in records if r.get("status") in ("skipped", "restored")]

    def total(rs, key):
        return sum(r[key] for r in rs if r.get(key) is not None)

    def per(rs, key):
        vals = [r[key] for r in rs if r.get(key) is not None]
        return round(sum(vals) / len(vals), 3) if vals else None

    prefect = [r["task_s"] - r["dvc_s"] + (r.get("gap_s") or 0.0) for r in ran if r.get("task_s") is not None]
    dvc = [r["dvc_s"] - r["cmd_s"] for r in ran if r.get("cmd_s") is not None]
    startup = [r["cmd_s"] - r["work_s"] for r in ran if r.get("cmd_s") is not None and r.get("work_s") is not None]
    return {
        "stages_ran": len(ran),
        "stages_skipped": len(skipped),
        "prefect_s": round(sum(prefect), 3),
        "dvc_s": round(sum(dvc), 3),
        "startup_s": round(sum(startup), 3),
        "work_s": round(total(ran, "work_s"), 3),
        "prefect_s_per_stage": round(sum(prefect) / len(prefect), 3) if prefect else 0.0,
        "dvc_s_per_stage": round(sum(dvc) / len(dvc), 3) if dvc else 0.0,
        "startup_s_per_stage": round(sum(startup) / len(startup), 3) if startup else None,
        "work_s_per_stage": per(ran, "work_s"),
        "skip_task_s_per_stage": per(skipped, "task_s"),
    }


def now() -> float:
    return time.perf_counter()


# ----------------------------------------------------------------------------- running stages


def run_stages(ws: Path, stages: list[str], log, retries: int, progress_key: str, title: str,
               on_done=None, fast_skip: bool = True, before=None) -> list[dict]:
    """Run `stages` in order, one Prefect task each, with a progress artifact updated after
    every stage. `on_done(stage, record)` runs after each stage (artifacts). Returns the
    records; a failing stage fails the flow after the progress artifact says where.

    `fast_skip`: one `dvc status` first; the leading stages it reports unchanged are marked
    up to date without a `dvc repro` each (about 1 s apiece: on resuming a long run, most of
    the wait). From the first stage that DVC reports changed on, every stage goes through
    `dvc repro --single-item`, since a stage that runs can make later ones stale.
    `before(stage)` runs before each stage that goes to DVC (the rollout server starts there).
    """
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    from contextlib import nullcontext

    from tasks.gpu import gpu_slot
    from tasks.stage import is_gpu_stage, run_stage

    task = run_stage.with_options(retries=retries)
    n = len(stages)
    progress_id = create_progress_artifact(0.0, key=progress_key, description=f"{title}: 0/{n} stages")
    records: list[dict] = []
    changed = dvc_changed(ws, log) if fast_skip else None
    leading = changed is not None
    t_prev = time.perf_counter()
    for i, stage in enumerate(stages):
        if leading and stage not in changed and stage != "report":
            records.append({"stage": stage, "status": "skipped", "via": "dvc status", "task_s": None, "dvc_s": None,
                            "cmd_s": None, "work_s": None, "slot_wait_s": 0.0})
            continue
        if leading and i:
            log.info("%d leading stage(s) up to date per `dvc status` (%s ... %s): not run again",
                     i, stages[0], stages[i - 1])
            update_progress_artifact(progress_id, 100.0 * i / n, description=f"{title}: {i}/{n} stages up to date")
        leading = False
        if before is not None:
            before(stage)
        t0 = time.perf_counter()
        try:
            # GPU stages hold the qerl-gpu slot from here, around the task run (the task sees it
            # held and does not take it again): taken inside the task, the slot request races the
            # task run's own state writes in a SQLite-backed server and loses ~2 s to its retry.
            with (gpu_slot(log) if is_gpu_stage(stage) else nullcontext({"wait_s": 0.0})) as slot:
                rec = task(str(ws), stage)
            rec["slot_wait_s"] = slot["wait_s"]
        except BaseException as e:
            update_progress_artifact(progress_id, 100.0 * i / n,
                                     description=f"{title}: FAILED at {stage} ({type(e).__name__}) after {i}/{n} "
                                                 "stages; run the flow again to resume")
            raise
        t_end = time.perf_counter()
        rec["task_s"] = round(t_end - t0, 3)
        rec["gap_s"] = round(t0 - t_prev, 3)  # flow-side work since the previous stage (artifacts, ...)
        records.append(rec)
        done = sum(r["status"] == "ran" for r in records)
        update_progress_artifact(progress_id, 100.0 * (i + 1) / n,
                                 description=f"{title}: {i + 1}/{n} stages ({done} ran, {i + 1 - done} up to date); "
                                             f"last {stage}")
        if on_done is not None:
            on_done(stage, rec)
        t_prev = t_end
    return records
