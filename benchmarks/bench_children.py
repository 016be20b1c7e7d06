"""Child processes of a benchmark: run one and kill its whole process group on a timeout, or start several
at once and hand the GPU to one at a time (`benchmarks/rollout_throughput.py --overlap-starts`)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def run_child(cmd: list[str], timeout: float) -> int | str:
    """Run `cmd` in its own process group; on timeout kill the whole group and return "timeout".

    Killing only the child would leave vLLM's EngineCore process alive: it keeps the GPU memory and
    the stdout pipe (session 5: `bench | tee` then waited until the device call's own limit).
    """
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "timeout"


def wait_for_turn(turn_dir: Path, spec: str, give_up_at: float, poll_s: float = 0.5) -> bool:
    """With `--overlap-starts`, in the child: say that this engine is up (the file `SPEC.up` in `turn_dir`),
    then block until the driver hands it the GPU (`SPEC.go`); False once `give_up_at` passes first (no time
    left for a cell)."""
    (turn_dir / f"{spec}.up").touch()
    go = turn_dir / f"{spec}.go"
    while not go.exists():
        if time.time() >= give_up_at:
            return False
        time.sleep(poll_s)
    return True


def run_overlapped(cmds: list[tuple[str, list[str]]], turn_dir: Path, deadline: float, stagger_s: float,
                   poll_s: float = 0.5) -> dict[str, int | str]:
    """Start every child at once (`stagger_s` apart: engines that profile their memory at the same instant
    misjudge it), wait until each is up (`SPEC.up`, from `wait_for_turn`) or gone, so that no start-up (weight
    loads, memory profiling, CUDA-graph capture) runs on the GPU beside a measurement, then hand out turns in
    order: a child's turn is the file `SPEC.go` in `turn_dir`, and it ends when the child exits (it closes its
    engine after its cells). No turn is handed out past `deadline`, and a child still running then is killed
    with its process group (`run_child`'s reason). Returns each spec's exit code, or "timeout"."""
    turn_dir.mkdir(parents=True, exist_ok=True)
    for f in [*turn_dir.glob("*.go"), *turn_dir.glob("*.up")]:
        f.unlink()
    procs: dict[str, subprocess.Popen] = {}
    for n, (spec, cmd) in enumerate(cmds):
        if n:
            time.sleep(stagger_s)
        procs[spec] = subprocess.Popen(cmd, start_new_session=True)
    while time.time() < deadline and not all((turn_dir / f"{s}.up").exists() or p.poll() is not None
                                             for s, p in procs.items()):
        time.sleep(poll_s)
    print(f"== engines up: {sorted(s for s in procs if (turn_dir / f'{s}.up').exists())} "
          f"({deadline - time.time():.0f} s left)", flush=True)
    rcs: dict[str, int | str] = {}
    for spec, proc in procs.items():
        if time.time() >= deadline:  # no turn for the rest: killed below
            break
        (turn_dir / f"{spec}.go").touch()
        print(f"== turn of engine {spec} ({deadline - time.time():.0f} s left)", flush=True)
        try:
            rcs[spec] = proc.wait(timeout=deadline - time.time())
        except subprocess.TimeoutExpired:
            rcs[spec] = "timeout"
    for spec, proc in procs.items():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rcs[spec] = "timeout"
    return rcs
