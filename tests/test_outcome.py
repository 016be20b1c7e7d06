"""The three-line result of a run (`qerl_lib.outcome`) and the evaluation's standard error."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qerl_lib.outcome import result_lines
from qerl_lib.paths import Layout
from qerl_lib.stages.eval import standard_error


def _write(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def test_result_lines_give_accuracy_with_errors_reward_and_the_report(tmp_path):
    lay = Layout(tmp_path)
    _write(lay.eval_metrics(0), {"n_prompts": 64, "k": 1, "pass_at_1": 0.2, "pass_at_1_se": 0.05,
                                 "greedy_acc": 0.25, "greedy_acc_se": 0.054})
    _write(lay.eval_metrics(3), {"n_prompts": 64, "k": 1, "pass_at_1": 0.4, "pass_at_1_se": 0.061,
                                 "greedy_acc": 0.375, "greedy_acc_se": 0.061})
    _write(lay.reward_metrics(0), {"reward_mean": 0.125})
    _write(lay.reward_metrics(2), {"reward_mean": 0.5})
    lines = result_lines(tmp_path, 3)
    assert len(lines) == 3
    assert "64 prompts" in lines[0] and "pass@1 (k=1) 0.200 ± 0.050 -> 0.400 ± 0.061 (+0.200)" in lines[0]
    assert "greedy 0.250 ± 0.054 -> 0.375 ± 0.061 (+0.125)" in lines[0]
    assert lines[1].endswith("step 0 0.125, step 2 0.500")
    assert str(lay.reports_dir) in lines[2]


def test_result_lines_say_what_is_missing(tmp_path):
    lines = result_lines(tmp_path, 2)
    assert "pass@1 (k=?) - -> -" in lines[0] and "step 0 -, step 1 -" in lines[1]


def test_standard_error_averages_a_prompts_samples_first():
    # two prompts, k = 2: per-prompt means 1.0 and 0.0 -> std (ddof 1) 0.7071 / sqrt(2) = 0.5
    assert standard_error(np.array([1.0, 1.0, 0.0, 0.0]), ["a", "a", "b", "b"]) == pytest.approx(0.5)
    # greedy (k = 1) reduces to the binomial formula with ddof 1: sqrt(p (1 - p) n / (n - 1) / n)
    c = np.array([1.0] * 16 + [0.0] * 48)
    p, n = 0.25, 64
    assert standard_error(c, [str(i) for i in range(64)]) == pytest.approx(np.sqrt(p * (1 - p) / (n - 1)))
    assert standard_error(np.array([1.0]), ["a"]) == 0.0
