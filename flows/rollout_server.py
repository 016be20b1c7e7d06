"""The rollout server of one flow run: started once, used by every stage, stopped at the end.

`rollout_server` (a flow parameter) says which:
- `"start"` (default): the flow starts `qerl serve` in the workspace right before the first
  rollout or eval stage that runs (the server serves the converted checkpoint, so it cannot start
  before `convert`), waits until it answers, and stops it when the flow ends, also after a
  failure. It runs under the stage guard (`tasks/_guard.py`, parent-death signal), so a killed
  flow takes it along.
- an address (`http://host:port`): an external server the user started (`qerl serve` elsewhere,
  on another GPU or machine); the flow waits until it answers and never stops it.
- `"none"`: no server; every stage samples in its own process.

Stages learn the address from `QERL_ROLLOUT_SERVER` in their environment: never a DVC param,
and never an output byte (`qerl_lib.rollout.service`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from qerl_lib.rollout.service import ENV, address_file

SAMPLING_STAGES = ("rollout@", "eval@")
READY_TIMEOUT_S = float(os.environ.get("QERL_SERVE_READY_TIMEOUT", "900"))
STOP_TIMEOUT_S = 30.0


class ServerStartError(RuntimeError):
    pass


def _wait_ready(url: str | None, proc: subprocess.Popen | None, ws: Path, t_start: float, log) -> str:
    """Wait until the server answers /health; with `proc`, until it announced itself in the
    workspace's address file. Returns its URL."""
    import json

    from qerl_lib.rollout.client import RemoteEngine

    deadline = time.time() + READY_TIMEOUT_S
    while time.time() < deadline:
        if proc is not None:
            if proc.poll() is not None:
                raise ServerStartError(f"`qerl serve` exited with {proc.returncode} before it answered "
                                       f"(log: {ws / '.dvc/tmp/qerl-serve.log'})")
            path = address_file(ws)
            try:
                if path.stat().st_mtime >= t_start - 1:
                    url = json.loads(path.read_text())["url"]
            except (OSError, ValueError, KeyError):
                pass
        if url and RemoteEngine(url, timeout=5).health():
            return url
        time.sleep(0.5)
    raise ServerStartError(f"the rollout server did not answer within {READY_TIMEOUT_S:.0f}s")


@contextmanager
def rollout_service(ws: Path, setting: str | None, log) -> Iterator[Callable[[str], None]]:
    """Yields `before(stage)`, to call before each stage that runs (module doc)."""
    from tasks.stage import _GUARD, _set_parent_death_signal, stage_env

    setting = (setting or "start").strip()
    state: dict = {"proc": None, "url": None, "log": None}
    old_env = os.environ.get(ENV)

    def use(url: str) -> None:
        os.environ[ENV] = url
        state["url"] = url

    def before(stage: str) -> None:
        if state["url"] is not None or setting.lower() in ("none", "off") or not stage.startswith(SAMPLING_STAGES):
            return
        if setting.lower() != "start":
            log.info("rollout server: waiting for %s", setting)
            use(_wait_ready(setting.rstrip("/"), None, ws, time.time(), log))
            return
        log_path = ws / ".dvc" / "tmp" / "qerl-serve.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        state["log"] = open(log_path, "ab")
        t_start = time.time()
        env = stage_env()
        env.pop(ENV, None)
        state["proc"] = subprocess.Popen(
            [sys.executable, _GUARD, "--", sys.executable, "-m", "qerl_lib", "serve", "-c", "params.yaml"],
            cwd=ws, env=env, stdout=state["log"], stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=_set_parent_death_signal)
        url = _wait_ready(None, state["proc"], ws, t_start, log)
        log.info("rollout server started for this flow run at %s in %.1fs (log: %s)", url, time.time() - t_start,
                 log_path)
        use(url)

    if setting.lower() not in ("start", "none", "off"):
        os.environ[ENV] = setting.rstrip("/")  # an external server: the stages use it, the flow never stops it
    elif setting.lower() in ("none", "off"):
        os.environ[ENV] = "off"
    try:
        yield before
    finally:
        proc = state["proc"]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the guard stops the server's process group
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.info("rollout server stopped")
        if state["log"] is not None:
            state["log"].close()
        if old_env is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old_env
