"""Kill points: a real SIGKILL of a stage's process group at a write (before or after an
`os.replace`, in the middle of a `torch.save` / `write_table` with the file cut to half), inside
training, and of a Prefect flow's process group or its process alone. After each, running the
same stage again (what `qerl run`, `dvc repro` and the flows do) gives the bytes of an
uninterrupted run and leaves no temporary behind; a finished-looking stage (its done-marker
present) is always complete. Concurrency: a second call of the same stage is refused without
touching the first one's temporaries, and a `dvc repro` beside a `qerl run` deletes nothing.

The cases are listed, with the rest of the fault matrix, in docs/reliability.md.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import PROJECT_ROOT, make_dvc_repo, quiet_env, sh
from faultkit import (assert_same_outputs, copy_ws, done_marker, kill_at, outputs, partial_files, qerl,
                      snapshot, stage_argv)

from qerl_lib.cli import main

# (id, stage, module, attribute, argument substring, when, nth call, start from the reference)
KILLS = [
    # R1: the done-marker (test.parquet) must be committed last
    ("prepare-between-renames", "prepare", "os", "replace", "prepared", "after", 1, False),
    ("prepare-half-written", "prepare", "pyarrow.parquet", "write_table", ".train.parquet.", "half", 1, False),
    # R2: no writer nested inside another's temporary directory
    ("init_adapter-config-json", "init_adapter", "os", "replace", "step=0", "after", 1, False),
    ("init_adapter-before-swap", "init_adapter", "os", "replace", "adapters/step=0", "before", 1, False),
    ("rollout-half-written", "rollout@0", "pyarrow.parquet", "write_table", ".rollouts.parquet.", "half", 1, False),
    ("reward-between-outputs", "reward@0", "os", "replace", "metrics.json", "before", 1, False),
    ("update-inside-training", "update@0", "qerl_lib.trainer", "train_on_rollouts", "", "before", 1, False),
    ("update-optimizer-half-written", "update@0", "torch", "save", "optimizer.pt", "half", 1, False),
    ("update-before-adapter-swap", "update@0", "os", "replace", "adapters/step=1", "before", 1, False),
    ("update-before-metrics", "update@0", "os", "replace", "update.json", "before", 1, False),
    # a re-run over an existing adapter: killed between `step=1 -> .step=1.old` and `tmp -> step=1`
    ("update-rerun-half-swapped", "update@0", "os", "replace", "adapters/step=1", "before", 2, True),
    ("eval-half-written", "eval@0", "pyarrow.parquet", "write_table", ".samples.parquet.", "half", 1, False),
    # R2: the resolved config's temporary (`.config.yaml.*.tmp`)
    ("config-yaml", "reward@0", "os", "replace", "config.yaml", "before", 1, False),
]


def _fresh(fault_ws: Path, fault_ref: Path, tmp_path: Path, label: str, from_ref: bool) -> Path:
    """A copy of the workspace in which stage `label` has not run (or, `from_ref`, has run and
    is asked to run again: its done-marker removed, as after a changed param)."""
    ws = copy_ws(fault_ref if from_ref else fault_ws, tmp_path / "ws")
    if from_ref:
        done_marker(ws, label).unlink()
    else:
        for p in outputs(ws, label):
            p.unlink()
    return ws


@pytest.mark.reproduces
@pytest.mark.parametrize("case", KILLS, ids=[k[0] for k in KILLS])
def test_kill_point_resumes_identical_and_leaves_nothing(case, fault_ws, fault_ref, tmp_path):
    _, label, module, attr, match, when, nth, from_ref = case
    ws = _fresh(fault_ws, fault_ref, tmp_path, label, from_ref)
    ref = fault_ref if label in ("update@0", "eval@0") else fault_ws  # where the stage ran uninterrupted
    kill_at(stage_argv(ws, label), module, attr, match, when, nth)
    marker = done_marker(ws, label)
    if marker.exists():  # a stage that looks finished must be finished (qerl run skips it)
        assert_same_outputs(ws, ref, label)
    else:  # what `qerl run` / `dvc repro` do next: the stage again (it sweeps what the kill left)
        assert main(stage_argv(ws, label)) == 0
    assert_same_outputs(ws, ref, label)
    assert not partial_files(ws), partial_files(ws)


def test_qerl_plan_killed_at_its_rename_leaves_nothing_after_the_next_plan(fault_ws, tmp_path):
    """R2: `.params.yaml.*.tmp` of a killed `qerl plan` (git showed it as untracked)."""
    ws = tmp_path / "plan"
    ws.mkdir()
    shutil.copy(fault_ws / "tiny.yaml", ws / "tiny.yaml")
    argv = ["plan", "-c", str(ws / "tiny.yaml"), "--params", str(ws / "params.yaml")]
    kill_at(argv, "os", "replace", "params.yaml", "before")
    assert [p.name for p in partial_files(ws)] and not (ws / "params.yaml").exists()
    assert main(argv) == 0
    assert not partial_files(ws), partial_files(ws)
    assert main(argv[:1] + ["--check"] + argv[1:]) == 0


# ---------------------------------------------------------------------------------------------
# R3: a killed Prefect flow ends its stage (and its temporary server)
# ---------------------------------------------------------------------------------------------

_FLOW = r"""
import os, subprocess, sys, time
sys.path.insert(0, {root!r})
from tasks.stage import _GUARD, _set_parent_death_signal, stage_env
# what tasks.stage.run_dvc_stage starts, with a stand-in for `dvc repro` that starts a "stage"
# grandchild (as DVC starts `qerl stage`) and writes its pid
stage = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)"
dvc = "import subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1], sys.argv[2]])"
subprocess.Popen([sys.executable, _GUARD, "--", sys.executable, "-c", dvc, stage, {pidfile!r}],
                 env=stage_env(), preexec_fn=_set_parent_death_signal)
time.sleep(120)
"""


def _wait_pid(path: Path, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"no pid in {path}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("how", ["process-group", "process"])
def test_sigkill_of_the_flow_ends_the_stage(how, tmp_path):
    pidfile = tmp_path / "stage.pid"
    flow = subprocess.Popen([sys.executable, "-c", _FLOW.format(root=str(PROJECT_ROOT), pidfile=str(pidfile))],
                            env=quiet_env(), start_new_session=True)
    stage = _wait_pid(pidfile)
    try:
        if how == "process-group":
            os.killpg(flow.pid, signal.SIGKILL)
        else:
            os.kill(flow.pid, signal.SIGKILL)
        flow.wait(timeout=10)
        assert _gone_within(stage, 15), f"stage pid {stage} still runs after the flow's {how} was killed"
    finally:
        if _alive(stage):
            os.kill(stage, signal.SIGKILL)


_SERVER_FLOW = r"""
import subprocess, sys, time
sys.path.insert(0, {root!r})
import prefect.server.api.server as server_mod
from flows.common import watch_temporary_server

srv = server_mod.SubprocessASGIServer.__new__(server_mod.SubprocessASGIServer, 1)
srv.server_process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open({pidfile!r}, "w").write(str(srv.server_process.pid) if watch_temporary_server() else "0")
time.sleep(120)
"""


def test_sigkill_of_the_flow_process_ends_its_temporary_prefect_server(tmp_path):
    pidfile = tmp_path / "server.pid"
    flow = subprocess.Popen([sys.executable, "-c", _SERVER_FLOW.format(root=str(PROJECT_ROOT), pidfile=str(pidfile))],
                            env=quiet_env(), start_new_session=True)
    server = _wait_pid(pidfile, timeout=120)
    assert server, "the temporary server was not found"
    try:
        os.kill(flow.pid, signal.SIGKILL)  # the flow process alone: its server child stays behind
        flow.wait(timeout=10)
        assert _gone_within(server, 15), f"temporary server pid {server} outlived the killed flow"
    finally:
        if _alive(server):
            os.kill(server, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# R4: concurrency
# ---------------------------------------------------------------------------------------------

_PAUSE_SCRIPT = r"""
import json, sys, time
import torch
orig = torch.save
def paused(obj, path, *a, **k):
    orig(obj, path, *a, **k)
    open(sys.argv[2], "w").write(str(path))
    time.sleep(120)
torch.save = paused
from qerl_lib.cli import main
sys.exit(main(json.loads(sys.argv[1])))
"""


def test_a_second_call_of_the_same_stage_is_refused_and_sweeps_nothing(fault_ws, tmp_path, capsys):
    ws = copy_ws(fault_ws, tmp_path / "ws")
    flag = tmp_path / "paused"
    first = subprocess.Popen([sys.executable, "-c", _PAUSE_SCRIPT, __import__("json").dumps(stage_argv(ws, "update@0")),
                              str(flag)], env=quiet_env(), start_new_session=True)
    try:
        written = Path(_wait_path(flag))  # the first call is inside its temporary adapter directory
        assert written.is_file() and written.parent.name.startswith(".step=1.")
        before = snapshot(ws)
        assert main(stage_argv(ws, "update@0")) == 2
        assert "already running" in capsys.readouterr().err
        assert written.is_file() and snapshot(ws) == before
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=10)


def _wait_path(path: Path, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text():
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"nothing in {path}")


def test_dvc_repro_beside_a_qerl_run_deletes_nothing(fault_ws, tiny_stoppy_llama_dir, tmp_path):
    """`qerl run` in a DVC workspace holds DVC's own repository lock: a `dvc repro` started then
    is refused before it removes any output (DVC removes a stage's outputs before its command,
    which alone would find qerl's lock)."""
    import yaml

    from qerl_lib.paths import Layout
    from qerl_lib.run import workspace_lock

    tree = yaml.safe_load((fault_ws / "tiny.yaml").read_text())
    tree["run"]["root"] = "."
    repo = make_dvc_repo(tmp_path / "repo", tree)
    shutil.copytree(fault_ws / "data", repo / "data")
    before = snapshot(repo / "data")
    with workspace_lock(Layout(repo)):  # what `qerl run` holds for its whole run
        res = sh(["dvc", "repro", "--single-item", "prepare"], cwd=repo, check=False)
    assert res.returncode != 0 and "lock" in (res.stdout + res.stderr).lower(), res.stdout + res.stderr
    assert snapshot(repo / "data") == before, "dvc repro removed outputs while qerl run held the workspace"


def test_qerl_run_is_refused_while_dvc_holds_its_lock(fault_ws, tmp_path, capsys):
    from qerl_lib import locks

    ws = copy_ws(fault_ws, tmp_path / "ws")
    (ws / ".dvc" / "tmp").mkdir(parents=True)
    with locks.dvc_repo_lock(ws, "test"):
        before = snapshot(ws)
        res = qerl(["run", "-c", str(ws / "tiny.yaml")])
        assert res.returncode == 2 and "DVC" in res.stderr, res.stderr
        assert snapshot(ws) == before


def test_a_hand_edited_params_yaml_under_dvc_loses_nothing(fault_ws, tmp_path):
    """R4, third point. DVC removes a stage's outputs before its command runs, and no qerl check
    can run earlier inside `dvc repro` (docs/reliability.md). The refused stage's message says
    how to get them back, and `dvc checkout` does restore them byte for byte from DVC's cache."""
    import yaml

    tree = yaml.safe_load((fault_ws / "tiny.yaml").read_text())
    tree["run"]["root"] = "."
    repo = make_dvc_repo(tmp_path / "repo", tree)
    sh(["dvc", "repro", "--single-item", "prepare"], cwd=repo)
    before = snapshot(repo / "data")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["data"]["max_train"] = -3  # a hand edit that `qerl stage` refuses
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    res = sh(["dvc", "repro", "--single-item", "prepare"], cwd=repo, check=False)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "data.max_train" in out and "dvc checkout prepare" in out, out
    sh(["dvc", "checkout", "prepare"], cwd=repo)
    assert snapshot(repo / "data") == before
