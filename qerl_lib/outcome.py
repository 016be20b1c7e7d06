"""The result of a training run in three lines, for the end of `qerl run` and of the Prefect
train flow: held-out accuracy before and after with standard errors, the training reward at the
first and last step, and where the report is. Reads only the run's metric files."""

from __future__ import annotations

import json
from pathlib import Path

from qerl_lib.paths import Layout


def _read(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _acc(m: dict | None, key: str) -> str:
    """`0.188 ± 0.049` (value ± standard error over prompts), `-` when not measured."""
    if not m or not isinstance(m.get(key), (int, float)):
        return "-"
    se = m.get(f"{key}_se")
    return f"{m[key]:.3f} ± {se:.3f}" if isinstance(se, (int, float)) else f"{m[key]:.3f}"


def _delta(before: dict | None, after: dict | None, key: str) -> str:
    if not before or not after or not all(isinstance(d.get(key), (int, float)) for d in (before, after)):
        return ""
    return f" ({after[key] - before[key]:+.3f})"


def result_lines(root: str | Path, steps: int, first_eval: int = 0) -> list[str]:
    """Three lines: held-out pass@1 and greedy accuracy of adapter `first_eval` (the base) and adapter
    `steps` (± standard error over prompts; the change in brackets), the mean training reward of
    step 0 and step steps-1, and the report folder. Missing files read as `-`."""
    lay = Layout(root)
    before, after = _read(lay.eval_metrics(first_eval)), _read(lay.eval_metrics(steps))
    n = (after or before or {}).get("n_prompts", "?")
    k = (after or before or {}).get("k", "?")
    line1 = (f"held-out ({n} prompts), step {first_eval} -> {steps}: "
             f"pass@1 (k={k}) {_acc(before, 'pass_at_1')} -> {_acc(after, 'pass_at_1')}"
             f"{_delta(before, after, 'pass_at_1')}; greedy {_acc(before, 'greedy_acc')} -> "
             f"{_acc(after, 'greedy_acc')}{_delta(before, after, 'greedy_acc')}")
    r0, r1 = _read(lay.reward_metrics(0)), _read(lay.reward_metrics(steps - 1))
    fmt = lambda m: f"{m['reward_mean']:.3f}" if m and isinstance(m.get("reward_mean"), (int, float)) else "-"  # noqa: E731
    line2 = f"training reward (mean of the step's samples): step 0 {fmt(r0)}, step {steps - 1} {fmt(r1)}"
    line3 = f"report: {lay.reports_dir} (metrics.json, steps.csv, plots/*.png)"
    return [line1, line2, line3]
