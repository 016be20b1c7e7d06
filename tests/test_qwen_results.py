"""Issue 16's committed results (`experiments/qwen05_gsm8k/results`) against their own files and the docs.

`summarize.py` recomputes `summary.json` from the committed per-run files alone (no archive): it must
give the committed summary, so no figure in it was edited by hand or left stale by a later archive.
The rows carry the fields the issue asks for, and the figures that `README.md` and
`docs/results_qwen05_gsm8k.md` quote for the three main arms are the summary's, at three decimals.
Recipe 2 (`experiments/qwen05_gsm8k_v2/results`) is held to the same: its summary recomputes from its
runs (base rows from recipe 1's summary, by checkpoint hash), and the docs quote its arms.
"""

from __future__ import annotations

import csv
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


def test_a_later_recipe_reuses_the_base_of_the_same_checkpoint(summarize, committed, tmp_path):
    """`--base-from`: runs that did not evaluate their base take the base row of another summary
    whose checkpoint hash is theirs; any other checkpoint is refused with the file named."""
    out = tmp_path / "results"
    for run in ("nvfp4/seed2", "nvfp4_aqn/seed2"):  # neither evaluated its base (eval.base false)
        shutil.copytree(RESULTS / "runs" / run, out / "runs" / run)
    assert summarize.summarize(out)["base"] == []
    got = summarize.summarize(out, base_from=RESULTS / "summary.json")
    want = [r for r in committed["base"] if r["arm"] == "base_nvfp4"]
    assert [{k: v for k, v in r.items() if k != "from_summary"} for r in got["base"]] == want
    assert got["base"][0]["from_summary"] == str(RESULTS / "summary.json") and got["rows"][0] == got["base"][0]

    report = out / "runs" / "nvfp4" / "seed2" / "convert_report.json"
    report.write_text(json.dumps({**json.loads(report.read_text()), "checkpoint_hash": "f" * 64}))
    with pytest.raises(ValueError, match=r"nvfp4_aqn/seed2/convert_report.json: checkpoint 9c056d81\w+, but other "
                                         r"nvfp4 runs of .* trained on f{64}"):
        summarize.summarize(out, base_from=RESULTS / "summary.json")
    shutil.rmtree(out / "runs" / "nvfp4_aqn")
    # a base the other summary never measured (the first recipe's NF4) stays absent
    assert summarize.reuse_base([], {"base_nf4": "0" * 64}, RESULTS / "summary.json") == []
    with pytest.raises(ValueError, match=r"summary.json: no `base_nvfp4` row for checkpoint f{64}"):
        summarize.summarize(out, base_from=RESULTS / "summary.json")


def test_an_observer_arm_has_its_own_base(summarize, tmp_path):
    """A run whose config sets another `model.nvfp4_observer` trained on another NVFP4 checkpoint: its base
    is `base_nvfp4_<observer>`, never mixed up with min-max's `base_nvfp4`, and no other summary's row stands
    for it."""
    out = tmp_path / "results"
    shutil.copytree(RESULTS / "runs" / "nvfp4" / "seed0", out / "runs" / "nvfp4" / "seed0")
    run = out / "runs" / "nvfp4_aqn_mse" / "seed0"
    shutil.copytree(RESULTS / "runs" / "nvfp4_aqn" / "seed0", run)
    cfg = run / "config.yaml"
    cfg.write_text(cfg.read_text().replace("  quant: nvfp4\n", "  quant: nvfp4\n  nvfp4_observer: nvfp4_expanded_mse\n"))
    report = run / "convert_report.json"
    report.write_text(json.dumps({**json.loads(report.read_text()), "checkpoint_hash": "e" * 64}))
    got = summarize.summarize(out, base_from=RESULTS / "summary.json")  # no hash clash with min-max's runs
    assert {r["arm"] for r in got["base"]} == {"base_nvfp4"}  # nvfp4 seed 0 measured min-max's own
    assert {r["arm"] for r in got["rows"]} >= {"nvfp4", "nvfp4_aqn_mse"} and "nvfp4_aqn_mse" in got["per_arm"]


def test_a_gptq_arm_has_its_own_base(summarize, tmp_path):
    """GPTQ's rounding (`model.nvfp4_calibration: gptq`) is another NVFP4 checkpoint: `base_nvfp4_gptq`."""
    out = tmp_path / "results"
    run = out / "runs" / "nvfp4_aqn_gptq" / "seed0"
    shutil.copytree(RESULTS / "runs" / "nvfp4" / "seed0", run)  # a run that evaluated its base (step 0)
    cfg = run / "config.yaml"
    cfg.write_text(cfg.read_text().replace("  quant: nvfp4\n", "  quant: nvfp4\n  nvfp4_calibration: gptq\n"))
    report = run / "convert_report.json"
    report.write_text(json.dumps({**json.loads(report.read_text()), "checkpoint_hash": "d" * 64}))
    got = summarize.summarize(out, base_from=RESULTS / "summary.json")
    assert [r["arm"] for r in got["base"]] == ["base_nvfp4_gptq"]


V2 = ROOT / "experiments" / "qwen05_gsm8k_v2" / "results"
V2_MULTI_SEED_ARMS = {"bf16": [0, 1, 2, 3], "nvfp4": [0, 1, 2], "nvfp4_aqn": [0, 1, 2], "nvfp4_aqn_gptq": [0, 1, 2, 3],
                      "nvfp4_gptq": [0, 1, 2, 3]}  # arm -> its seeds
V2_ONE_SEED_ARMS = ("bf16_aqn", "nf4", "nvfp4_aqn_mse")  # issue 16's single-seed arms, and the MSE-scale arm's first seed


def test_a_run_evaluated_on_the_way_carries_its_trajectory(summarize, tmp_path):
    """`eval.every`: a run evaluated before its last step carries `evals` (step -> greedy / pass@1), a
    run the deadline cut keeps those it made in its `incomplete` row, and `per_arm` averages each step
    over the seeds evaluated there; a run evaluated only at its end gains no key."""
    out = tmp_path / "results"
    for seed in (0, 1, 2):
        shutil.copytree(V2 / "runs" / "bf16" / f"seed{seed}", out / "runs" / "bf16" / f"seed{seed}")
    final = {s: json.loads((out / "runs/bf16" / f"seed{s}" / "eval/step=60/metrics.json").read_text()) for s in (0, 1)}
    for seed, step, acc in ((0, 20, 0.26), (0, 40, 0.28), (1, 20, 0.30)):
        d = out / "runs/bf16" / f"seed{seed}" / f"eval/step={step}"
        d.mkdir(parents=True)
        (d / "metrics.json").write_text(json.dumps({**final[seed], "greedy_acc": acc, "pass_at_1": acc - 0.01}))
    shutil.rmtree(out / "runs/bf16/seed1/eval/step=60")  # cut by the deadline before its final evaluation
    got = summarize.summarize(out)
    rows = {r["seed"]: r for r in got["rows"]}
    assert sorted(rows) == [0, 2] and "evals" not in rows[2]
    assert rows[0]["evals"] == {"20": {"greedy_acc": 0.26, "pass1": 0.25}, "40": {"greedy_acc": 0.28, "pass1": 0.27},
                                "60": {"greedy_acc": final[0]["greedy_acc"], "pass1": final[0]["pass_at_1"]}}
    [cut] = got["incomplete"]
    assert (cut["seed"], cut["evals"]) == (1, {"20": {"greedy_acc": 0.30, "pass1": 0.29}})
    assert got["per_arm"]["bf16"]["seeds"] == [0, 2]
    assert got["per_arm"]["bf16"]["evals"]["40"] == {"greedy_acc": 0.28, "pass1": 0.27}  # seed 2 has no step 40
    assert got["per_arm"]["bf16"]["evals"]["60"]["greedy_acc"] == pytest.approx(
        (final[0]["greedy_acc"] + rows[2]["greedy_acc"]) / 2)


def test_recipe_2_summary_is_recomputed_from_its_committed_runs(summarize, tmp_path, monkeypatch):
    """Recipe 2's summary, base rows taken from recipe 1's summary by checkpoint hash, as committed."""
    monkeypatch.chdir(ROOT)  # the committed rows name the base summary by its path from the repository root
    committed_v2 = json.loads((V2 / "summary.json").read_text())
    out = tmp_path / "results"
    shutil.copytree(V2 / "runs", out / "runs")
    shutil.copytree(V2 / "base_evals", out / "base_evals")
    got = summarize.summarize(out, "qwen05_gsm8k_v2", Path("experiments/qwen05_gsm8k/results/summary.json"))
    assert got == committed_v2
    for arm, seeds in V2_MULTI_SEED_ARMS.items():
        assert committed_v2["per_arm"][arm]["seeds"] == seeds, arm


@pytest.mark.parametrize("doc", ["README.md", "docs/results_qwen05_gsm8k.md", "experiments/qwen05_gsm8k_v2/README.md"])
def test_docs_quote_recipe_2s_arms(doc):
    committed_v2 = json.loads((V2 / "summary.json").read_text())
    text = (ROOT / doc).read_text()
    for arm in V2_MULTI_SEED_ARMS:
        a = committed_v2["per_arm"][arm]
        quoted = f"{a['greedy_acc']:.3f} ± {a['greedy_acc_std']:.3f} / {a['pass1']:.3f} ± {a['pass1_std']:.3f}"
        assert quoted in text, f"{doc}: {arm} should quote {quoted} (qwen05_gsm8k_v2/results/summary.json)"
    for arm in V2_ONE_SEED_ARMS:
        a = committed_v2["per_arm"][arm]
        assert a["seeds"] == [0], arm
        quoted = f"{a['greedy_acc']:.3f} / {a['pass1']:.3f}"
        assert quoted in text, f"{doc}: {arm} should quote {quoted} (qwen05_gsm8k_v2/results/summary.json)"


def test_paired_differences_are_seed_against_seed(summarize):
    """`paired`: the later arm in ARMS order minus the earlier, only at the seeds both ran, for arms
    sharing at least two seeds."""
    rows = [{"arm": arm, "seed": s, "greedy_acc": g, "pass1": p} for arm, s, g, p in [
        ("bf16", 0, 0.30, 0.28), ("bf16", 1, 0.32, 0.30), ("bf16", 2, 0.29, 0.27),
        ("nvfp4_aqn_gptq", 0, 0.27, 0.27), ("nvfp4_aqn_gptq", 1, 0.28, 0.25),  # no seed 2
        ("nvfp4_gptq", 1, 0.26, 0.24),  # one seed in common with either: no pair
    ]]
    got = summarize.paired(rows)
    assert list(got) == ["nvfp4_aqn_gptq - bf16"]
    p = got["nvfp4_aqn_gptq - bf16"]
    assert p["seeds"] == [0, 1]
    assert p["greedy_acc"] == pytest.approx([-0.03, -0.04])
    assert p["greedy_acc_mean"] == pytest.approx(-0.035)
    assert p["greedy_acc_std"] == pytest.approx(0.00707107, rel=1e-5)
    assert p["pass1"] == pytest.approx([-0.01, -0.05])


@pytest.mark.parametrize("pair", ["nvfp4_aqn_gptq - bf16", "nvfp4_aqn_gptq - nvfp4_gptq", "nvfp4_aqn - nvfp4"])
def test_docs_quote_recipe_2s_paired_differences(pair):
    """The results page quotes the two seed-against-seed comparisons its reading rests on, in points."""
    p = json.loads((V2 / "summary.json").read_text())["paired"][pair]
    text = (ROOT / "docs/results_qwen05_gsm8k.md").read_text()
    for key in ("greedy_acc", "pass1"):
        quoted = f"{100 * p[f'{key}_mean']:+.1f} ± {100 * p[f'{key}_std']:.1f}"
        assert quoted in text, f"docs/results_qwen05_gsm8k.md: {pair} should quote {quoted} ({key})"


def test_a_base_evaluated_without_training_is_filed_by_its_checkpoint(summarize, tmp_path):
    """`--base-evals`: a `qwen-base-evals` $OUT goes to results/base_evals/ARM; its row is named by its convert
    report (quantization, observer, GPTQ), not by the arm, is refused when the runs of that base trained on
    other bytes, and gives way to a run's own step-0 evaluation. An evaluation that did not finish is not taken,
    and a metrics file without its convert report stops the collection before anything is copied."""
    mse = V2 / "base_evals" / "nvfp4_aqn_mse"
    src = tmp_path / "device_out"
    src.mkdir()
    shutil.copy(mse / "metrics.json", src / "nvfp4_aqn_mse.step0_metrics.json")
    shutil.copy(mse / "convert_report.json", src / "nvfp4_aqn_mse.convert_report.json")
    (src / "nvfp4_aqn_mse.base.log").write_text("prepare: x\nqerl-progress eval@0 sampled: 0/5276\neval@0: pass@1 0.203 greedy 0.239\n")
    (src / "nf4.convert_report.json").write_text("{}")  # its evaluation never wrote metrics: not taken
    out = tmp_path / "results"
    summarize.collect_base_evals([src], out, "qwen05_gsm8k_v2")
    assert sorted(p.name for p in (out / "base_evals").iterdir()) == ["nvfp4_aqn_mse"]
    assert (out / "base_evals" / "nvfp4_aqn_mse" / "stages.log").read_text() == "prepare: x\neval@0: pass@1 0.203 greedy 0.239\n"
    assert "qwen-base-evals nvfp4_aqn_mse" in json.loads((out / "base_evals" / "nvfp4_aqn_mse" / "metrics.json").read_text())["command"]

    got = summarize.summarize(out)
    assert [(r["arm"], r["from_base_eval"], r["greedy_acc"]) for r in got["base"]] == [
        ("base_nvfp4_nvfp4_expanded_mse", "base_evals/nvfp4_aqn_mse", json.loads((mse / "metrics.json").read_text())["greedy_acc"])]
    assert got["rows"] == got["base"] and got["per_arm"] == {}

    run = out / "runs" / "nvfp4_aqn_mse" / "seed0"  # a run of that observer's base, on other bytes
    shutil.copytree(V2 / "runs" / "nvfp4_aqn" / "seed0", run)
    cfg = run / "config.yaml"
    cfg.write_text(cfg.read_text().replace("  quant: nvfp4\n", "  quant: nvfp4\n  nvfp4_observer: nvfp4_expanded_mse\n"))
    with pytest.raises(ValueError, match=r"base_evals/nvfp4_aqn_mse/convert_report.json: checkpoint 31037aed\w+, but "
                                         r"the base_nvfp4_nvfp4_expanded_mse runs of .* trained on 9c056d81"):
        summarize.summarize(out)
    report = run / "convert_report.json"  # the same bytes: the run's arm counts, the base row stays the base eval's
    report.write_text(json.dumps({**json.loads(report.read_text()), "checkpoint_hash": got["base"][0]["checkpoint_hash"]}))
    again = summarize.summarize(out)
    assert again["base"] == got["base"] and "nvfp4_aqn_mse" in again["per_arm"]
    (run / "eval" / "step=0").mkdir()  # the run measured its base itself: its row stands, the base eval's gives way
    shutil.copy(V2 / "runs" / "nvfp4_aqn_gptq" / "seed0" / "eval" / "step=0" / "metrics.json", run / "eval" / "step=0")
    assert [r.get("from_run") for r in summarize.summarize(out)["base"]] == ["nvfp4_aqn_mse/seed0"]

    (src / "nvfp4.step0_metrics.json").write_text("{}")  # no nvfp4.convert_report.json beside it
    shutil.rmtree(out / "base_evals")
    with pytest.raises(ValueError, match=r"nvfp4.convert_report.json: missing beside nvfp4.step0_metrics.json"):
        summarize.collect_base_evals([src], out, "qwen05_gsm8k_v2")
    assert not (out / "base_evals").exists()


def test_an_archive_taken_mid_run_gets_its_steps_rebuilt(summarize, tmp_path):
    """`qwen-wait` archives a run that still holds its workspace, whose report stage is refused: no
    `reports/`. `collect` rebuilds steps.csv and eval.csv from the metric files, so the run's steps
    are counted and its curve is drawn (dashed, as far as it got) when no run of its arm finished."""
    ws = tmp_path / "arc" / "runs" / "bf16" / "seed0"
    (ws / "eval" / "step=2").mkdir(parents=True)
    (ws / "config.yaml").write_text((ROOT / "experiments/qwen05_gsm8k_v3/bf16.yaml").read_text())
    for i in range(3):  # updates 0-2 done, step 3 rolled out and scored, its update cut
        for rel, obj in ((f"metrics/step={i}/update.json", {"loss": 0.1 * i, "kl": 0.01 * i}),
                         (f"rewards/step={i}/metrics.json", {"reward_mean": 0.2 + i, "correct_rate": 0.1 * i})):
            (ws / rel).parent.mkdir(parents=True, exist_ok=True)
            (ws / rel).write_text(json.dumps(obj))
    (ws / "rewards/step=3").mkdir()
    (ws / "rewards/step=3/metrics.json").write_text(json.dumps({"reward_mean": 0.5, "correct_rate": 0.4}))
    (ws / "eval/step=2/metrics.json").write_text(json.dumps(
        {"step": 2, "greedy_acc": 0.3, "pass_at_1": 0.29, "greedy_acc_se": 0.01, "pass_at_1_se": 0.01, "k": 4,
         "n_prompts": 1319, "greedy_format_rate": 1.0}))
    out = tmp_path / "results"
    summarize.collect([tmp_path / "arc"], out, "qwen05_gsm8k_v3")
    steps = summarize._csv(out / "runs/bf16/seed0/steps.csv")
    assert [(r["step"], r["has_update"], r["correct_rate"]) for r in steps] == [
        (0, 1, 0.0), (1, 1, 0.1), (2, 1, 0.2), (3, 0, 0.4)]
    assert [r["greedy_acc"] for r in summarize._csv(out / "runs/bf16/seed0/eval.csv")] == [0.3]
    [cut] = summarize.summarize(out, "qwen05_gsm8k_v3")["incomplete"]
    assert (cut["steps"], cut["planned"], cut["evals"]) == (3, 120, {"2": {"greedy_acc": 0.3, "pass1": 0.29}})
    assert summarize.plot(out, ["bf16"], "qwen05_gsm8k_v3") == ["bf16 seed0 (stopped: 3 of 120 steps)"]


def test_recipe_3_summary_is_recomputed_from_its_committed_runs(summarize, tmp_path, monkeypatch):
    """Recipe 3's summary, base rows from recipe 2's summary by checkpoint hash, as committed. BF16 seed 0
    is complete (session 38: 120 updates and the step-120 evaluation, its step-60 evaluation left out with
    `-s eval.every=120`); the GPTQ arm is `incomplete` with its step-60 evaluation (it lost its machine
    after 81 updates in session 36)."""
    monkeypatch.chdir(ROOT)
    v3 = ROOT / "experiments" / "qwen05_gsm8k_v3" / "results"
    committed_v3 = json.loads((v3 / "summary.json").read_text())
    out = tmp_path / "results"
    shutil.copytree(v3 / "runs", out / "runs")
    got = summarize.summarize(out, "qwen05_gsm8k_v3", Path("experiments/qwen05_gsm8k_v2/results/summary.json"))
    assert got == committed_v3
    assert {(r["arm"], r["steps"], r["planned"]) for r in got["incomplete"]} == {("nvfp4_aqn_gptq", 81, 120)}
    assert [(r["arm"], r["seed"], r["steps"], r["n_test"]) for r in got["rows"] if r["steps"]] == [
        ("bf16", 0, 120, 1319)]


def test_a_run_command_names_the_overrides_it_ran_with(summarize, tmp_path):
    """A device run started with `QWEN_RUN_SET="-s eval.every=120"` records that override in its command;
    a run with its arm's own `eval.every` records none."""
    import yaml

    arm = yaml.safe_load((ROOT / "experiments/qwen05_gsm8k_v3/bf16.yaml").read_text())
    for every, expect in ((120, " -s eval.every=120 "), (arm["eval"]["every"], " --root ")):
        ws = tmp_path / str(every) / "bf16" / "seed2"
        ws.mkdir(parents=True)
        cfg = {**arm, "eval": {**arm["eval"], "every": every}}
        (ws / "config.yaml").write_text(yaml.safe_dump(cfg))
        command = summarize.run_command(ws, "qwen05_gsm8k_v3")
        assert "-s run.seed=2 -s aqn.seed=1236 -s eval.base=false" + expect in command
        assert command.count("eval.every") == (every != arm["eval"]["every"])


@pytest.mark.parametrize("doc", ["README.md", "docs/results_qwen05_gsm8k.md", "experiments/qwen05_gsm8k_v3/README.md"])
def test_docs_quote_recipe_3s_final_evaluations(doc):
    committed_v3 = json.loads((ROOT / "experiments/qwen05_gsm8k_v3/results/summary.json").read_text())
    text = (ROOT / doc).read_text()
    for run in committed_v3["rows"]:
        if run["steps"]:
            quoted = f"{run['greedy_acc']:.3f} / {run['pass1']:.3f}"
            assert quoted in text, f"{doc}: {run['arm']} seed {run['seed']} should quote {quoted} at step 120"


@pytest.mark.parametrize("doc", ["README.md", "docs/results_qwen05_gsm8k.md", "experiments/qwen05_gsm8k_v3/README.md"])
def test_docs_quote_recipe_3s_step_60_evaluations(doc):
    committed_v3 = json.loads((ROOT / "experiments/qwen05_gsm8k_v3/results/summary.json").read_text())
    text = (ROOT / doc).read_text()
    for run in committed_v3["incomplete"]:
        e = run["evals"]["60"]
        quoted = f"{e['greedy_acc']:.3f} / {e['pass1']:.3f}"
        assert quoted in text, f"{doc}: {run['arm']} seed {run['seed']} should quote {quoted} at step 60"


@pytest.mark.parametrize("doc", ["docs/results_qwen05_gsm8k.md", "experiments/qwen05_gsm8k_v3/README.md"])
def test_docs_quote_the_replaced_runs_of_recipe_3(doc):
    """A run whose seed ran again is kept under `results/replaced/SESSION/` (summarize.py reads only
    `runs/`), and the docs still quote its step-60 evaluation next to the rerun's: the two are the
    run-to-run spread of one seed on the GPU."""
    text = (ROOT / doc).read_text()
    replaced = sorted((ROOT / "experiments/qwen05_gsm8k_v3/results/replaced").glob("*/*/seed*/eval.csv"))
    assert replaced
    for f in replaced:
        e = next(r for r in csv.DictReader(f.open()) if r["step"] == "60")
        quoted = f"{float(e['greedy_acc']):.3f} / {float(e['pass_at_1']):.3f}"
        assert quoted in text, f"{doc}: {f.parent} should quote {quoted} at step 60"
