"""`qerl compare`: the arms of an experiment side by side, from each run's own metric files."""

from __future__ import annotations

import csv
import json
import shutil

import pytest
import yaml
from conftest import sh

from qerl_lib.paths import Layout


@pytest.fixture(scope="module")
def two_arms(reference_run, tmp_path_factory):
    """The reference run, and a copy of it whose config says AQN sigma_start 0.05 (a second arm)."""
    other = tmp_path_factory.mktemp("arm_b") / "ws"
    shutil.copytree(reference_run, other)
    cfg = yaml.safe_load((other / "config.yaml").read_text())
    cfg["aqn"]["sigma_start"] = 0.05
    (other / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return reference_run, other


def test_compare_writes_every_file_from_the_runs_metrics(two_arms, tmp_path):
    a, b = two_arms
    out = tmp_path / "cmp"
    res = sh(["qerl", "compare", f"ref={a}", f"noisier={b}", "--out", str(out)], cwd=tmp_path, timeout=300)
    assert "comparison of 2 arm(s)" in res.stdout
    comp = json.loads((out / "comparison.json").read_text())
    # Only the edited field differs (run.root is ignored).
    assert comp["config_differences"] == {"aqn.sigma_start": {"ref": 0.01, "noisier": 0.05}}

    steps = int(yaml.safe_load((a / "config.yaml").read_text())["run"]["steps"])
    lay = Layout(a)
    last_eval = json.loads(lay.eval_metrics(steps).read_text())
    assert comp["arms"]["ref"]["eval"]["last"]["pass_at_1"] == pytest.approx(last_eval["pass_at_1"])
    assert comp["arms"]["ref"]["eval"]["last"]["step"] == steps
    update0 = json.loads(lay.update_metrics(0).read_text())
    assert comp["arms"]["ref"]["train"]["entropy"]["first"] == pytest.approx(update0["entropy"])
    assert comp["arms"]["ref"]["train"]["steps_updated"] == steps
    trained = sum(json.loads(lay.update_metrics(s).read_text())["optimizer_steps"] > 0 for s in range(steps))
    assert comp["arms"]["ref"]["train"]["steps_trained"] == trained
    assert f"| ref | {steps} ({trained}) |" in (out / "summary.md").read_text()

    rows = list(csv.DictReader((out / "steps.csv").open()))
    assert [(r["arm"], int(r["step"])) for r in rows] == [(n, s) for n in ("ref", "noisier") for s in range(steps)]
    evals = list(csv.DictReader((out / "eval.csv").open()))
    assert {r["arm"] for r in evals} == {"ref", "noisier"}
    for name in ("reward", "correct", "entropy", "kl", "sigma", "step_time", "accuracy"):
        assert (out / "plots" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    summary = (out / "summary.md").read_text()
    assert "| ref |" in summary and "| noisier |" in summary and "aqn.sigma_start" in summary


def test_compare_names_a_missing_workspace_and_bad_specs(reference_run, tmp_path):
    missing = tmp_path / "nowhere"
    res = sh(["qerl", "compare", f"ref={reference_run}", f"gone={missing}", "--out", str(tmp_path / "o")],
             cwd=tmp_path, check=False, timeout=300)
    assert res.returncode != 0 and "gone" in res.stderr and str(missing) in res.stderr
    assert not (tmp_path / "o").exists()  # nothing half-written

    from qerl_lib.compare import compare, load_arm, parse_arm_spec

    with pytest.raises(ValueError, match="NAME=WORKSPACE"):
        parse_arm_spec(str(reference_run))
    arm = load_arm("x", reference_run)
    with pytest.raises(ValueError, match="unique"):
        compare([arm, arm], tmp_path / "dup")
