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
            "reward_std": 0.3, "tokens": 100, "update_positions": 180, "update_padded_positions": 200 + i,
            "seconds": 2.5, "timing": {"forward": 1.5}, "note": "text",
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
    assert t["update_positions_sum"] == 540 and t["update_padded_positions_sum"] == 604  # the padding's cost
    assert rows[3]["update_padded_positions"] == "203"
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


def test_plots_draw_steps_points_with_errors_and_kept_fraction(tmp_path, monkeypatch):
    """What each PNG is drawn from: sigma as steps with AQN stage 0 shaded, evaluations as points
    with standard-error bars on an axis from 0, the reward band inside the scored rewards' range,
    and the kept fraction / truncation rate (clip_frac, always 0 with one mini-batch, is gone)."""
    import math

    import pyarrow as pa
    import pyarrow.parquet as pq

    from qerl_lib import report

    lay = fake_run(tmp_path)
    for i, stage in zip((0, 1, 3), (0, 1, 3)):  # update.json's aqn_stage, as the update stage writes it
        obj = json.loads(lay.update_metrics(i).read_text())
        atomic_write_json(lay.update_metrics(i), {**obj, "aqn_stage": stage})
    # step 0's rewards: mean 0.2 +- std 0.3 would reach -0.1; the scored rewards span [0, 1.1].
    lay.scored(0).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"reward": [0.0, 0.0, 0.1, 1.1]}), lay.scored(0))
    # eval 4's samples: 3 prompts x (2 sampled + 1 greedy) rows.
    pq.write_table(pa.table({"prompt_id": ["a", "a", "b", "b", "c", "c", "a", "b", "c"],
                             "temperature": [0.6] * 6 + [0.0] * 3,
                             "reward_correct": [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]}),
                   lay.eval_samples(4))
    drawn = {}
    real_plot = report._plot
    monkeypatch.setattr(report, "_plot", lambda dest, *a, **kw: drawn.setdefault(dest.stem, (a, kw)) and real_plot(
        dest, *a, **kw))
    aggregate(lay, steps=4)
    assert set(drawn) == set(PLOTS) and "kept" in PLOTS

    (_, _, sigma), kw = drawn["sigma"]
    assert sigma[0].style == "steps" and sigma[0].xs == [0, 1, 3] and kw["ymin"] == 0.0
    assert kw["spans"] == ((0, 1, "stage 0: no noise"),)

    (_, _, acc), kw = drawn["accuracy"]
    p1, greedy = acc[0], acc[1]
    assert (p1.style, greedy.style) == ("points", "points") and kw["ymin"] == 0.0
    se0 = math.sqrt(0.2 * 0.8 / 64)  # eval 0 has no samples file: binomial over its 64 prompts
    sampled = [0.5, 1.0, 0.0]  # eval 4: per-prompt accuracy of the sampled rows
    se4 = math.sqrt(sum((v - 0.5) ** 2 for v in sampled) / 2 / 3)
    assert p1.yerr == pytest.approx([se0, se4])
    assert greedy.yerr[1] == pytest.approx(math.sqrt(sum((v - 2 / 3) ** 2 for v in (1, 1, 0)) / 2 / 3))
    ev = read_csv(lay.reports_dir / "eval.csv")
    assert float(ev[1]["pass_at_1_se"]) == pytest.approx(se4)
    assert json.loads(lay.report_metrics.read_text())["eval"]["pass_at_1_last_se"] == pytest.approx(se4)

    (_, _, _, (xs, lo, hi)), _ = drawn["reward"]
    assert xs == [0, 1, 2, 3] and lo[0] == pytest.approx(0.0) and hi[0] == pytest.approx(0.5)
    assert hi[1] == pytest.approx(0.6)  # no scored file at step 1: the band is mean +- std

    (_, _, kept), _ = drawn["kept"]
    assert [c[0].split(" ")[0] for c in kept] == ["kept", "truncation"]
    labels = [c[0] if isinstance(c, tuple) else c.label for a, _ in drawn.values() for c in a[2]]
    assert labels and not [lb for lb in labels if "clip" in lb]
