"""Run one command so that it dies with the process that started it.

    python tasks/_guard.py -- dvc repro --single-item rollout@3
    python tasks/_guard.py --reap PID          (watch: end process PID when our parent dies)

The Prefect task starts this guard in a process group of its own (not the flow's) with the
Linux parent-death signal set (SIGTERM when the flow process dies, even by SIGKILL). The guard
starts the command in a second new process group (same session) and, on SIGTERM / SIGINT /
SIGHUP, or when it sees that its parent is gone (polled twice a second: the fallback where the
death signal is missing), kills that whole group (DVC and the `qerl stage` it runs). So a killed
flow never leaves a stage running on behind its back, holding the GPU or DVC's lock:

- SIGKILL of the flow process alone: the guard gets its death signal and kills the stage;
- SIGKILL of the flow's whole process group: the guard is not in that group, so it survives the
  kill long enough to do the same (the guard used to share the flow's group, while the stage ran
  in a session of its own: the kill took the guard and left the stage running).

The stage's outputs are written through temporary names, so a stage killed half-way leaves
nothing half-written and is simply run again on resume.

`--reap PID` is the flows' watchdog of the temporary Prefect server (`flows.common`): Prefect
starts that server as a child of the flow process and stops it at exit, which a killed flow never
reaches. The watchdog ends when PID does, and sends PID SIGTERM (SIGKILL after a grace period)
when its own parent, the flow process, dies first.

Exit status: the command's own, or 128 + signal number when the guard had to kill it.
Standard library only: it starts in a few tens of milliseconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

GRACE_SECONDS = 5.0  # SIGTERM first, SIGKILL after this
POLL_SECONDS = 0.5


def _parent_gone(parent: str | None) -> bool:
    """Whether the process that started us has died (we were re-parented)."""
    return bool(parent) and os.getppid() != int(parent)


def _start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (field 22 of /proc/PID/stat), to tell it from a reused pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def reap(pid: int, parent: str | None) -> int:
    """Wait until `pid` exits (return 0) or our parent dies (then end `pid`: SIGTERM, SIGKILL after
    the grace period)."""
    started = _start_time(pid)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    while True:
        if _start_time(pid) != started or started is None:
            return 0  # gone (or never seen): nothing to do
        if stop["now"] or _parent_gone(parent):
            break
        time.sleep(POLL_SECONDS)
    deadline = time.monotonic() + GRACE_SECONDS
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return 0
        while time.monotonic() < deadline and _start_time(pid) == started:
            time.sleep(0.1)
        if _start_time(pid) != started:
            return 0
    return 0


def main(argv: list[str]) -> int:
    parent = os.environ.get("QERL_GUARD_PARENT")
    if argv[:1] == ["--reap"] and len(argv) == 2:
        return reap(int(argv[1]), parent)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("usage: _guard.py -- COMMAND [ARGS...] | _guard.py --reap PID", file=sys.stderr)
        return 2
    # A new process group in our session: killpg reaches DVC, the stage and what they start.
    child = subprocess.Popen(argv, process_group=0)
    state = {"sig": 0, "deadline": 0.0}

    def killpg(sig: int) -> None:
        try:
            os.killpg(child.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(signum, _frame):
        # Only signal here: waiting belongs to the main loop (Popen.wait is not re-entrant).
        if not state["sig"]:
            state["sig"] = signum
            state["deadline"] = time.monotonic() + GRACE_SECONDS
        killpg(signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    while True:
        # The parent may have died before its death signal was armed, or on a system without it.
        if not state["sig"] and _parent_gone(parent):
            stop(signal.SIGTERM, None)
        try:
            rc = child.wait(timeout=POLL_SECONDS)
            break
        except subprocess.TimeoutExpired:
            if state["sig"] and time.monotonic() > state["deadline"]:
                killpg(signal.SIGKILL)
    if state["sig"]:
        killpg(signal.SIGKILL)  # stragglers of the group (the stage under DVC)
        return 128 + state["sig"]
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
