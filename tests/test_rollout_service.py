"""The rollout service (`qerl serve`) on the CPU: the project's server with vLLM's endpoints, and
the client every stage uses, on the tests' tiny two-step pipeline.

- `qerl serve` + `qerl run` and `qerl serve` + `dvc repro` give the bytes of an in-process
  `qerl run` (rollouts, scored rows, adapters, optimizer states, eval samples); the Prefect flow's
  own server is checked in tests/test_flows.py (`flow_done` runs with it);
- the update stage puts a colocated server to sleep and wakes it;
- a server killed in the middle of a rollout, a server of another checkpoint, an address that does
  not answer, and a stale address file: each a clear error (or, for the stale file, in-process
  sampling) and nothing half-written.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import copy_repo, make_dvc_repo, quiet_env, sh, write_params

STEPS = 2
EVALS = [0, 2]
SAME_BYTES = (
    [f"rollouts/step={i}/rollouts.parquet" for i in range(STEPS)]
    + [f"rewards/step={i}/{n}" for i in range(STEPS) for n in ("scored.parquet", "metrics.json")]
    + [f"adapters/step={i}/{n}" for i in range(STEPS + 1) for n in ("adapter_model.safetensors", "trainer_state.json")]
    + [f"adapters/step={i}/optimizer.pt" for i in range(1, STEPS + 1)]
    + [f"eval/step={k}/samples.parquet" for k in EVALS]
)


@contextmanager
def serving(ws: Path, *args: str, env: dict | None = None):
    """`qerl serve -c params.yaml` in `ws` until the block ends; yields (url, process)."""
    addr = ws / "rollout_server.json"
    addr.unlink(missing_ok=True)
    log = open(ws / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "qerl_lib", "serve", "-c", "params.yaml", *args], cwd=ws,
                            env=quiet_env(**(env or {})), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while not addr.is_file():
            assert proc.poll() is None, (ws / "serve.log").read_text()[-3000:]
            assert time.time() < deadline, "qerl serve did not announce itself"
            time.sleep(0.2)
        yield json.loads(addr.read_text())["url"], proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        log.close()


def server_info(url: str) -> dict:
    from qerl_lib.rollout.client import RemoteEngine

    return RemoteEngine(url).rpc("qerl_info")


@pytest.fixture(scope="module")
def converted(tiny_pipeline, tmp_path_factory) -> Path:
    """A workspace of the tests' pipeline with prepare, convert and init_adapter done."""
    ws = tmp_path_factory.mktemp("served")
    write_params(ws, tiny_pipeline)
    for stage in ("prepare", "convert", "init_adapter"):
        sh(["qerl", "stage", stage, "-c", "params.yaml"], cwd=ws, timeout=300)
    return ws


def _same_bytes(a: Path, b: Path) -> None:
    for rel in SAME_BYTES:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


@pytest.mark.reproduces
def test_serve_and_qerl_run_give_the_bytes_of_an_in_process_run(converted, reference_run, tmp_path):
    ws = copy_repo(converted, tmp_path / "ws")
    with serving(ws) as (url, proc):
        sh(["qerl", "run", "-c", "params.yaml"], cwd=ws, timeout=600)
        info = server_info(url)
    assert proc.returncode == 0
    assert not (ws / "rollout_server.json").exists(), "the server removes its address file when it stops"
    _same_bytes(ws, reference_run)
    client = json.loads((ws / "rollout_client.json").read_text())
    assert client["server"] == url and client["generate_calls"] >= 1  # the stages really sampled there
    assert info["backend"] == "transformers" and info["sleeps"] == STEPS  # each update slept the server


@pytest.mark.reproduces
def test_serve_and_dvc_repro_give_the_bytes_of_an_in_process_run(tiny_pipeline, reference_run, tmp_path):
    repo = make_dvc_repo(tmp_path / "repo", tiny_pipeline)
    sh(["dvc", "repro", "init_adapter"], cwd=repo, timeout=600)  # the server serves the converted checkpoint
    with serving(repo):
        res = sh(["dvc", "repro"], cwd=repo, timeout=900)
    assert "Running stage 'rollout@1'" in res.stdout
    _same_bytes(repo, reference_run)
    assert json.loads((repo / "rollout_client.json").read_text())["generate_calls"] >= 1
    assert "rollout_server.json" not in sh(["git", "status", "--porcelain"], cwd=repo).stdout


@pytest.mark.reproduces
def test_server_killed_mid_rollout_fails_clearly_and_the_rerun_succeeds(converted, reference_run, tmp_path):
    from qerl_lib.rollout.client import RemoteEngine

    ws = copy_repo(converted, tmp_path / "ws")
    # A longer rollout than the pipeline's, so that the kill lands while rows are being sampled.
    long = ["-s", "rollout.max_new_tokens=24", "-s", "rollout.prompts_per_step=16", "-s", "rollout.group_size=16"]
    with serving(ws, *long) as (url, proc):
        stage = subprocess.Popen([sys.executable, "-m", "qerl_lib", "stage", "rollout", "--step", "0",
                                  "-c", "params.yaml", *long], cwd=ws, env=quiet_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
        engine = RemoteEngine(url)
        deadline = time.time() + 120
        while not any(m.get("parent") for m in engine.models()):  # the stage loaded its adapter
            assert stage.poll() is None, stage.stdout.read()
            assert time.time() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        proc.kill()
        out, _ = stage.communicate(timeout=120)
    assert stage.returncode == 1, out
    assert "rollout server at" in out and "Traceback" not in out, out
    assert not (ws / "rollouts" / "step=0").exists() or not any((ws / "rollouts" / "step=0").iterdir())
    assert not list((ws / "rollouts").glob(".*tmp*")) if (ws / "rollouts").exists() else True
    # The address file of the killed server is stale now: the next stage finds a new server.
    with serving(ws, *long):
        sh(["qerl", "stage", "rollout", "--step", "0", "-c", "params.yaml", *long], cwd=ws, timeout=300)
    ref = copy_repo(converted, tmp_path / "ref")
    sh(["qerl", "stage", "rollout", "--step", "0", "-c", "params.yaml", *long], cwd=ref, timeout=300,
       QERL_ROLLOUT_SERVER="off")
    assert (ws / "rollouts/step=0/rollouts.parquet").read_bytes() == (ref / "rollouts/step=0/rollouts.parquet").read_bytes()


def test_a_server_of_another_checkpoint_is_refused(converted, tiny_pipeline, tiny_qwen2_dir, tmp_path):
    other = tmp_path / "other"
    write_params(other, {**tiny_pipeline, "model": {"base": str(tiny_qwen2_dir)}})
    sh(["qerl", "stage", "convert", "-c", "params.yaml"], cwd=other, timeout=300)
    ws = copy_repo(converted, tmp_path / "ws")
    with serving(other) as (url, _):
        res = sh(["qerl", "stage", "rollout", "--step", "0", "-c", "params.yaml"], cwd=ws, check=False,
                 QERL_ROLLOUT_SERVER=url)
    assert res.returncode == 2, res.stderr
    assert "serves checkpoint" in res.stderr and str((other / "models/nvfp4").resolve()) in res.stderr
    assert not (ws / "rollouts").exists()


def test_an_address_that_does_not_answer_fails_clearly(converted, tmp_path):
    import socket

    ws = copy_repo(converted, tmp_path / "ws")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = sh(["qerl", "stage", "eval", "--step", "0", "-c", "params.yaml"], cwd=ws, check=False,
             QERL_ROLLOUT_SERVER=f"http://127.0.0.1:{port}")
    assert res.returncode == 1, res.stderr
    assert f"rollout server at http://127.0.0.1:{port} is not answering" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (ws / "eval").exists()


@pytest.mark.reproduces
def test_a_stale_address_file_is_ignored(converted, reference_run, tmp_path):
    ws = copy_repo(converted, tmp_path / "ws")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (ws / "rollout_server.json").write_text(json.dumps({"url": "http://127.0.0.1:9", "pid": dead.pid,
                                                         "host": os.uname().nodename}))
    res = sh(["qerl", "-v", "stage", "rollout", "--step", "0", "-c", "params.yaml"], cwd=ws)
    assert "is gone" in res.stdout + res.stderr
    assert (ws / "rollouts/step=0/rollouts.parquet").read_bytes() == \
        (reference_run / "rollouts/step=0/rollouts.parquet").read_bytes()


def test_update_sleeps_a_colocated_server_only(converted, tmp_path, monkeypatch):
    """server_asleep: a server on this process's devices sleeps during the block and wakes after
    (also when the block fails); one on other devices is left alone."""
    from qerl_lib.rollout import client as cl

    ws = copy_repo(converted, tmp_path / "ws")
    with serving(ws) as (url, _):
        with pytest.raises(RuntimeError):
            with cl.server_asleep(ws) as slept:
                assert slept and cl.RemoteEngine(url).is_sleeping()
                raise RuntimeError("training failed")
        assert not cl.RemoteEngine(url).is_sleeping()
        monkeypatch.setattr(cl, "local_devices", lambda: ["GPU-elsewhere"])
        with cl.server_asleep(ws) as slept:
            assert not slept and not cl.RemoteEngine(url).is_sleeping()


def test_a_non_finite_adapter_is_refused_as_bad_input_before_the_server_sees_it(converted, tmp_path):
    from safetensors.torch import load_file, save_file

    ws = copy_repo(converted, tmp_path / "ws")
    path = ws / "adapters/step=0/adapter_model.safetensors"
    state = load_file(str(path))
    name = sorted(state)[0]
    state[name][0] = float("nan")
    save_file(state, str(path))
    with serving(ws):
        res = sh(["qerl", "stage", "rollout", "--step", "0", "-c", "params.yaml"], cwd=ws, check=False)
    assert res.returncode == 2, res.stderr
    assert "adapters/step=0/adapter_model.safetensors" in res.stderr and name in res.stderr and "NaN" in res.stderr
    assert not (ws / "rollouts").exists()
