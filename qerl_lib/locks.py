"""Advisory workspace locks (`flock`), in one place.

- `<root>/.qerl.lock`: `qerl run` holds it exclusively for the whole run; every `qerl stage` and
  every Prefect flow holds it shared. So a whole local run never overlaps a stage or a flow, while
  stages on different outputs (DVC, Prefect) may run side by side.
- `.dvc/tmp/qerl-flow.lock`: one Prefect flow per workspace (exclusive).
- `<root>/.qerl-locks/<stage>@<step>.lock`: one `qerl stage` call per stage and step (exclusive),
  taken before the call sweeps its outputs' temporaries, so a second call of the same stage never
  removes the first one's temporaries (it is refused instead).
- `.dvc/tmp/lock`, DVC's own repository lock (`dvc_repo_lock`): `qerl run` in a DVC workspace
  holds it for the whole run, so a `dvc repro` there is refused before it removes any output.

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
    from qerl_lib.paths import Layout

    return Layout(root).lock_file


def stage_lock_path(root: str | Path, label: str) -> Path:
    """The lock of one stage call (`update@3`, `prepare`) in workspace `root`."""
    return Path(root) / ".qerl-locks" / f"{label}.lock"


@contextmanager
def dvc_repo_lock(root: str | Path, note: str) -> Iterator[bool]:
    """Hold DVC's repository lock of `root` (`.dvc/tmp/lock`, through DVC's own lock class, so the
    `core.hardlink_lock` setting is honoured) when `root` is a DVC repository; yields whether it
    is one. `dvc repro` takes this lock before it looks at any stage (it releases it only while
    a stage's command runs), so while it is held here no `dvc repro` removes an output.

    Raises `Busy` when DVC holds it (a `dvc repro`, `dvc status`, ... is running)."""
    root = Path(root)
    if not (root / ".dvc").is_dir():
        yield False
        return
    from dvc.config import Config
    from dvc.lock import LockError, make_lock

    tmp_dir = root / ".dvc" / "tmp"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    try:
        hardlink = bool(Config(str(root / ".dvc"), validate=False)["core"].get("hardlink_lock", False))
    except Exception:  # noqa: BLE001  (an unreadable DVC config: DVC itself will say so)
        hardlink = False
    lock = make_lock(str(tmp_dir / "lock"), tmp_dir=str(tmp_dir), hardlink_lock=hardlink)
    try:
        lock.lock()
    except LockError:
        raise Busy(tmp_dir / "lock", "DVC (a `dvc repro` or another dvc command holds .dvc/tmp/lock)") from None
    try:
        yield True
    finally:
        lock.unlock()
