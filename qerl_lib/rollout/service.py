"""How a stage finds its workspace's rollout server, and the errors a server can raise.

Discovery, in order:
1. `QERL_ROLLOUT_SERVER` in the environment: an address (`http://host:port`), or `off` / `none`
   to sample in-process even when a server file exists. The Prefect flow passes the server it
   started (or the one the user named) this way.
2. `<run.root>/rollout_server.json`, written by `qerl serve` once the server answers and removed
   when it stops: `{"url", "pid", "host", "backend", "checkpoint", "started_at"}`. A file whose
   process is gone (same host, pid not alive) is stale: it is ignored with a warning, as if no
   server ran.
3. Otherwise: no server; the stage samples in its own process.

The address is never a config field or a DVC param, and it changes no output byte: a server
serves the same checkpoint (checked by hash, `client.RemoteEngine.check`) with the same sampling
arithmetic, so the rollouts of every door are the same.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from qerl_lib.io import pid_alive

log = logging.getLogger(__name__)

ENV = "QERL_ROLLOUT_SERVER"
"""Environment variable naming the server's address (`off` / `none`: never use one)."""
ADDRESS_FILE = "rollout_server.json"
"""File under the workspace root where `qerl serve` announces its address."""
OFF = {"off", "none", "0", "false", "no"}


class RolloutServerError(RuntimeError):
    """The rollout server did not answer, died, or failed a request. Transient: a re-run of the
    stage against a live server succeeds (the CLI exits 1, so Prefect retries it)."""


class ServerMismatch(ValueError):
    """The server serves another checkpoint or backend than this workspace's. Not transient:
    the CLI exits 2 with the message, and Prefect does not retry it."""


@dataclass(frozen=True)
class ServerAddress:
    url: str
    """Base URL, e.g. http://127.0.0.1:8000 (no trailing slash)."""
    source: str
    """Where the address came from: the environment variable or the address file."""


def address_file(root: str | Path) -> Path:
    from qerl_lib.paths import Layout

    return Layout(root).rollout_server_file


def find_server(root: str | Path) -> ServerAddress | None:
    """The rollout server a stage of workspace `root` should use, or None (module doc)."""
    env = os.environ.get(ENV, "").strip()
    if env:
        if env.lower() in OFF:
            return None
        return ServerAddress(env.rstrip("/"), f"${ENV}")
    path = address_file(root)
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text())
        url = str(info["url"]).rstrip("/")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ServerMismatch(f"{path}: not a rollout server address file ({e}); delete it or run `qerl serve` again")
    pid, host = info.get("pid"), info.get("host")
    if host == socket.gethostname() and isinstance(pid, int) and not pid_alive(pid):
        log.warning("ignoring %s: the server it names (pid %d) is gone; sampling in this process", path, pid)
        return None
    return ServerAddress(url, str(path))


def write_address(root: str | Path, info: dict) -> Path:
    from qerl_lib.io import atomic_write_json

    path = address_file(root)
    atomic_write_json(path, info)
    return path


def remove_address(root: str | Path, url: str) -> None:
    """Remove the address file if it still names `url` (a newer server's file is left alone)."""
    path = address_file(root)
    try:
        if json.loads(path.read_text()).get("url", "").rstrip("/") == url.rstrip("/"):
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def local_devices() -> list[str]:
    """Identifiers of the devices this process would train on: GPU UUIDs, or `cpu@host`.

    A server whose devices overlap these shares memory with the trainer (colocated): the update
    stage puts it to sleep while it trains."""
    try:
        import torch

        if torch.cuda.is_available():
            return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    except Exception:  # no torch / no driver: the CPU is the device
        pass
    return [f"cpu@{socket.gethostname()}"]
