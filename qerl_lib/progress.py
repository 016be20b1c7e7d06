"""Progress of long work inside a stage (sampling, evaluation, the LoRA update), in every door.

`progress(label, total, unit)` yields a callback `done(n, inflight=0.0)`: n units finished
(rows sampled, micro-batches trained), plus `inflight`, the finished share of the units under
way counted in units (e.g. 32 rows half decoded = 16.0), so the ETA moves inside a batch too.

- On an interactive terminal: a rich bar with counts, elapsed time and ETA, redrawn every
  second (the clock and ETA move even while the counts wait for a batch).
- Without one (logs, `dvc repro`, Prefect): a heartbeat line on stderr when the work starts,
  then at least every `HEARTBEAT_SECONDS` (a daemon thread wakes every few seconds, so a line
  comes even while no callback arrives), and when it ends. The line is made for people and
  for `parse_heartbeat`, which the Prefect task uses to move the flow's progress artifact
  during a stage:

      qerl-progress rollout@0: 12/32 rows (41%), 38 s elapsed, ETA 55 s

  (percent and ETA count the in-flight share; `ETA ?` before anything is measured).
- `QERL_NO_PROGRESS=1` turns both off; `QERL_PROGRESS_SECONDS` sets the heartbeat period.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from typing import Callable, Iterator, TextIO

HEARTBEAT_SECONDS = 20.0
"""Default period of heartbeat lines. The waker checks every `_WAKE_SECONDS`, so the longest gap
between two lines is this plus that (25 s), inside the 30 s promised to log readers."""
_WAKE_SECONDS = 5.0
PREFIX = "qerl-progress"

_LINE = re.compile(
    rf"{PREFIX} (?P<label>.+?): (?P<done>\d+)/(?P<total>\d+) (?P<unit>\S+) \((?P<percent>\d+)%\), "
    r"(?P<elapsed>\d+) s elapsed, ETA (?P<eta>\d+|\?)(?: s)?")


def format_eta(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds:.0f} s"


class Tracker:
    """Counts, rate and ETA of one piece of work; `clock` is injectable (tests use a fake one).

    The ETA is elapsed * (remaining / done), with done counting the in-flight share: the rate
    so far, extrapolated. It is None until some work is done.
    """

    def __init__(self, label: str, total: int, unit: str = "rows", clock: Callable[[], float] = time.monotonic):
        self.label, self.total, self.unit, self.clock = label, int(total), unit, clock
        self.t0 = clock()
        self.done = 0
        self.inflight = 0.0

    def update(self, done: int, inflight: float = 0.0) -> None:
        self.done = int(done)
        self.inflight = max(0.0, float(inflight))

    @property
    def fraction(self) -> float:
        if self.total <= 0:
            return 1.0
        return min(1.0, (self.done + self.inflight) / self.total)

    def elapsed(self) -> float:
        return max(0.0, self.clock() - self.t0)

    def eta(self) -> float | None:
        f = self.fraction
        if f <= 0:
            return None
        return self.elapsed() * (1.0 - f) / f

    def line(self) -> str:
        return (f"{PREFIX} {self.label}: {self.done}/{self.total} {self.unit} ({100 * self.fraction:.0f}%), "
                f"{self.elapsed():.0f} s elapsed, ETA {format_eta(self.eta())}")


class Heartbeat:
    """Writes `tracker.line()` to `stream` at start, whenever `interval` seconds have passed since
    the last line (checked by `tick`, which both the callback and the waker thread call), and at
    the end. Thread-safe: the callback runs in the worker thread, the waker in its own."""

    def __init__(self, tracker: Tracker, stream: TextIO, interval: float = HEARTBEAT_SECONDS):
        self.tracker, self.stream, self.interval = tracker, stream, float(interval)
        self._lock = threading.Lock()
        self._last: float | None = None
        self.lines = 0

    def emit(self) -> None:
        with self._lock:
            self._last = self.tracker.clock()
            self.lines += 1
            try:
                print(self.tracker.line(), file=self.stream, flush=True)
            except (OSError, ValueError):  # a closed pipe must not fail the stage
                pass

    def tick(self) -> bool:
        """Emit if the period has passed; returns whether a line was written."""
        if self._last is None or self.tracker.clock() - self._last >= self.interval:
            self.emit()
            return True
        return False


def heartbeat_seconds() -> float:
    """The heartbeat period: `QERL_PROGRESS_SECONDS` (a positive number) or `HEARTBEAT_SECONDS`."""
    raw = os.environ.get("QERL_PROGRESS_SECONDS", "")
    try:
        value = float(raw)
    except ValueError:
        return HEARTBEAT_SECONDS
    return value if value > 0 else HEARTBEAT_SECONDS


def parse_heartbeat(line: str) -> dict | None:
    """The fields of a heartbeat line anywhere in `line` (a log prefix may precede it), else None:
    label, done, total, unit, percent, elapsed (s), eta (s or None)."""
    m = _LINE.search(line)
    if m is None:
        return None
    eta = m.group("eta")
    return {"label": m.group("label"), "done": int(m.group("done")), "total": int(m.group("total")),
            "unit": m.group("unit"), "percent": int(m.group("percent")), "elapsed": int(m.group("elapsed")),
            "eta": None if eta == "?" else int(eta)}


@contextlib.contextmanager
def _heartbeat(tracker: Tracker, stream: TextIO, interval: float) -> Iterator[Callable[..., None]]:
    beat = Heartbeat(tracker, stream, interval)
    stop = threading.Event()

    def wake() -> None:
        while not stop.wait(min(_WAKE_SECONDS, interval)):
            beat.tick()

    beat.emit()
    waker = threading.Thread(target=wake, name=f"progress {tracker.label}", daemon=True)
    waker.start()

    def done(n: int, inflight: float = 0.0) -> None:
        tracker.update(n, inflight)
        beat.tick()

    try:
        yield done
    finally:
        stop.set()
        waker.join(timeout=1.0)
    beat.emit()  # the closing line: only when the work ended normally


@contextlib.contextmanager
def _bar(tracker: Tracker) -> Iterator[Callable[..., None]]:
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(tracker.unit),
                  TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), transient=True,
                  refresh_per_second=1) as bar:
        task = bar.add_task(tracker.label, total=tracker.total)

        def done(n: int, inflight: float = 0.0) -> None:
            tracker.update(n, inflight)
            bar.update(task, completed=min(tracker.total, n + tracker.inflight))

        yield done


@contextlib.contextmanager
def progress(label: str, total: int, unit: str = "rows", stream: TextIO | None = None,
             tty: bool | None = None) -> Iterator[Callable[..., None] | None]:
    """Yield `done(n, inflight=0.0)` for `total` units of work named `label`, or None when
    progress is off (`QERL_NO_PROGRESS`, or nothing to do). A rich bar on a terminal, heartbeat
    lines on `stream` (default stderr) otherwise; `tty` overrides the terminal test."""
    stream = stream if stream is not None else sys.stderr
    if total <= 0 or os.environ.get("QERL_NO_PROGRESS"):
        yield None
        return
    if tty is None:
        tty = bool(getattr(stream, "isatty", lambda: False)())
    tracker = Tracker(label, total, unit)
    with (_bar(tracker) if tty else _heartbeat(tracker, stream, heartbeat_seconds())) as done:
        yield done
