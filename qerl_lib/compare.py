"""Compare finished (or partly finished) runs side by side: the arms of an experiment.

`qerl compare bf16=runs/a nvfp4=runs/b --out DIR` reads each run's own metric files (the
same ones `report` reads: update, reward and eval metrics per step, rollout provenance) and
writes, atomically:

- `DIR/comparison.json`  per arm: the config fields in which the arms differ, eval accuracy
  at every evaluated step, and the training summary (first / early / last / mean of reward,
  entropy, KL, sigma; median wall-clock per step);
- `DIR/steps.csv`        long format, one row per (arm, step), every scalar metric;
- `DIR/eval.csv`         one row per (arm, evaluated adapter);
- `DIR/summary.md`       the tables of `comparison.json` in Markdown;
- `DIR/plots/{reward,correct,entropy,kl,sigma,step_time,accuracy}.png`, one curve per arm.

"early" is the mean over the first `early_steps` updates: the QeRL paper's claim is that a
quantized base raises policy entropy early in training, so the early mean is what to compare.
The standard error of pass@1 is sqrt(p (1 - p) / n_prompts): it treats prompts as independent
draws and ignores the (smaller) sampling noise of the k samples per prompt.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from qerl_lib.io import atomic_write_json, atomic_write_text
from qerl_lib.paths import Layout
from qerl_lib.report import (EVAL_COLUMNS, STEP_COLUMNS, Curve, _missing, _plot, _series, collect_evals, collect_steps,
                             to_csv)

PLOTTED = {
    # file name: (title, y label, metric key)
    "reward": ("training reward (mean over rollouts)", "reward", "reward_mean"),
    "correct": ("training correct rate", "share of rollouts", "correct_rate"),
    "entropy": ("policy entropy of the sampled tokens", "nats / token", "entropy"),
    "kl": ("KL to the base model", "nats / token", "kl"),
    "sigma": ("AQN sigma", "sigma", "sigma"),
    "step_time": ("wall-clock per step (rollout + update)", "seconds", "step_seconds"),
}


@dataclass(frozen=True)
class Arm:
    name: str
    root: Path
    config: dict
    """The run's resolved config (`<root>/config.yaml`), as a plain nested dict."""
    train: list[dict]
    """One merged row per step (`report.collect_steps`)."""
    evals: list[dict]
    """One row per evaluated adapter (`report.collect_evals`)."""


def load_arm(name: str, root: str | Path) -> Arm:
    layout = Layout(root)
    if not layout.config.is_file():
        raise FileNotFoundError(f"arm {name!r}: {layout.config} is missing (is {root} a qerl workspace?)")
    config = yaml.safe_load(layout.config.read_text()) or {}
    steps = int(config.get("run", {}).get("steps", 0))
    return Arm(name, Path(root), config, collect_steps(layout, steps), collect_evals(layout, steps))


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_differences(arms: list[Arm], ignore: tuple[str, ...] = ("run.root",)) -> dict[str, dict[str, Any]]:
    """{field: {arm: value}} for every config field whose value is not the same in all arms."""
    flat = {a.name: _flatten(a.config) for a in arms}
    keys = sorted(set().union(*flat.values()) - set(ignore))
    diffs = {}
    for k in keys:
        values = {name: f.get(k) for name, f in flat.items()}
        if len({repr(v) for v in values.values()}) > 1:
            diffs[k] = values
    return diffs


def _pass_at_1_errors(arm: Arm) -> list[float]:
    """sqrt(p (1 - p) / n_prompts) of each of the arm's evaluations with a pass@1 (0 without n_prompts)."""
    out = []
    for e in arm.evals:
        if _missing(e.get("pass_at_1")):
            continue
        p, n = float(e["pass_at_1"]), e.get("n_prompts") or 0
        out.append(math.sqrt(max(p * (1 - p), 0.0) / n) if n else 0.0)
    return out


def _mean(ys: list[float]) -> float | None:
    return sum(ys) / len(ys) if ys else None


def train_summary(arm: Arm, early_steps: int = 5) -> dict[str, Any]:
    """first / early / last / mean of the training curves, and wall-clock per step."""
    out: dict[str, Any] = {
        "steps_updated": sum(r.get("has_update", 0) for r in arm.train),
        # Steps whose update moved the adapter: dynamic sampling can leave a step with no group to learn from.
        "steps_trained": sum(1 for r in arm.train if (r.get("optimizer_steps") or 0) > 0),
    }
    for key in ("reward_mean", "correct_rate", "format_rate", "entropy", "kl", "sigma", "clip_frac", "kept_frac"):
        _, ys = _series(arm.train, key)
        if not ys:
            continue
        out[key] = {"first": ys[0], f"early{early_steps}": _mean(ys[:early_steps]), "last": ys[-1],
                    f"last{early_steps}": _mean(ys[-early_steps:]), "mean": _mean(ys)}
    for key in ("step_seconds", "rollout_seconds", "seconds"):
        _, ys = _series(arm.train, key)
        if ys:
            out[key] = {"median": statistics.median(ys), "mean": _mean(ys), "sum": sum(ys)}
    return out


def eval_summary(arm: Arm) -> dict[str, Any]:
    rows = []
    for r in arm.evals:
        p, n = r.get("pass_at_1"), r.get("n_prompts")
        se = math.sqrt(p * (1 - p) / n) if isinstance(p, (int, float)) and n else None
        rows.append({"step": r["step"], "pass_at_1": p, "pass_at_1_se": se, "greedy_acc": r.get("greedy_acc"),
                     "n_prompts": n, "k": r.get("k")})
    out: dict[str, Any] = {"by_step": rows}
    if rows:
        out["first"], out["last"] = rows[0], rows[-1]
    return out


def compare(arms: list[Arm], out_dir: str | Path, early_steps: int = 5) -> dict:
    """Write the comparison files of `arms` under `out_dir`; return what comparison.json holds."""
    if len({a.name for a in arms}) != len(arms):
        raise ValueError(f"arm names must be unique: {[a.name for a in arms]}")
    out_dir = Path(out_dir)
    result = {
        "arms": {a.name: {"root": str(a.root), "train": train_summary(a, early_steps), "eval": eval_summary(a)}
                 for a in arms},
        "config_differences": config_differences(arms),
        "early_steps": early_steps,
    }
    steps_rows = [{"arm": a.name, **r} for a in arms for r in a.train]
    eval_rows = [{"arm": a.name, **r} for a in arms for r in a.evals]
    atomic_write_text(out_dir / "steps.csv", to_csv(steps_rows, ("arm", *STEP_COLUMNS)))
    atomic_write_text(out_dir / "eval.csv", to_csv(eval_rows, ("arm", *EVAL_COLUMNS)))
    for fname, (title, ylabel, key) in PLOTTED.items():
        _plot(out_dir / "plots" / f"{fname}.png", title, ylabel,
              [Curve(a.name, *_series(a.train, key), "steps" if key == "sigma" else "line") for a in arms])
    # Each arm's evaluations as points with +- one standard error (sqrt(p (1 - p) / n_prompts)),
    # shifted apart a little so that arms evaluated at the same step stay visible.
    _plot(out_dir / "plots" / "accuracy.png", "held-out pass@1 (k samples per prompt, ± s.e.)", "pass@1",
          [Curve(a.name, *_series(a.evals, "pass_at_1"), "points", _pass_at_1_errors(a), 0.08 * (i - (len(arms) - 1) / 2))
           for i, a in enumerate(arms)], ymin=0.0, xlabel="adapter k (updates done)")
    atomic_write_text(out_dir / "summary.md", to_markdown(result))
    atomic_write_json(out_dir / "comparison.json", result)
    return result


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def to_markdown(result: dict) -> str:
    e = result["early_steps"]
    lines = ["| arm | pass@1 before | pass@1 after (± s.e.) | greedy before | greedy after | eval step |",
             "|---|---|---|---|---|---|"]
    for name, a in result["arms"].items():
        first, last = a["eval"].get("first", {}), a["eval"].get("last", {})
        lines.append(f"| {name} | {_fmt(first.get('pass_at_1'))} | {_fmt(last.get('pass_at_1'))} ± "
                     f"{_fmt(last.get('pass_at_1_se'))} | {_fmt(first.get('greedy_acc'))} | "
                     f"{_fmt(last.get('greedy_acc'))} | {last.get('step', '-')} |")
    lines += ["", f"| arm | updates (that trained) | reward first / early{e} / last{e} | entropy early{e} / mean | "
              f"KL last{e} | sigma first / last | s per step (median) |", "|---|---|---|---|---|---|---|"]
    for name, a in result["arms"].items():
        t = a["train"]
        r, h, k, s = (t.get(x, {}) for x in ("reward_mean", "entropy", "kl", "sigma"))
        lines.append(f"| {name} | {t.get('steps_updated')} ({t.get('steps_trained')}) | {_fmt(r.get('first'))} / {_fmt(r.get(f'early{e}'))} / "
                     f"{_fmt(r.get(f'last{e}'))} | {_fmt(h.get(f'early{e}'))} / {_fmt(h.get('mean'))} | "
                     f"{_fmt(k.get(f'last{e}'), 4)} | {_fmt(s.get('first'), 4)} / {_fmt(s.get('last'), 4)} | "
                     f"{_fmt(t.get('step_seconds', {}).get('median'), 2)} |")
    if result["config_differences"]:
        lines += ["", "Config fields that differ: " + "; ".join(
            f"`{k}` " + ", ".join(f"{arm}={v}" for arm, v in vals.items())
            for k, vals in result["config_differences"].items())]
    return "\n".join(lines) + "\n"


def parse_arm_spec(spec: str) -> tuple[str, str]:
    name, sep, root = spec.partition("=")
    if not sep or not name or not root:
        raise ValueError(f"arm {spec!r}: expected NAME=WORKSPACE, e.g. bf16=runs/smollm2_arith/bf16")
    return name, root
