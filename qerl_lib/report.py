"""Aggregate a run's per-step metric files into DVC metrics, DVC plot tables and PNG curves.

Reads, for each step i in 0..steps-1, whichever of these exist (a partially finished run is
reported as far as it got):

- `layout.update_metrics(i)`  train metrics of update i: step, loss, entropy, kl, clip_frac,
  grad_norm, sigma, lr, reward_mean, reward_std, tokens, update_positions, update_padded_positions,
  seconds, ... (any scalar keys);
- `layout.reward_metrics(i)`  reward_mean, reward_std, correct_rate, format_rate,
  truncated_frac, kept_frac, ...;
- `provenance.json` beside `layout.rollouts(i)`: its `seconds` become `rollout_seconds`, and
  `step_seconds` = rollout_seconds + the update's `seconds` (the step's own work, without
  process start-up or orchestration);
and for each k in 0..steps `layout.eval_metrics(k)`: step, pass_at_1, greedy_acc, n_prompts, k.

Writes (atomically):

- `layout.report_steps`            CSV, one row per step that has any file (`dvc plots`);
- `layout.reports_dir/eval.csv`    CSV, one row per evaluated adapter, with the standard errors
  `pass_at_1_se` / `greedy_acc_se` over prompts (`eval_standard_errors`);
- `layout.report_metrics`          JSON summary (`dvc metrics show`), also returned: groups
  `progress`, `train`, `eval` (DVC shows them as `progress.*`, `train.*`, `eval.*`);
- `layout.reports_dir/plots/{reward,entropy,sigma,accuracy,kl,kept,time}.png` (always all seven; a
  curve with no data yet shows "no data", so DVC outputs exist from the first step on). Sigma is
  drawn as steps with AQN's noise-free stage 0 shaded; evaluations as points with standard-error
  bars on an accuracy axis from 0; the reward band (mean +- std) within the scored rewards' range;
  `kept` is the share of samples trained on and the truncation rate.

Besides the metric files, the report reads the `reward` column of `scored.parquet` (the band's
range) and the eval samples (the standard errors): both are inputs of the DVC report stage.

Where the update and reward files share a key (reward_mean, reward_std), the reward file wins:
it is the stage that computed the number.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qerl_lib.io import atomic_path, atomic_write_json, atomic_write_text
from qerl_lib.paths import Layout

log = logging.getLogger(__name__)

PLOTS = ("reward", "entropy", "sigma", "accuracy", "kl", "kept", "time")

# Preferred column order; any other scalar key found in the files follows, sorted.
STEP_COLUMNS = (
    "step", "reward_mean", "reward_std", "correct_rate", "format_rate", "truncated_frac", "kept_frac",
    "loss", "entropy", "kl", "clip_frac", "grad_norm", "sigma", "lr", "tokens", "seconds",
    "rollout_seconds", "step_seconds",
)
EVAL_COLUMNS = ("step", "pass_at_1", "greedy_acc", "n_prompts", "k", "pass_at_1_se", "greedy_acc_se")

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
    # real and padded positions of the update's micro-batches (`optim.sort_micro_batches`): the padding's cost
    "update_positions": ("sum",),
    "update_padded_positions": ("sum",),
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
        for where, row in (("first", evals[[e["step"] for e in evals].index(xs[0])]),
                           ("last", evals[[e["step"] for e in evals].index(xs[-1])])):
            if not _missing(row.get(f"{key}_se")):
                out["eval"][f"{key}_{where}_se"] = row[f"{key}_se"]
    return out


# --------------------------------------------------------------------------- standard errors and ranges


def _column(path: Path, names: list[str]) -> dict[str, list] | None:
    """Columns `names` of a Parquet file as lists, or None when it is absent or unreadable."""
    if not path.is_file():
        return None
    try:
        import pyarrow.parquet as pq

        return pq.read_table(path, columns=names).to_pydict()
    except Exception as e:  # noqa: BLE001 - a damaged file only costs the error bar / band
        log.warning("report: skipping unreadable %s (%s)", path, e)
        return None


def standard_error(values: list[float]) -> float | None:
    """Standard error of the mean of `values` (per-prompt accuracies): sample std (n - 1) / sqrt(n);
    None below two values."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def eval_standard_errors(layout: Layout, row: dict) -> dict[str, float]:
    """`pass_at_1_se` and `greedy_acc_se` of one eval row: the standard error over prompts.

    Taken from the eval metrics when they hold it; else from `eval/step=k/samples.parquet`: each
    prompt's accuracy (its correct share of the k sampled rows, or its greedy row: temperature 0),
    and the standard error of their mean (`standard_error`), which counts both the prompt-to-prompt
    spread and the sampling noise of k samples; else sqrt(p (1 - p) / n_prompts), the binomial
    error over prompts (for pass@1 an upper bound: a prompt's mean of k samples varies less)."""
    out = {f"{k}_se": row[f"{k}_se"] for k in ("pass_at_1", "greedy_acc") if isinstance(row.get(f"{k}_se"), float)}
    cols = _column(layout.eval_samples(row["step"]), ["prompt_id", "temperature", "reward_correct"])
    for key, greedy in (("pass_at_1", False), ("greedy_acc", True)):
        if f"{key}_se" in out or _missing(row.get(key)):
            continue
        se = None
        if cols is not None:
            per: dict[str, list[float]] = {}
            for pid, t, c in zip(cols["prompt_id"], cols["temperature"], cols["reward_correct"]):
                if (t == 0.0) == greedy and c is not None:
                    per.setdefault(pid, []).append(1.0 if c > 0 else 0.0)
            se = standard_error([sum(v) / len(v) for v in per.values()])
        n = row.get("n_prompts")
        if se is None and isinstance(n, (int, float)) and n > 0:
            p = float(row[key])
            se = math.sqrt(max(p * (1 - p), 0.0) / n)
        if se is not None:
            out[f"{key}_se"] = se
    return out


def reward_range(layout: Layout, step: int) -> tuple[float, float] | None:
    """(min, max) of the rewards scored at `step` (`rewards/step=i/scored.parquet`): the range a
    mean +- std band is clipped to (the std of a skewed group reaches past both)."""
    cols = _column(layout.scored(step), ["reward"])
    vals = [v for v in (cols or {}).get("reward", []) if v is not None and math.isfinite(v)]
    return (min(vals), max(vals)) if vals else None


# --------------------------------------------------------------------------- plots


@dataclass
class Curve:
    """One series of a plot."""

    label: str
    xs: list[int]
    ys: list[float]
    style: str = "line"
    """`line` (points joined), `steps` (each value holds until the next step: drawstyle steps-post,
    the last one for one step more) or `points` (no line: separate measurements, `yerr` as bars)."""
    yerr: list[float] | None = None
    """Error bar half-widths (one per point; `points` only)."""
    offset: float = 0.0
    """Horizontal shift of `points`, so that two series measured at the same x do not hide each other."""


def _draw(ax, i: int, c: Curve) -> None:
    color = f"C{i}"
    if c.style == "steps":
        xs, ys = list(c.xs) + [c.xs[-1] + 1], list(c.ys) + [c.ys[-1]]
        ax.plot(xs, ys, drawstyle="steps-post", label=c.label, color=color)
        ax.plot(c.xs, c.ys, "o", markersize=3, color=color)
    elif c.style == "points":
        ax.errorbar([x + c.offset for x in c.xs], c.ys, yerr=c.yerr, fmt="o", markersize=5, capsize=4,
                    label=c.label + (" (± s.e.)" if c.yerr else ""), color=color)
    else:
        ax.plot(c.xs, c.ys, marker="o", markersize=3, label=c.label, color=color)


def _plot(dest: Path, title: str, ylabel: str, curves: list, band=None, ymin: float | None = None,
          spans: tuple = (), xlabel: str = "RL step") -> Path:
    """One PNG: `curves` (`Curve`, or (label, x, y) drawn as lines); `band` (x, lo, hi) shades
    e.g. reward +- std around the first curve; `ymin` fixes the bottom of the y axis (0 for rates);
    `spans` ((x0, x1, text), ...) shades and names ranges of steps (AQN's noise-free stage 0)."""
    # A bare Figure with the Agg canvas: no pyplot global state, no backend switching.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    curves = [c if isinstance(c, Curve) else Curve(*c) for c in curves]
    if band is not None and band[0]:
        ax.fill_between(band[0], band[1], band[2], color="C0", alpha=0.2, linewidth=0)
    for x0, x1, text in spans:
        ax.axvspan(x0, x1, color="0.6", alpha=0.15, linewidth=0)
        ax.text((x0 + x1) / 2, 0.5, text, transform=ax.get_xaxis_transform(), ha="center", va="center", fontsize=8,
                color="0.3")
    drawn = False
    for i, c in enumerate(curves):
        if c.xs:
            _draw(ax, i, c)
            drawn = True
    if drawn:
        ax.legend(loc="best", fontsize=8)
        if ymin is not None:
            ax.set_ylim(bottom=ymin, top=max(ax.get_ylim()[1], ymin + 1e-3))
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(dest, suffix=".png") as tmp:
        fig.savefig(tmp, format="png")
    return dest


def _reward_band(layout: Layout | None, train: list[dict]):
    """(x, lo, hi): reward mean +- std per step, clipped to the step's observed reward range."""
    rx, ry = _series(train, "reward_mean")
    sx, sd = _series(train, "reward_std")
    if not rx or sx != rx:
        return None
    lo, hi = [m - d for m, d in zip(ry, sd)], [m + d for m, d in zip(ry, sd)]
    for j, x in enumerate(rx):
        rng = reward_range(layout, x) if layout is not None else None
        if rng is not None:
            lo[j], hi[j] = max(lo[j], rng[0]), min(hi[j], rng[1])
    return rx, lo, hi


def _noise_free_spans(train: list[dict]) -> tuple:
    """The steps of AQN stage 0 (`aqn_stage` 0 in update.json, else sigma 0 before the first
    noisy step) as one shaded span, when some later step is noisy."""
    stage0 = [r["step"] for r in train if r.get("aqn_stage") == 0 or ("aqn_stage" not in r and r.get("sigma") == 0)]
    noisy = [r["step"] for r in train if not _missing(r.get("sigma")) and r["sigma"] > 0]
    if not stage0 or not noisy:
        return ()
    return ((min(stage0), max(stage0) + 1, "stage 0: no noise"),)


def write_plots(plots_dir: Path, train: list[dict], evals: list[dict], layout: Layout | None = None) -> list[Path]:
    """The six PNGs of `PLOTS`. `layout` (the workspace) lets the reward band be clipped to the
    scored rewards' range; evals carry `*_se` for their error bars (`eval_standard_errors`)."""
    s = lambda rows, key: _series(rows, key)  # noqa: E731

    def evals_curve(key: str, label: str, offset: float) -> Curve:
        pts = [(e["step"], float(e[key]), e.get(f"{key}_se")) for e in evals if not _missing(e.get(key))]
        errs = [0.0 if _missing(se) else float(se) for _, _, se in pts]
        return Curve(label, [p[0] for p in pts], [p[1] for p in pts], "points",
                     errs if any(errs) else None, offset)

    out = [
        _plot(plots_dir / "reward.png", "reward of the training rollouts", "reward (rates: share of samples)",
              [("reward mean (band: ± std, within the rewards' range)", *s(train, "reward_mean")),
               ("correct rate", *s(train, "correct_rate")), ("format rate", *s(train, "format_rate"))],
              _reward_band(layout, train)),
        _plot(plots_dir / "entropy.png", "policy entropy of the sampled tokens", "nats / token",
              [("entropy", *s(train, "entropy"))]),
        _plot(plots_dir / "sigma.png", "AQN noise sigma (held for the whole step)", "sigma",
              [Curve("sigma", *s(train, "sigma"), "steps")], ymin=0.0, spans=_noise_free_spans(train)),
        _plot(plots_dir / "accuracy.png", "held-out accuracy of adapter k (k = updates done)", "accuracy",
              [evals_curve("pass_at_1", "eval pass@1", -0.06), evals_curve("greedy_acc", "eval greedy", 0.06),
               ("train correct rate", *s(train, "correct_rate"))], ymin=0.0, xlabel="step / adapter k"),
        _plot(plots_dir / "kl.png", "KL to the reference (adapter off)", "nats / token", [("kl", *s(train, "kl"))]),
        _plot(plots_dir / "kept.png", "samples trained on, and cut at max_new_tokens", "share of samples",
              [("kept fraction (dynamic sampling, overlong filter)", *s(train, "kept_frac")),
               ("truncation rate", *s(train, "truncated_frac"))], ymin=0.0),
        _plot(plots_dir / "time.png", "step time (stage work)", "seconds",
              [("step (rollout + update)", *s(train, "step_seconds")), ("rollout", *s(train, "rollout_seconds")),
               ("update", *s(train, "seconds"))], ymin=0.0),
    ]
    return out


# --------------------------------------------------------------------------- entry


def aggregate(layout: Layout, steps: int) -> dict:
    """Read every metric file of the run, write steps.csv, eval.csv, metrics.json and the PNGs;
    return the summary written to `layout.report_metrics`."""
    train = collect_steps(layout, steps)
    evals = [{**e, **eval_standard_errors(layout, e)} for e in collect_evals(layout, steps)]
    atomic_write_text(layout.report_steps, to_csv(train, STEP_COLUMNS))
    atomic_write_text(layout.reports_dir / "eval.csv", to_csv(evals, EVAL_COLUMNS))
    summary = summarize(train, evals, steps)
    atomic_write_json(layout.report_metrics, summary)
    write_plots(layout.plots_dir, train, evals, layout)
    return summary
