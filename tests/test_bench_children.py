"""`benchmarks/bench_children.py`: a benchmark's child processes, killed with their whole process group on a
timeout, or started together and given the GPU one at a time (`rollout_throughput.py --overlap-starts`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import bench_children as bc  # noqa: E402


def test_run_child_kills_the_whole_process_group_on_timeout(tmp_path):
    """vLLM's EngineCore is a grandchild of the benchmark: a timeout must take it down too."""
    pid_file = tmp_path / "grandchild.pid"
    child = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
             f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    t0 = time.time()
    assert bc.run_child([sys.executable, "-c", child], timeout=3) == "timeout"
    assert time.time() - t0 < 30
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # reaped by init once killed; wait for the kernel to finish it
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        if subprocess.run(["ps", "-o", "stat=", "-p", str(grandchild)], capture_output=True, text=True).stdout.strip().startswith("Z"):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"grandchild {grandchild} survived the timeout")
    assert bc.run_child([sys.executable, "-c", "raise SystemExit(3)"], timeout=30) == 3


def _engine_like(spec: str, log: Path, turns: Path, hold_s: float = 0.3) -> list[str]:
    """A child that behaves like an engine of the benchmark: up at once, then its turn, then its cells."""
    code = (f"import sys, time; sys.path.insert(0, {str(ROOT)!r}); from pathlib import Path; "
            f"from benchmarks.bench_children import wait_for_turn; "
            f"log = open({str(log)!r}, 'a', buffering=1); log.write('up {spec}\\n'); "
            f"ok = wait_for_turn(Path({str(turns)!r}), {spec!r}, time.time() + 30, poll_s=0.05); "
            f"log.write(('turn ' if ok else 'gave up ') + {spec!r} + '\\n'); time.sleep({hold_s}); "
            f"log.write('done {spec}\\n')")
    return [sys.executable, "-c", code]


def test_overlapped_children_start_together_and_take_turns(tmp_path: Path):
    log, turns = tmp_path / "log", tmp_path / "turns"
    specs = ["bf16-r16-ds", "nvfp4g-r16-pdl-rp", "bf16-r16"]
    rcs = bc.run_overlapped([(s, _engine_like(s, log, turns)) for s in specs], turns, time.time() + 60,
                            stagger_s=0.2, poll_s=0.05)
    assert rcs == dict.fromkeys(specs, 0)
    lines = log.read_text().split("\n")[:-1]
    # every engine is up before the first one measures (no start-up beside a measurement); the turns
    # follow the order given and never overlap
    assert sorted(lines[:3]) == sorted(f"up {s}" for s in specs)
    assert lines[3:] == [f"{what} {s}" for s in specs for what in ("turn", "done")]


def test_a_child_that_dies_starting_does_not_hold_the_others(tmp_path: Path):
    log, turns = tmp_path / "log", tmp_path / "turns"
    cmds = [("broken", [sys.executable, "-c", "raise SystemExit(4)"]), ("ok", _engine_like("ok", log, turns))]
    rcs = bc.run_overlapped(cmds, turns, time.time() + 60, stagger_s=0.1, poll_s=0.05)
    assert rcs == {"broken": 4, "ok": 0} and "done ok" in log.read_text()


def test_a_child_past_the_deadline_is_killed_and_the_next_never_measures(tmp_path: Path):
    log, turns = tmp_path / "log", tmp_path / "turns"
    cmds = [("slow", _engine_like("slow", log, turns, hold_s=60)), ("next", _engine_like("next", log, turns))]
    t0 = time.time()
    rcs = bc.run_overlapped(cmds, turns, time.time() + 3, stagger_s=0.1, poll_s=0.05)
    assert rcs == {"slow": "timeout", "next": "timeout"} and time.time() - t0 < 20
    assert "turn slow" in log.read_text() and "done slow" not in log.read_text()
    assert "done next" not in log.read_text()


def test_wait_for_turn_gives_up_at_its_time(tmp_path: Path):
    t0 = time.time()
    assert not bc.wait_for_turn(tmp_path, "bf16-r16", t0 + 0.3, poll_s=0.05)
    assert 0.3 <= time.time() - t0 < 5
    (tmp_path / "bf16-r16.go").touch()
    assert bc.wait_for_turn(tmp_path, "bf16-r16", t0, poll_s=0.05)  # a turn already given is taken at once
