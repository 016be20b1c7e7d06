"""Progress inside a stage: heartbeat lines without a terminal (cadence on a fake clock), the update
stage's micro-batch counts, and the Prefect task turning heartbeat lines into artifact updates."""

from __future__ import annotations

import io
import stat
import sys

import pytest

from qerl_lib.progress import Heartbeat, Tracker, parse_heartbeat, progress


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_heartbeat_writes_a_line_at_start_and_then_once_per_period_on_a_fake_clock():
    clock = FakeClock()
    out = io.StringIO()
    tracker = Tracker("rollout@0", 32, "rows", clock)
    beat = Heartbeat(tracker, out, interval=20.0)
    assert beat.tick()  # the first tick always writes (the work has started)
    written = [0.0]
    for step in range(1, 121):  # two minutes of ticks every second, rows finishing now and then
        clock.t += 1.0
        if step % 15 == 0:
            tracker.update(step // 15 * 3)
        if beat.tick():
            written.append(step)
    gaps = [b - a for a, b in zip(written, written[1:])]
    assert gaps and all(g == 20.0 for g in gaps), written  # one line per period, never more, never fewer
    lines = out.getvalue().splitlines()
    assert len(lines) == len(written) == beat.lines
    last = parse_heartbeat(lines[-1])
    assert last["label"] == "rollout@0" and last["total"] == 32 and last["unit"] == "rows"
    assert last["done"] == 24 and last["elapsed"] == 120
    # rate so far: 24 rows in 120 s -> the 8 rows left take 120 * 8 / 24 s
    assert last["eta"] == 40
    assert parse_heartbeat(lines[0])["eta"] is None  # nothing measured yet: "ETA ?"


def test_the_in_flight_share_moves_percent_and_eta_inside_a_batch():
    clock = FakeClock()
    tracker = Tracker("eval@0 greedy", 64, "rows", clock)
    clock.t += 30.0
    tracker.update(0, inflight=16.0)  # a batch of 32 rows, half decoded
    hb = parse_heartbeat("2026-12-04 INFO | " + tracker.line())  # a log prefix in front still parses
    assert hb["done"] == 0 and hb["percent"] == 25 and hb["eta"] == 90


def test_progress_without_a_terminal_writes_parseable_start_and_end_lines(monkeypatch):
    monkeypatch.delenv("QERL_NO_PROGRESS", raising=False)
    out = io.StringIO()
    with progress("update@3", 6, "micro-batches", stream=out, tty=False) as done:
        for i in range(1, 7):
            done(i)
    lines = [parse_heartbeat(x) for x in out.getvalue().splitlines()]
    assert all(lines) and len(lines) == 2
    assert (lines[0]["done"], lines[-1]["done"], lines[-1]["total"], lines[-1]["percent"]) == (0, 6, 6, 100)
    monkeypatch.setenv("QERL_NO_PROGRESS", "1")
    with progress("update@3", 6, stream=out, tty=False) as done:
        assert done is None


def test_the_waker_thread_writes_lines_while_no_callback_comes(monkeypatch):
    """A batch that runs long without calling back still gets its heartbeat (real threads, short period)."""
    import time

    monkeypatch.delenv("QERL_NO_PROGRESS", raising=False)
    monkeypatch.setenv("QERL_PROGRESS_SECONDS", "0.2")
    out = io.StringIO()
    with progress("rollout@1", 8, stream=out, tty=False):
        time.sleep(1.1)
    n = len(out.getvalue().splitlines())
    assert 4 <= n <= 9, out.getvalue()  # start + ~5 beats + end


def test_update_stage_reports_micro_batches_done_of_total(scored_workspace, tmp_path, monkeypatch, capsys):
    from conftest import copy_workspace
    from qerl_lib.stages import update_stage
    from qerl_lib.trainer import update_work

    monkeypatch.delenv("QERL_NO_PROGRESS", raising=False)
    cfg, layout = scored_workspace
    work = copy_workspace(layout, tmp_path / "w")
    c = cfg.model_copy(deep=True)
    c.run.root = str(work.root)
    # 12 kept rows, micro-batch 2, 2 mini-batches: 6 training passes + 6 no-grad behaviour passes
    assert update_work(12, c) == 12
    capsys.readouterr()
    update_stage(c, work, 0)
    beats = [parse_heartbeat(x) for x in capsys.readouterr().err.splitlines()]
    beats = [b for b in beats if b and b["label"] == "update@0"]
    assert beats[0]["done"] == 0 and beats[-1]["done"] == beats[-1]["total"] == 12
    assert beats[-1]["unit"] == "micro-batches"


def test_update_work_counts_one_ranks_share():
    from qerl_lib.config import load_config
    from qerl_lib.trainer import update_work

    cfg = load_config(None, {"optim": {"micro_batch_size": 8}, "algo": {"mini_batches": 1}})
    assert update_work(32, cfg) == 4 and update_work(33, cfg) == 5 and update_work(0, cfg) == 0
    assert update_work(32, cfg, world_size=2) == 2 and update_work(40, cfg, world_size=2) == 3


def test_the_task_moves_the_progress_artifact_from_heartbeat_lines_rate_limited(tmp_path):
    """`run_dvc_stage` parses the stage's heartbeat lines (here from a stand-in for `dvc repro`) and
    `ArtifactProgress` turns them into artifact updates, at most one per `min_seconds`."""
    from tasks.stage import ArtifactProgress, progress_within, run_dvc_stage

    lines = ["Running stage 'rollout@2':", "> qerl stage rollout --step 2",
             "qerl-progress rollout@2: 0/32 rows (0%), 0 s elapsed, ETA ?",
             "qerl-progress rollout@2: 8/32 rows (25%), 20 s elapsed, ETA 60 s",
             "qerl-progress rollout@2: 16/32 rows (50%), 40 s elapsed, ETA 40 s",
             "qerl-progress rollout@2: 32/32 rows (100%), 70 s elapsed, ETA 0 s",
             "Updating lock file 'dvc.lock'"]
    fake = tmp_path / "dvc"
    fake.write_text(f"#!{sys.executable}\nimport sys\nprint({lines!r} and '\\n'.join({lines!r}))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)

    class Log:
        def __init__(self):
            self.lines = []

        def info(self, msg, *a):
            self.lines.append(msg % a if a else msg)

        error = warning = info

    seen = []
    run_dvc_stage(tmp_path, "rollout@2", Log(), dvc=str(fake), on_progress=seen.append)
    assert [h["done"] for h in seen] == [0, 8, 16, 32] and seen[1]["eta"] == 60

    clock = FakeClock()
    updates = []
    art = ArtifactProgress(lambda pct, desc: updates.append((pct, desc)), index=5, total=10, title="train ws",
                           min_seconds=5.0, clock=clock)
    for hb, dt in zip(seen, (0.0, 1.0, 10.0, 1.0)):  # the 2nd and 4th come too soon after the one before
        clock.t += dt
        art(hb)
    assert [round(p, 2) for p, _ in updates] == [50.0, 55.0]
    assert updates[1][1] == "train ws: 5/10 stages done; rollout@2 16/32 rows (50%), 40 s elapsed, ETA 40 s"
    assert progress_within(seen[3], 9, 10, "t")[0] == pytest.approx(100.0)
