"""Progress bars for long work (sampling), shown only on an interactive terminal."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Iterator


@contextlib.contextmanager
def progress(description: str, total: int) -> Iterator[Callable[[int], None] | None]:
    """Yield a callback `done(n_completed)`, or None when not on a TTY (logs, CI, DVC)."""
    if total <= 0 or not sys.stderr.isatty() or os.environ.get("QERL_NO_PROGRESS"):
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.update(task, completed=n)
