"""Aggregate a run's per-step metric files into DVC metrics, DVC plot tables and PNG curves.

Reads, for each step i in 0..steps-1, whichever of these exist (a partially finished run is
reported as far as it got):

- `layout.update_metrics(i)`  train metrics of update i: step, loss, entropy, kl, clip_frac,
  grad_norm, sigma, lr, reward_mean, reward_std, tokens, seconds, ... (any scalar keys);
- `layout.reward_metrics(i)`  reward_mean, reward_std, correct_rate, format_rate,
  truncated_frac, kept_frac, ...;
- `provenance.json` beside `layout.rollouts(i)`: its `seconds` become `rollout_seconds`, and
  `step_seconds` = rollout_seconds + the update's `seconds` (the step's own work, without
  process start-up or orchestration);
and for each k in 0..steps `layout.eval_metrics(k)`: step, pass_at_1, greedy_acc, n_prompts, k.

Writes (atomically):

- `layout.report_steps`            CSV, one row per step that has any file (`dvc plots`);
- `layout.reports_dir/eval.csv`    CSV, one row per evaluated adapter;
- `layout.report_metrics`          JSON summary (`dvc metrics show`), also returned;
- `layout.reports_dir/plots/{reward,entropy,sigma,accuracy,kl,time}.png`  (always all six; a curve
  with no data yet shows "no data", so DVC outputs exist from the first step on).

Where the update and reward files share a key (reward_mean, reward_std), the reward file wins:
it is the stage that computed the number.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
from pathlib import Path
from typing import Any

from qerl_lib.io import atomic_path, atomic_write_json, atomic_write_text
from qerl_lib.paths import Layout

log = logging.getLogger(__name__)

PLOTS = ("reward", "entropy", "sigma", "accuracy", "kl", "time")

# Preferred column order; any other scalar key found in the files follows, sorted.
STEP_COLUMNS = (
    "step", "reward_mean", "reward_std", "correct_rate", "format_rate", "truncated_frac", "kept_frac",
    "loss", "entropy", "kl", "clip_frac", "grad_norm", "sigma", "lr", "tokens", "seconds",
    "rollout_seconds", "step_seconds",
)
EVAL_COLUMNS = ("step", "pass_at_1", "greedy_acc", "n_prompts", "k")

# Summary of training: (key, how) -> summary["train"][f"{key}_{how}"]
_TRAIN_SUMMARY = {
    "reward_mean": ("first", "last", "mean", "max"),
    "correct_rate": ("first", "last", "max"),
    "format_rate": ("first", "last"),
    "entropy": ("first", "last", "mean"),
    "kl": ("last", "mean"),
    "clip_frac": ("last", "mean"),
    "grad_norm": ("last", "max"),
    "sigma": ("last", "max"),
    "loss": ("last",),
    "truncated_frac": ("last",),
    "kept_frac": ("last", "mean"),
    "tokens": ("sum",),
    "seconds": ("sum",),
    "step_seconds": ("mean", "sum"),
}


def _read(path: Path) -> dict | None:
    """A metrics JSON object, or None when absent or unreadable (reported, not fatal)."""
    if not path.is_file():
        return None
    try:
        obj = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        log.warning("report: skipping unreadable %s (%s)", path, e)
        return None
    return obj if isinstance(obj, dict) else None


def _scalars(obj: dict, prefix: str = "") -> dict[str, float | int]:
    """Numeric leaves of a (nested) dict, nested keys joined with '.'; bools become 0/1."""
    out: dict[str, float | int] = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_scalars(value, f"{name}."))
        elif isinstance(value, bool):
            out[name] = int(value)
        elif isinstance(value, (int, float)):
            out[name] = value
    return out


def collect_steps(layout: Layout, steps: int) -> list[dict]:
    """One merged row per step that has an update or reward file, in step order."""
    rows = []
    for i in range(steps):
        upd, rew = _read(layout.update_metrics(i)), _read(layout.reward_metrics(i))
        if upd is None and rew is None:
            continue
        row: dict[str, Any] = {}
        row.update(_scalars(upd or {}))
        row.update(_scalars(rew or {}))
        prov = _read(layout.rollouts(i).with_name("provenance.json")) or {}
        if isinstance(prov.get("seconds"), (int, float)):
            row["rollout_seconds"] = prov["seconds"]
            if isinstance((upd or {}).get("seconds"), (int, float)):
                row["step_seconds"] = round(prov["seconds"] + upd["seconds"], 3)
        row["step"] = i
        row["has_update"] = int(upd is not None)
        row["has_reward"] = int(rew is not None)
        rows.append(row)
    return rows


def collect_evals(layout: Layout, steps: int) -> list[dict]:
    """One row per evaluated adapter k in 0..steps (adapter k = after k updates)."""
    rows = []
    for k in range(steps + 1):
        obj = _read(layout.eval_metrics(k))
        if obj is None:
            continue
        row = _scalars(obj)
        row["step"] = k
        rows.append(row)
    return rows


def _columns(rows: list[dict], preferred: tuple[str, ...]) -> list[str]:
    seen = {k for r in rows for k in r}
    return [c for c in preferred if c in seen or c == "step"] + sorted(seen - set(preferred))


def to_csv(rows: list[dict], preferred: tuple[str, ...]) -> str:
    """CSV text; missing cells are empty; non-finite floats are written empty too."""
    cols = _columns(rows, preferred)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=cols, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({c: ("" if _missing(r.get(c)) else r[c]) for c in cols})
    return buf.getvalue()


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and not math.isfinite(v))


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], float(r[key])) for r in rows if not _missing(r.get(key))]
    return [p[0] for p in pts], [p[1] for p in pts]


def summarize(train: list[dict], evals: list[dict], steps: int) -> dict:
    """The `dvc metrics` summary: progress, first/last/mean/max of training curves, eval accuracy."""
    updated = sum(r.get("has_update", 0) for r in train)
    out: dict[str, Any] = {
        "progress": {
            "steps_planned": steps,
            "steps_updated": updated,
            "steps_rewarded": sum(r.get("has_reward", 0) for r in train),
            "evals": len(evals),
            "complete": int(updated == steps),
        },
        "train": {},
        "eval": {},
    }
    for key, hows in _TRAIN_SUMMARY.items():
        _, ys = _series(train, key)
        if not ys:
            continue
        for how in hows:
            value = {"first": ys[0], "last": ys[-1], "mean": sum(ys) / len(ys), "max": max(ys), "sum": sum(ys)}[how]
            out["train"][f"{key}_{how}"] = value
    if train:
        out["train"]["last_step"] = train[-1]["step"]
    for key in ("pass_at_1", "greedy_acc"):
        xs, ys = _series(evals, key)
        if not ys:
            continue
        out["eval"][f"{key}_first"] = ys[0]
        out["eval"][f"{key}_last"] = ys[-1]
        out["eval"][f"{key}_best"] = max(ys)
        out["eval"][f"{key}_gain"] = ys[-1] - ys[0]
        out["eval"][f"{key}_first_step"] = xs[0]
        out["eval"][f"{key}_last_step"] = xs[-1]
    return out


# --------------------------------------------------------------------------- plots


def _plot(dest: Path, title: str, ylabel: str, curves: list[tuple[str, list[int], list[float]]], band=None) -> Path:
    """One PNG: `curves` of (label, x, y); `band` (x, lo, hi) shades e.g. reward +- std."""
    # A bare Figure with the Agg canvas: no pyplot global state, no backend switching.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    drawn = False
    if band is not None and band[0]:
        ax.fill_between(band[0], band[1], band[2], color="C0", alpha=0.2, linewidth=0)
    for i, (label, xs, ys) in enumerate(curves):
        if xs:
            ax.plot(xs, ys, marker="o", markersize=3, label=label, color=f"C{i}")
            drawn = True
    if drawn:
        ax.legend(loc="best", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(dest, suffix=".png") as tmp:
        fig.savefig(tmp, format="png")
    return dest


def write_plots(plots_dir: Path, train: list[dict], evals: list[dict]) -> list[Path]:
    s = lambda rows, key: _series(rows, key)  # noqa: E731
    rx, ry = s(train, "reward_mean")
    band = None
    sx, sd = s(train, "reward_std")
    if rx and sx == rx:
        band = (rx, [m - d for m, d in zip(ry, sd)], [m + d for m, d in zip(ry, sd)])
    out = [
        _plot(plots_dir / "reward.png", "reward", "reward",
              [("reward_mean (+-std)", rx, ry), ("correct_rate", *s(train, "correct_rate")),
               ("format_rate", *s(train, "format_rate"))], band),
        _plot(plots_dir / "entropy.png", "policy entropy", "nats / token", [("entropy", *s(train, "entropy"))]),
        _plot(plots_dir / "sigma.png", "AQN sigma", "sigma", [("sigma", *s(train, "sigma"))]),
        _plot(plots_dir / "accuracy.png", "accuracy", "accuracy",
              [("eval pass@1", *s(evals, "pass_at_1")), ("eval greedy", *s(evals, "greedy_acc")),
               ("train correct_rate", *s(train, "correct_rate"))]),
        _plot(plots_dir / "kl.png", "KL to reference / clipping", "value",
              [("kl", *s(train, "kl")), ("clip_frac", *s(train, "clip_frac"))]),
        _plot(plots_dir / "time.png", "step time (stage work)", "seconds",
              [("step (rollout + update)", *s(train, "step_seconds")), ("rollout", *s(train, "rollout_seconds")),
               ("update", *s(train, "seconds"))]),
    ]
    return out


# --------------------------------------------------------------------------- entry


def aggregate(layout: Layout, steps: int) -> dict:
    """Read every metric file of the run, write steps.csv, eval.csv, metrics.json and the PNGs;
    return the summary written to `layout.report_metrics`."""
    train = collect_steps(layout, steps)
    evals = collect_evals(layout, steps)
    atomic_write_text(layout.report_steps, to_csv(train, STEP_COLUMNS))
    atomic_write_text(layout.reports_dir / "eval.csv", to_csv(evals, EVAL_COLUMNS))
    summary = summarize(train, evals, steps)
    atomic_write_json(layout.report_metrics, summary)
    write_plots(layout.reports_dir / "plots", train, evals)
    return summary
