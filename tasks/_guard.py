"""Run one command so that it dies with the process that started it.

    python tasks/_guard.py -- dvc repro --single-item rollout@3

The Prefect task starts this guard with the Linux parent-death signal set (SIGTERM when
the flow process dies, even by SIGKILL). The guard starts the command in a new process
group and, on SIGTERM / SIGINT / SIGHUP, kills that whole group (DVC and the `qerl stage`
it runs), so a killed flow never leaves a stage running on behind its back, holding the
GPU or DVC's lock. The stage's outputs are written through temporary names, so a stage
killed half-way leaves nothing half-written and is simply run again on resume.

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


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("usage: _guard.py -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    child = subprocess.Popen(argv, start_new_session=True)
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
    # The parent may have died before its death signal was armed.
    parent = os.environ.get("QERL_GUARD_PARENT")
    if parent and os.getppid() != int(parent):
        stop(signal.SIGTERM, None)
    while True:
        try:
            rc = child.wait(timeout=0.5)
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
