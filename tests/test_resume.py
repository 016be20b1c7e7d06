"""Resume after SIGKILL: `qerl run` and `dvc repro` killed inside stages and between them, then
run again with the same command, end with the bytes of the uninterrupted run (rollout Parquet,
scored rows, adapters, optimizer and trainer state, eval samples), redo no finished stage, and
leave no partial file. A second run on a busy workspace is refused with a clear message.

Kill points tested (each a real SIGKILL of the whole process group):
  qerl run:   inside update@0, inside rollout@1, between reward@1 and update@1, plus the
              temporaries a kill during a write leaves (files and a half-swapped adapter dir);
  dvc repro:  inside rollout@1 (the stage process holds the workspace), between reward@1 and
              update@1 (DVC has locked reward@1 and is starting update@1).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from conftest import SAME_BYTES, STEPS, copy_repo, quiet_env, sh, stages_run
from test_dvc import _without_timing

from qerl_lib.paths import Layout



class Run:
    """A command in its own process group, read line by line until a pattern shows up."""

    def __init__(self, args: list[str], cwd: Path):
        self.proc = subprocess.Popen(args, cwd=cwd, env=quiet_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.out = ""

    def wait_for(self, pattern: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"process ended before {pattern!r}:\n{self.out[-4000:]}")
            self.out += line
            if rx.search(line):
                return
        raise AssertionError(f"no {pattern!r} within {timeout}s:\n{self.out[-4000:]}")

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        self.out += self.proc.stdout.read()

    def finish(self, timeout: float = 600) -> int:
        out, _ = self.proc.communicate(timeout=timeout)
        self.out += out
        return self.proc.returncode


def partial_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".git" not in p.parts and ".dvc" not in p.parts
            and (p.name.endswith(".tmp") or p.name.endswith(".old"))]


def assert_same_as_reference(ws: Path, ref: Path) -> None:
    """Every file that differs is named, with the update metrics that differ beside them (resumed,
    reference): a failure then shows whether one file or a whole update moved."""
    differ = [rel for rel in SAME_BYTES if (ws / rel).read_bytes() != (ref / rel).read_bytes()]
    metrics = {}
    for i in range(STEPS):
        rel = f"metrics/step={i}/update.json"
        got, want = _without_timing(ws / rel), _without_timing(ref / rel)
        if got != want:
            metrics[rel] = {k: (got.get(k), want.get(k)) for k in sorted(got.keys() | want.keys())
                            if got.get(k) != want.get(k)}
    assert not differ and not metrics, f"bytes differ: {differ}; update metrics (resumed, reference): {metrics}"
    assert not partial_files(ws), partial_files(ws)


@pytest.mark.reproduces
def test_qerl_run_resumes_after_kills_with_identical_bytes(reference_run, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    # prepare / convert / init_adapter are as in the reference (deterministic): start after them.
    for rel in ("params.yaml", "config.yaml"):
        shutil.copy(reference_run / rel, ws / rel)
    for rel in ("data", "models", "adapters/step=0"):
        shutil.copytree(reference_run / rel, ws / rel)
    lay = Layout(ws)
    cmd = ["qerl", "run", "-c", "params.yaml"]

    # 1. inside update@0 (the line is printed as the stage starts; a warm tiny update takes
    #    well under a second, so the kill follows the line at once)
    r = Run(cmd, ws)
    r.wait_for(r"… update@0")
    r.kill()
    assert lay.reward_metrics(0).is_file() and not lay.update_metrics(0).exists()

    # 2. inside rollout@1 (update@0 is done first, from its inputs alone)
    r = Run(cmd, ws)
    r.wait_for(r"… rollout@1")
    r.kill()
    assert "update@0: done before" not in r.out and lay.update_metrics(0).is_file()
    assert "rollout@0: done before, skipped" in r.out
    assert not lay.rollouts(1).exists()

    # 3. between reward@1 and update@1
    r = Run(cmd, ws)
    r.wait_for(r"reward@1: [0-9.]+s")
    r.kill()
    assert lay.reward_metrics(1).is_file() and not lay.update_metrics(1).exists()

    # 4. what a kill in the middle of a write leaves: temporaries beside outputs, an adapter
    #    directory half swapped (qerl_lib.io writes to `.NAME.*.tmp` and renames).
    (lay.update_metrics(1).parent).mkdir(parents=True, exist_ok=True)
    (lay.update_metrics(1).parent / ".update.json.k1ll3d.tmp").write_text('{"loss": 0.')
    half = lay.adapter(2).parent / ".step=2.k1ll3d.tmp"
    half.mkdir(parents=True)
    (half / "adapter_model.safetensors").write_bytes(b"\0" * 10)
    (lay.adapter(2).parent / ".step=2.old").mkdir()
    lay.eval_samples(2).parent.mkdir(parents=True, exist_ok=True)
    (lay.eval_samples(2).parent / ".samples.parquet.k1ll3d.tmp").write_bytes(b"PAR1")

    r = Run(cmd, ws)
    assert r.finish() == 0, r.out[-4000:]
    assert_same_as_reference(ws, reference_run)
    # Nothing finished was redone and nothing was lost: each stage completed exactly once.
    done = Counter((rec["stage"], rec["step"]) for rec in map(json.loads, lay.stage_times.read_text().splitlines())
                   if rec["stage"] != "report")
    expected = {("eval", 0), ("eval", STEPS)} | {(s, i) for i in range(STEPS) for s in ("rollout", "reward", "update")}
    assert set(done) == expected and set(done.values()) == {1}, done
    # Optimizer state, AQN stage and adapter version carried over exactly.
    for i in range(1, STEPS + 1):
        state = json.loads((lay.adapter(i) / "trainer_state.json").read_text())
        assert state == {"step": i, "optimizer_steps": i}
    upd = json.loads(lay.update_metrics(1).read_text())
    assert upd["aqn_stage"] == 1 and upd["sigma"] > 0


def test_a_stage_is_refused_while_a_run_holds_the_workspace(reference_run, capsys):
    from qerl_lib.cli import main
    from qerl_lib.run import workspace_lock

    cwd = os.getcwd()
    os.chdir(reference_run)
    try:
        with workspace_lock(Layout(".")):
            assert main(["stage", "report", "-c", "params.yaml"]) == 2
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err
    assert "is in use by pid" in err and "stage report was not started" in err


def _rewind_to_after_update0(repo: Path) -> None:
    """The state a `dvc repro` killed right after update@0 leaves: later outputs absent, their
    dvc.lock entries never written, no run-cache entry for them (so they really run again)."""
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    later = ["rollout@1", "reward@1", "update@1", f"eval@{STEPS}", "report"]
    for name in later:
        del lock["stages"][name]
    (repo / "dvc.lock").write_text(yaml.safe_dump(lock, sort_keys=False))
    for rel in ("rollouts/step=1", "rewards/step=1", "adapters/step=2", "metrics/step=1", f"eval/step={STEPS}",
                "reports"):
        shutil.rmtree(repo / rel)
    shutil.rmtree(repo / ".dvc" / "cache" / "runs", ignore_errors=True)


@pytest.mark.reproduces
def test_dvc_repro_resumes_after_kills_and_refuses_a_second_run(dvc_repro_done, tmp_path):
    repo = copy_repo(dvc_repro_done, tmp_path / "repo")
    _rewind_to_after_update0(repo)
    assert set(json.loads(sh(["dvc", "status", "--json"], cwd=repo).stdout)) >= {"rollout@1", "report"}

    # 1. inside rollout@1: wait until its process holds the workspace, then try a second run.
    r = Run(["dvc", "repro"], repo)
    r.wait_for(r"Running stage 'rollout@1'")
    lockfile = repo / ".qerl.lock"
    deadline = time.monotonic() + 120
    while "rollout@1" not in (lockfile.read_text() if lockfile.exists() else ""):
        assert time.monotonic() < deadline and r.proc.poll() is None, r.out
        time.sleep(0.05)
    second = sh(["dvc", "repro"], cwd=repo, check=False)
    assert second.returncode != 0 and re.search("is busy|lock", second.stderr + second.stdout), second.stderr
    local = sh(["qerl", "run", "-c", "params.yaml"], cwd=repo, check=False)
    assert local.returncode == 2 and "in use by qerl stage rollout@1" in local.stderr, local.stderr
    r.kill()
    assert not (repo / "rollouts/step=1/rollouts.parquet").exists()

    # 2. between reward@1 and update@1: DVC has recorded reward@1 and starts update@1.
    r = Run(["dvc", "repro"], repo)
    r.wait_for(r"Running stage 'update@1'")
    r.kill()
    assert stages_run(r.out) == ["rollout@1", "reward@1", "update@1"]
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    assert "reward@1" in lock and "update@1" not in lock

    # 3. the same command again finishes the run; finished stages are not redone.
    r = Run(["dvc", "repro"], repo)
    assert r.finish() == 0, r.out[-4000:]
    assert stages_run(r.out) == ["update@1", f"eval@{STEPS}", "report"]
    assert_same_as_reference(repo, dvc_repro_done)
    assert "up to date" in sh(["dvc", "status"], cwd=repo).stdout


def moved_run(reference_run: Path, tmp_path: Path, removed: tuple[str, ...], trained: int) -> tuple[Path, set[str]]:
    """The reference run cut back (`removed` deleted, leaving `trained` updates), moved as its
    `run.resume_state` into a new workspace beside the params and the `data/` and `models/` that
    prepare and convert remake there. Returns the new workspace and the state's relative paths."""
    from qerl_lib.run import resume_state, steps_trained

    old = tmp_path / "old"
    shutil.copytree(reference_run, old)
    for rel in removed:
        shutil.rmtree(old / rel)
    assert steps_trained(Layout(old)) == trained
    rels = {str(f.relative_to(old)) for f in resume_state(Layout(old))}
    ws = tmp_path / "new"
    for rel in rels:
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(old / rel, ws / rel)
    shutil.copy(reference_run / "params.yaml", ws / "params.yaml")
    for rel in ("data", "models"):
        shutil.copytree(reference_run / rel, ws / rel)
    return ws, rels


@pytest.mark.reproduces
def test_a_run_continues_on_another_machine_from_its_resume_state(reference_run, tmp_path):
    """A run stopped after update@0, moved as `run.resume_state` (config, adapter 1 with its optimizer
    and trainer state, step 0's metric files, evaluation 0) into a workspace where `data/` and `models/`
    are remade, continues at step 1: step 0's rollouts, gone, are not generated again, and every later
    output has the bytes of the uninterrupted run."""
    ws, rels = moved_run(reference_run, tmp_path, ("rollouts/step=1", "rewards/step=1", "metrics/step=1",
                                                   "adapters/step=2", f"eval/step={STEPS}", "reports"), trained=1)
    assert {"config.yaml", "adapters/step=1/optimizer.pt", "adapters/step=1/trainer_state.json",
            "metrics/step=0/update.json", "rewards/step=0/metrics.json", "eval/step=0/metrics.json"} <= rels
    assert not {r for r in rels if r.endswith(".parquet") or r.startswith(("adapters/step=0", "models", "data"))}
    res = sh(["qerl", "run", "-c", "params.yaml"], cwd=ws)
    lay = Layout(ws)
    assert "rollout@0: done before, skipped" in res.stdout + res.stderr
    assert not lay.rollouts(0).exists() and not lay.scored(0).exists()
    later = [rel for rel in SAME_BYTES if "step=0" not in rel]
    differ = [rel for rel in later if (ws / rel).read_bytes() != (reference_run / rel).read_bytes()]
    assert not differ, differ
    assert _without_timing(lay.update_metrics(1)) == _without_timing(Layout(reference_run).update_metrics(1))
    assert lay.report_steps.is_file() and len(lay.report_steps.read_text().splitlines()) == 1 + STEPS


@pytest.mark.reproduces
def test_a_run_moved_after_its_last_update_only_evaluates(reference_run, tmp_path):
    """A run whose deadline cut its final evaluation after every update (issue 16's recipe 3 BF16 run,
    session 37) moves as its resume state at N = run.steps: `qerl run` there starts eval@N and the
    report and nothing else, and the evaluation has the uninterrupted run's bytes."""
    ws, _ = moved_run(reference_run, tmp_path, (f"eval/step={STEPS}", "reports"), trained=STEPS)
    res = sh(["qerl", "run", "-c", "params.yaml"], cwd=ws)
    started = re.findall(r"… (\w+@\w+|\w+)$", res.stdout + res.stderr, flags=re.M)
    # prepare, convert and init_adapter rebuild what the state leaves out (data, the base, adapters/step=0)
    rebuilt = ("prepare", "convert", "init_adapter")
    assert [s for s in started if s not in rebuilt] == [f"eval@{STEPS}", "report"], started
    rel = f"eval/step={STEPS}/samples.parquet"
    assert (ws / rel).read_bytes() == (reference_run / rel).read_bytes()
