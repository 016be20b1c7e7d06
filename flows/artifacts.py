"""The Prefect UI's tables and report of a workspace: per-step rows (a core table and its
details), one `qerl-train-steps` artifact per step, eval rows, the markdown run report with
embedded PNG curves and text sparklines, and the orchestration timing table.

Values come from the stage metric files through `qerl_lib.report` (the same rows as
`reports/steps.csv`); floats are rounded to 4 significant digits for display.
"""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path
from typing import Any

from qerl_lib.paths import Layout

SPARK = "▁▂▃▄▅▆▇█"

STEP_CORE_COLUMNS = ("step", "reward_mean", "correct_rate", "format_rate", "kept_frac", "truncated_frac",
                     "entropy", "kl", "sigma", "step_seconds")
"""The per-step table a reader scans: is the reward rising, how much is trained on, noise, time."""
STEP_DETAIL_COLUMNS = ("step", "reward_std", "loss", "grad_norm", "clip_frac", "lr", "tokens",
                       "rollout_seconds", "seconds")
"""The rest of a step's metrics (the optimizer's side and the split of the step's seconds)."""
STEP_TABLE_COLUMNS = STEP_CORE_COLUMNS + STEP_DETAIL_COLUMNS[1:]
EVAL_TABLE_COLUMNS = ("step", "pass_at_1", "greedy_acc", "n_prompts", "k", "seconds")


def _clean(value: Any) -> Any:
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return float(f"{value:.4g}")
    return value


def step_rows(ws: Path, steps: int, columns: tuple[str, ...] = STEP_TABLE_COLUMNS) -> list[dict]:
    """Per-step metrics (update + reward files of each step done so far), `columns` only."""
    from qerl_lib.paths import Layout
    from qerl_lib.report import collect_steps

    rows = collect_steps(Layout(ws), steps)
    return [{c: _clean(r.get(c)) for c in columns if c in r or c == "step"} for r in rows]


def step_artifact(ws: Path, steps: int, step: int) -> tuple[list[dict], str] | None:
    """What the `qerl-train-steps` artifact of RL step `step` holds: that step's row of the core
    columns, and a description with the step's details (`STEP_DETAIL_COLUMNS`). None when the
    step has no metrics yet. One artifact per step, so the flow run's artifact list holds each
    step once; the whole table is in the run report (`curves_markdown`)."""
    rows = [r for r in step_rows(ws, steps) if r["step"] == step]
    if not rows:
        return None
    row = rows[0]
    details = " · ".join(f"{c} {_fmt(row[c])}" for c in STEP_DETAIL_COLUMNS[1:] if c in row)
    core = [{c: row[c] for c in STEP_CORE_COLUMNS if c in row}]
    return core, f"step {step} of {steps} ({ws.name}); details: {details}"


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
    summary_path = Layout(ws).report_metrics
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
        uri = png_data_uri(Layout(ws).plot(name))
        if uri:
            md += [f"## {name}", "", f"![{name} curve]({uri})", ""]
    for heading, wanted in (("per step", STEP_CORE_COLUMNS), ("per step, details", STEP_DETAIL_COLUMNS)):
        cols = [c for c in wanted if any(c in r for r in rows)]
        if rows and len(cols) > 1:
            md += [f"## {heading}", "", "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
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
