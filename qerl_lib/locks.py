"""Advisory workspace locks (`flock`), in one place.

- `<root>/.qerl.lock`: `qerl run` holds it exclusively for the whole run; every `qerl stage` and
  every Prefect flow holds it shared. So a whole local run never overlaps a stage or a flow, while
  stages on different outputs (DVC, Prefect) may run side by side.
- `.dvc/tmp/qerl-flow.lock`: one Prefect flow per workspace (exclusive).

The kernel drops a lock when its holder dies (SIGKILL included), so a killed process never
blocks the next one. The file holds a note naming the holder, for the refusal message only.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


class Busy(RuntimeError):
    """The lock is held by another process; the message names the holder when it is known."""

    def __init__(self, path: Path, holder: str):
        super().__init__(holder)
        self.path = path
        self.holder = holder


def acquire(path: str | Path, exclusive: bool, note: str) -> int:
    """Take the lock on `path` without waiting (created if missing); returns its descriptor.

    Raises `Busy` (with the holder's note) when another process holds a conflicting lock. A holder
    of the exclusive lock writes `note` into the file; shared holders write theirs too (a hint only:
    several may overwrite each other)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise OSError(e.errno, f"cannot open the lock file {path}: {e.strerror}") from None
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = path.read_text().strip()
        except OSError:
            holder = ""
        os.close(fd)
        raise Busy(path, holder or "another process") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, note.encode(), 0)
    except OSError:
        pass  # the note is a hint; a read-only or full disk must not fail the lock itself
    return fd


def release(fd: int) -> None:
    os.close(fd)


@contextmanager
def held(path: str | Path, exclusive: bool, note: str) -> Iterator[int]:
    fd = acquire(path, exclusive, note)
    try:
        yield fd
    finally:
        release(fd)


def workspace_lock_path(root: str | Path) -> Path:
    return Path(root) / ".qerl.lock"
