"""Issue 16's committed results (`experiments/qwen05_gsm8k/results`) against their own files and the docs.

`summarize.py` recomputes `summary.json` from the committed per-run files alone (no archive): it must
give the committed summary, so no figure in it was edited by hand or left stale by a later archive.
The rows carry the fields the issue asks for, and the figures that `README.md` and
`docs/results_qwen05_gsm8k.md` quote for the three main arms are the summary's, at three decimals.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXP = ROOT / "experiments" / "qwen05_gsm8k"
RESULTS = EXP / "results"
MAIN_ARMS = ("bf16", "nvfp4", "nvfp4_aqn")


@pytest.fixture(scope="module")
def summarize():
    spec = importlib.util.spec_from_file_location("qwen05_summarize", EXP / "summarize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def committed() -> dict:
    return json.loads((RESULTS / "summary.json").read_text())


def test_summary_is_recomputed_from_the_committed_runs(summarize, committed, tmp_path):
    out = tmp_path / "results"
    shutil.copytree(RESULTS / "runs", out / "runs")
    summarize.collect([], out)
    assert summarize.summarize(out) == committed


def test_rows_carry_the_fields_the_issue_asks_for(committed):
    rows = committed["rows"]
    for r in rows:
        for key in ("arm", "seed", "steps", "greedy_acc", "pass1", "n_test"):
            assert key in r, (r.get("arm"), r.get("seed"), key)
        assert r["n_test"] == 1319, (r["arm"], r["seed"])
    assert [r for r in rows if r["arm"] == "base"], "no base row"
    for arm in MAIN_ARMS:
        assert committed["per_arm"][arm]["seeds"] == [0, 1, 2], arm
        assert all(r["steps"] >= 60 for r in rows if r["arm"] == arm)


@pytest.mark.parametrize("doc", ["README.md", "docs/results_qwen05_gsm8k.md"])
def test_docs_quote_the_summary(committed, doc):
    text = (ROOT / doc).read_text()
    for arm in MAIN_ARMS:
        a = committed["per_arm"][arm]
        for mean, std in ((a["greedy_acc"], a["greedy_acc_std"]), (a["pass1"], a["pass1_std"])):
            quoted = f"{mean:.3f} ± {std:.3f}"
            assert quoted in text, f"{doc}: {arm} should quote {quoted} (results/summary.json)"
