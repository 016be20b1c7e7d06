"""The DVC pipeline (dvc.yaml + params.yaml) on the tiny two-step run, in temporary git repos.

- `qerl plan` writes params.yaml; `dvc repro` reproduces the whole run with the same bytes as
  `qerl run` of the same config;
- dvc.yaml agrees with `qerl_lib.paths` (outputs, inputs), with the library modules each stage
  imports, and with the params each stage reads (traced);
- a changed param re-runs exactly the stale stages; `--single-item` runs one stage;
- metrics and plots come from the report stage; push / pull round-trips through a local remote.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import EVALS, PROJECT_ROOT, SAME_BYTES, STEPS, copy_repo, sh, stages_run

from qerl_lib.paths import Layout

TIMING_KEYS = {"seconds", "seconds_setup", "seconds_materialize", "seconds_convert"}


def _without_timing(path: Path) -> dict:
    return {k: v for k, v in json.loads(path.read_text()).items() if k not in TIMING_KEYS}


def dvc_stages(repo: Path) -> dict:
    """name -> {cmd, deps (paths), params (keys), outs (paths), metrics} as DVC resolves dvc.yaml."""
    from dvc.repo import Repo

    out = {}
    with Repo(str(repo)) as r:
        for s in r.index.stages:
            params, deps = [], []
            for d in s.deps:
                if getattr(d, "params", None) is not None:
                    params += list(d.params)
                else:
                    deps.append(str(d.def_path))
            out[s.name] = {
                "cmd": s.cmd, "deps": deps, "params": params,
                "outs": [str(o.def_path) for o in s.outs], "metrics": [str(o.def_path) for o in s.outs if o.metric],
            }
    return out


# ------------------------------------------------------------------------------ plan / params


def test_plan_writes_every_knob_and_the_unrolled_steps(tmp_path, tiny_pipeline):
    from conftest import write_params

    from qerl_lib.config import QerlConfig, config_to_dict, load_config

    params = write_params(tmp_path, tiny_pipeline)
    tree = yaml.safe_load(params.read_text())
    assert tree["plan"] == {"steps": [{"step": 0, "prev": None, "next": 1}, {"step": 1, "prev": 0, "next": 2}],
                            "evals": EVALS}
    cfg = load_config(params)
    assert cfg.run.root == "." and cfg.rollout.group_size == 4
    # Every field is written out, so a change of a code default cannot change a run silently.
    assert {k: v for k, v in tree.items() if k != "plan"} == config_to_dict(cfg)
    assert set(tree) == set(QerlConfig.model_fields)
    # The plan is not part of the resolved config (nor of the hash the stages write).
    assert "plan" not in config_to_dict(cfg)
    assert sh(["qerl", "plan", "--check"], cwd=tmp_path).returncode == 0
    # A changed step count without `qerl plan` is refused by every command, with the remedy.
    params.write_text(params.read_text().replace("steps: 2\n", "steps: 3\n", 1))
    res = sh(["qerl", "stage", "report", "-c", "params.yaml"], cwd=tmp_path, check=False)
    assert res.returncode == 2 and "run `qerl plan`" in res.stderr
    assert sh(["qerl", "plan", "--check"], cwd=tmp_path, check=False).returncode == 1
    sh(["qerl", "plan", "-s", "eval.every=2"], cwd=tmp_path)
    tree = yaml.safe_load(params.read_text())
    assert [s["step"] for s in tree["plan"]["steps"]] == [0, 1, 2] and tree["plan"]["evals"] == [0, 2, 3]


def test_project_params_yaml_is_up_to_date():
    """The committed params.yaml is what `qerl plan` writes from it (every knob, current plan)."""
    res = sh(["qerl", "plan", "--check"], cwd=PROJECT_ROOT, check=False)
    assert res.returncode == 0, (f"{res.stderr.strip()}: a config field was added or changed; "
                                 "run `qerl plan` at the repository root and commit params.yaml")


def test_project_params_yaml_holds_the_code_defaults(tmp_path):
    """The committed params.yaml is the embedded default: `qerl plan` from no config at all gives
    its bytes, so `dvc repro` of a fresh clone runs what `qerl run` runs. (`qerl plan --check`
    above re-reads params.yaml's own values, so a value that differs from the code's default
    passes it: vllm_lora_dual_stream did.)"""
    from qerl_lib.cli import main

    fresh = tmp_path / "params.yaml"
    assert main(["plan", "--params", str(fresh)]) == 0
    committed, default = (PROJECT_ROOT / "params.yaml").read_text(), fresh.read_text()
    differ = [f"{a.strip()} (code: {b.strip()})" for a, b in zip(committed.splitlines(), default.splitlines()) if a != b]
    assert committed == default, ("params.yaml differs from the code defaults: " + "; ".join(differ[:5])
                                  + ". Run `qerl plan -c EMPTY.yaml` at the repository root")


# ------------------------------------------------------------------------------ dvc.yaml agrees


def test_stage_names_and_paths_agree_with_layout(dvc_repro_done):
    from qerl_lib.cli import stage_outputs
    from qerl_lib.config import load_config

    stages = dvc_stages(dvc_repro_done)
    steps = [f"{n}@{i}" for i in range(STEPS) for n in ("rollout", "reward", "update")]
    assert set(stages) == {"prepare", "convert", "init_adapter", *steps, *(f"eval@{k}" for k in EVALS), "report"}
    cfg = load_config(dvc_repro_done / "params.yaml")
    lay = Layout(".")
    q = cfg.model.quant

    def rel(p):
        return str(Path(p))

    for name, st in stages.items():
        kind, _, step = name.partition("@")
        step = int(step) if step else None
        assert st["cmd"] == f"qerl stage {kind}" + (f" --step {step}" if step is not None else "") + " --config params.yaml"
        want = {rel(p) for p in stage_outputs(kind, step, cfg, lay)}
        outs = set(st["outs"])
        if kind == "report":
            # plots/ is one directory output; reports/config.yaml is a copy of params (dvc.lock has them).
            assert outs == {rel(lay.report_metrics), rel(lay.report_steps), rel(lay.reports_dir / "eval.csv"),
                            rel(lay.reports_dir / "plots")}
            assert st["metrics"] == [rel(lay.report_metrics)]
            assert all(o in outs or Path(o).parent.as_posix() in outs for o in want - {"reports/config.yaml"})
        else:
            assert outs == want, name
    # Inputs: exactly the outputs of the stages before (paths as Layout names them).
    artifacts = {n: {d for d in st["deps"] if not d.startswith("qerl_lib/")} for n, st in stages.items()}
    assert artifacts["prepare"] == set() and artifacts["convert"] == {rel(lay.prepared("train"))}  # GPTQ's prompts
    assert artifacts["init_adapter"] == {rel(lay.checkpoint(q))}
    for i in range(STEPS):
        assert artifacts[f"rollout@{i}"] == {rel(lay.prepared("train")), rel(lay.checkpoint(q)), rel(lay.adapter(i))}
        assert artifacts[f"reward@{i}"] == {rel(lay.rollouts(i))}
        assert artifacts[f"update@{i}"] == {rel(lay.checkpoint(q)), rel(lay.adapter(i)), rel(lay.scored(i))}
    for k in EVALS:
        assert artifacts[f"eval@{k}"] == {rel(lay.prepared("test")), rel(lay.checkpoint(q)), rel(lay.adapter(k))}
    assert artifacts["report"] == {"rollouts", "rewards", "metrics", "eval"}


def test_dvc_yaml_stages_are_rendered_from_the_registry():
    """dvc.yaml's stage list is the registry's (`python -m qerl_lib.dvc_yaml` rewrites it)."""
    from qerl_lib.dvc_yaml import render

    current = (PROJECT_ROOT / "dvc.yaml").read_text()
    assert render(current) == current, "dvc.yaml is out of date: run `python -m qerl_lib.dvc_yaml`"


def test_library_deps_are_the_modules_each_stage_imports():
    """A stage's library deps: its own module and what it imports (lazily too), transitively."""
    from qerl_lib.dvc_yaml import library_deps
    from qerl_lib.stages.registry import BY_NAME

    rollout = set(library_deps(BY_NAME["rollout"]))
    assert {"qerl_lib/stages/rollout.py", "qerl_lib/stages/common.py", "qerl_lib/aqn.py",
            "qerl_lib/policy.py", "qerl_lib/schema.py"} <= rollout
    # Another stage's module, the doors and the plumbing are not dependencies.
    assert not rollout & {"qerl_lib/stages/eval.py", "qerl_lib/stages/update.py", "qerl_lib/cli.py",
                          "qerl_lib/run.py", "qerl_lib/config.py", "qerl_lib/stages/registry.py"}
    assert library_deps(BY_NAME["reward"]) == ["qerl_lib/advantages.py", "qerl_lib/rewards.py", "qerl_lib/schema.py",
                                               "qerl_lib/scoring.py", "qerl_lib/stages/reward.py"]
    stages = dvc_stages(PROJECT_ROOT)
    for name, st in stages.items():
        kind = name.partition("@")[0]
        declared = {d for d in st["deps"] if d.startswith("qerl_lib/")}
        assert declared == set(library_deps(BY_NAME[kind])), name


class _Trace:
    """A read-only view of a QerlConfig that records the dotted keys the code reads; a method
    call on a (sub)config (model_dump, ...) records the whole section ('<all>' at the root)."""

    def __init__(self, obj, path: str, log: set):
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_log", log)

    def __getattr__(self, name):
        from pydantic import BaseModel

        obj, path, log = (object.__getattribute__(self, k) for k in ("_obj", "_path", "_log"))
        value = getattr(obj, name)
        if name in type(obj).model_fields:
            full = f"{path}.{name}" if path else name
            if isinstance(value, BaseModel):
                return _Trace(value, full, log)
            log.add(full)
            return value
        log.add(path or "<all>")
        return value

    def __setattr__(self, name, value):
        raise AttributeError("config is read-only in a stage")


# Declared on purpose beyond what the CPU code reads: the rollout section's vLLM settings belong to
# the rollout engine (GPU backend). '<all>': the stages that write Parquet metadata hash the whole
# config (`config_hash`, lineage only), and report copies it to reports/config.yaml (not an out).
WHOLE_CONFIG_READERS = {"rollout", "eval", "report"}
# Read on a path this small run does not take; declared because they change the output there.
CONDITIONAL_READS = {
    "convert": {k: "GPTQ's calibration prompts (model.nvfp4_calibration: gptq)" for k in (
        "model.nvfp4_calibration_samples", "data.prompt", "model.chat_template")},
    "update": {"algo.beta": "the KL coefficient, read by the grpo loss only",
               "aqn.seed": "the noise seed when a step has no rows (else taken from the rows)"},
}


@pytest.mark.reproduces
def test_params_are_exactly_what_each_stage_reads(reference_run, tmp_path):
    from qerl_lib import stages as st
    from qerl_lib.config import load_config

    ws = copy_repo(reference_run, tmp_path / "ws")
    cfg = load_config(ws / "params.yaml")
    lay = Layout(ws)
    calls = {
        "prepare": lambda c: st.prepare_stage(c, lay),
        "convert": lambda c: st.convert_stage(c, lay),
        "init_adapter": lambda c: st.init_adapter_stage(c, lay),
        "rollout": lambda c: st.rollout_stage(c, lay, 1),
        "reward": lambda c: st.reward_stage(c, lay, 1),
        "update": lambda c: st.update_stage(c, lay, 1),
        "eval": lambda c: st.eval_stage(c, lay, 2),
        "report": lambda c: st.report_stage(c, lay),
    }
    declared_by_kind = {}
    for name, s in dvc_stages(PROJECT_ROOT).items():
        declared_by_kind[name.partition("@")[0]] = set(s["params"])
    assert set(declared_by_kind) == set(calls)
    for kind, call in calls.items():
        read: set = set()
        call(_Trace(cfg, "", read))
        if kind in WHOLE_CONFIG_READERS:
            read.discard("<all>")
        declared = declared_by_kind[kind]
        missing = {k for k in read if not any(k == d or k.startswith(d + ".") for d in declared)}
        assert not missing, f"{kind}: reads params that dvc.yaml does not declare: {sorted(missing)}"
        unused = {d for d in declared if not any(k == d or k.startswith(d + ".") or d.startswith(k + ".") for k in read)}
        unused -= set(CONDITIONAL_READS.get(kind, {}))
        assert not unused, f"{kind}: dvc.yaml declares params it never reads: {sorted(unused)}"
    # The outputs the traced stages re-made are the reference ones (the trace changed nothing).
    assert (ws / "rollouts/step=1/rollouts.parquet").read_bytes() == \
        (reference_run / "rollouts/step=1/rollouts.parquet").read_bytes()


# ------------------------------------------------------------------------------ repro


def test_dvc_repro_gives_the_bytes_of_qerl_run(dvc_repro_done, reference_run):
    for rel in SAME_BYTES:
        assert (dvc_repro_done / rel).read_bytes() == (reference_run / rel).read_bytes(), rel
    for i in range(STEPS):
        rel = f"metrics/step={i}/update.json"
        assert _without_timing(dvc_repro_done / rel) == _without_timing(reference_run / rel)
    for k in EVALS:
        rel = f"eval/step={k}/metrics.json"
        assert _without_timing(dvc_repro_done / rel) == _without_timing(reference_run / rel)
    # Real training happened: both updates had kept samples and moved the adapter.
    for i in range(STEPS):
        upd = json.loads((dvc_repro_done / f"metrics/step={i}/update.json").read_text())
        assert upd["kept_samples"] > 0 and upd["optimizer_steps"] == 1
    a0 = (dvc_repro_done / "adapters/step=0/adapter_model.safetensors").read_bytes()
    assert (dvc_repro_done / "adapters/step=1/adapter_model.safetensors").read_bytes() != a0
    # Nothing is stale, nothing is left for git: the stages wrote no root config.yaml.
    assert "up to date" in sh(["dvc", "status"], cwd=dvc_repro_done).stdout
    assert not (dvc_repro_done / "config.yaml").exists()
    untracked = sh(["git", "status", "--porcelain", "--untracked-files=all"], cwd=dvc_repro_done).stdout.split("\n")
    stray = [ln for ln in untracked if ln.strip() and not ln[3:].startswith(
        ("qerl_lib/", "dvc.yaml", "dvc.lock", "params.yaml", "tiny.yaml", ".dvc", ".gitignore"))]
    assert not stray, f"outputs git would see: {stray}"


def test_metrics_and_plots_come_from_the_report(dvc_repro_done, tmp_path):
    res = sh(["dvc", "metrics", "show", "--json"], cwd=dvc_repro_done)
    shown = json.loads(res.stdout)
    data = next(iter(shown.values()))["data"]["reports/metrics.json"]["data"]
    assert data["progress"]["steps_updated"] == STEPS and data["progress"]["complete"] == 1
    for key in ("reward_mean_last", "entropy_last", "kl_last", "sigma_last", "step_seconds_mean"):
        assert key in data["train"], key
    assert "pass_at_1_last" in data["eval"]
    res = sh(["dvc", "plots", "show", "-o", str(tmp_path / "plots")], cwd=dvc_repro_done)
    html = (tmp_path / "plots" / "index.html").read_text()
    for title in ("reward per step", "accuracy of adapter", "policy entropy", "KL to the reference", "AQN sigma",
                  "step time"):
        assert title in html, title
    for png in ("reward", "accuracy", "entropy", "kl", "sigma", "time"):
        assert f"reports/plots/{png}.png" in html
    header = (dvc_repro_done / "reports/steps.csv").read_text().splitlines()[0].split(",")
    for col in ("step", "reward_mean", "correct_rate", "entropy", "kl", "sigma", "seconds", "step_seconds"):
        assert col in header, col


def test_changed_param_reruns_only_the_stale_stages(dvc_repro_done, tmp_path):
    repo = copy_repo(dvc_repro_done, tmp_path / "repo")
    before = {i: (repo / f"rollouts/step={i}/rollouts.parquet").read_bytes() for i in range(STEPS)}
    sh(["qerl", "plan", "-s", "optim.lr=0.002"], cwd=repo)  # a param only update@i reads
    status = json.loads(sh(["dvc", "status", "--json"], cwd=repo).stdout)
    assert set(status) == {f"update@{i}" for i in range(STEPS)}
    res = sh(["dvc", "repro", "update@1"], cwd=repo)
    assert stages_run(res.stdout) == ["update@0", "rollout@1", "reward@1", "update@1"]
    for skipped in ("prepare", "convert", "init_adapter", "rollout@0", "reward@0"):
        assert f"Stage '{skipped}' didn't change, skipping" in res.stdout
    assert (repo / "rollouts/step=0/rollouts.parquet").read_bytes() == before[0]
    assert (repo / "rollouts/step=1/rollouts.parquet").read_bytes() != before[1]  # adapter 1 changed
    # What is left stale is downstream of update@1 only; one stage runs alone (the Prefect door).
    assert set(json.loads(sh(["dvc", "status", "--json"], cwd=repo).stdout)) == {"eval@2", "report"}
    res = sh(["dvc", "repro", "--single-item", "eval@2"], cwd=repo)
    assert stages_run(res.stdout) == ["eval@2"]
    assert set(json.loads(sh(["dvc", "status", "--json"], cwd=repo).stdout)) == {"report"}


def test_push_pull_round_trip_through_a_local_remote(dvc_repro_done, tmp_path):
    repo = copy_repo(dvc_repro_done, tmp_path / "repo")
    # The project's default remote: a directory beside the repository (.dvc/config).
    url = sh(["dvc", "remote", "list"], cwd=repo).stdout
    assert "qerl-dvc-remote" in url
    sh(["git", "add", "-A"], cwd=repo)
    sh(["git", "commit", "-q", "-m", "tiny run"], cwd=repo)
    res = sh(["dvc", "push"], cwd=repo)
    assert "pushed" in res.stdout
    remote = tmp_path / "qerl-dvc-remote"
    assert remote.is_dir() and any(remote.rglob("*"))
    clone = tmp_path / "clone"
    sh(["git", "clone", "-q", str(repo), str(clone)], cwd=tmp_path)
    assert not (clone / "rollouts").exists()
    sh(["dvc", "pull"], cwd=clone)
    for rel in SAME_BYTES + ["reports/metrics.json", "rollouts/step=1/provenance.json"]:
        assert (clone / rel).read_bytes() == (repo / rel).read_bytes(), rel
    assert "up to date" in sh(["dvc", "status"], cwd=clone).stdout
    # The clone reproduces nothing: every stage is current.
    res = sh(["dvc", "repro"], cwd=clone)
    assert stages_run(res.stdout) == []
    shutil.rmtree(clone)
