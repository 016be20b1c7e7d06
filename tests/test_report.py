"""Report aggregation on fake metric files of a partially finished run."""

from __future__ import annotations

import csv
import json

import pytest

from qerl_lib.io import atomic_write_json
from qerl_lib.paths import Layout
from qerl_lib.report import PLOTS, aggregate

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_run(root, steps_with_update=(0, 1, 3), steps_with_reward=(0, 1, 2, 3), evals=(0, 4)):
    lay = Layout(root)
    for i in steps_with_update:
        atomic_write_json(lay.update_metrics(i), {
            "step": i, "loss": 0.1 * i, "entropy": 1.0 - 0.1 * i, "kl": 0.01 * i, "clip_frac": 0.02,
            "grad_norm": 1.0 + i, "sigma": [0.0, 0.01, 0.005, 0.001][i], "lr": 1e-4, "reward_mean": -9.0,
            "reward_std": 0.3, "tokens": 100, "seconds": 2.5, "timing": {"forward": 1.5}, "note": "text",
        })
    for i in steps_with_reward:
        atomic_write_json(lay.reward_metrics(i), {
            "reward_mean": 0.2 + 0.1 * i, "reward_std": 0.3, "correct_rate": 0.1 * i, "format_rate": 0.5,
            "truncated_frac": 0.25, "kept_frac": 0.75, "all_equal": False,
        })
    for k in evals:
        atomic_write_json(lay.eval_metrics(k), {"step": k, "pass_at_1": 0.2 + 0.05 * k, "greedy_acc": 0.3 + 0.02 * k,
                                                "n_prompts": 64, "k": 4})
    return lay


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_partial_run(tmp_path):
    lay = fake_run(tmp_path)
    summary = aggregate(lay, steps=4)

    rows = read_csv(lay.report_steps)
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
    header = list(rows[0])
    assert header[:4] == ["step", "reward_mean", "reward_std", "correct_rate"]
    assert "timing.forward" in header and "note" not in header
    assert float(rows[1]["reward_mean"]) == pytest.approx(0.3)  # the reward file wins over update's copy
    assert rows[2]["loss"] == "" and rows[2]["has_update"] == "0"  # step 2: rewards only
    assert float(rows[3]["sigma"]) == pytest.approx(0.001)
    assert rows[0]["all_equal"] == "0"

    ev = read_csv(lay.reports_dir / "eval.csv")
    assert [int(r["step"]) for r in ev] == [0, 4]
    assert list(ev[0])[:5] == ["step", "pass_at_1", "greedy_acc", "n_prompts", "k"]

    on_disk = json.loads(lay.report_metrics.read_text())
    assert on_disk == json.loads(json.dumps(summary))
    p = summary["progress"]
    assert (p["steps_planned"], p["steps_updated"], p["steps_rewarded"], p["evals"], p["complete"]) == (4, 3, 4, 2, 0)
    t = summary["train"]
    assert t["reward_mean_first"] == pytest.approx(0.2) and t["reward_mean_last"] == pytest.approx(0.5)
    assert t["reward_mean_mean"] == pytest.approx(0.35)
    assert t["entropy_last"] == pytest.approx(0.7) and t["sigma_max"] == pytest.approx(0.01)
    assert t["tokens_sum"] == 300 and t["seconds_sum"] == pytest.approx(7.5)
    assert t["last_step"] == 3
    e = summary["eval"]
    assert e["pass_at_1_first"] == pytest.approx(0.2) and e["pass_at_1_last"] == pytest.approx(0.4)
    assert e["pass_at_1_gain"] == pytest.approx(0.2) and e["greedy_acc_best"] == pytest.approx(0.38)
    assert e["pass_at_1_last_step"] == 4

    for name in PLOTS:
        png = lay.reports_dir / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC
    assert not [f for f in lay.reports_dir.rglob("*") if f.name.endswith(".tmp")]


def test_empty_run_still_writes_everything(tmp_path):
    lay = Layout(tmp_path)
    summary = aggregate(lay, steps=3)
    assert summary["progress"]["steps_updated"] == 0 and summary["train"] == {} and summary["eval"] == {}
    assert read_csv(lay.report_steps) == []
    assert lay.report_steps.read_text().strip() == "step"
    for name in PLOTS:
        assert (lay.reports_dir / "plots" / f"{name}.png").read_bytes()[:8] == PNG_MAGIC


def test_complete_run_and_bad_file(tmp_path):
    lay = fake_run(tmp_path, steps_with_update=(0, 1, 2, 3), evals=())
    lay.update_metrics(5).parent.mkdir(parents=True)
    lay.update_metrics(5).write_text("{not json")  # beyond `steps`: never read
    lay.reward_metrics(1).write_text("{truncated")  # unreadable: skipped, the update row stays
    summary = aggregate(lay, steps=4)
    assert summary["progress"]["complete"] == 1 and summary["progress"]["steps_rewarded"] == 3
    rows = read_csv(lay.report_steps)
    assert float(rows[1]["reward_mean"]) == pytest.approx(-9.0)  # only the update's copy is left
    assert not (lay.reports_dir / "eval.csv").read_text().strip().count("\n")
