"""Atomic file writes: a killed stage never leaves half a file.

Everything is written to a temporary name in the destination directory and renamed
into place (`os.replace` is atomic on POSIX within one filesystem). Directories
(adapters, checkpoints) are built in a sibling temporary directory and swapped in.

Temporaries are named `.NAME.<pid>-<random>.tmp` (the writer's pid, so that a later writer of
the same file can tell a dead writer's leftovers from a live one's: `sweep_dead_temporaries`).
A write that fails for want of space raises `OSError(ENOSPC, "no space left on device writing
DEST")` whatever library did the writing (torch's zip writer says "unexpected pos ...",
safetensors "os error 28", pyarrow "No space left on device").
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

_NO_SPACE = re.compile(r"no space left|os error 28|unexpected pos|file write failed|disk quota", re.I)


def _no_space(exc: BaseException, dest: Path) -> OSError | None:
    """The ENOSPC error to raise instead of `exc` when `exc` says that the disk is full (or a
    library's write failed and the destination's filesystem has no room left), else None."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        full = True
    elif isinstance(exc, (OSError, RuntimeError)) or type(exc).__name__ == "SafetensorError":
        full = bool(_NO_SPACE.search(str(exc)))
    else:
        full = False
    if not full:
        return None
    return OSError(errno.ENOSPC, f"no space left on device writing {dest}")


@contextlib.contextmanager
def _disk_full_named(dest: Path) -> Iterator[None]:
    """Re-raise a write failure that means a full disk as one ENOSPC error naming `dest` (`_no_space`)."""
    try:
        yield
    except Exception as e:
        full = _no_space(e, dest)
        if full is not None:
            raise full from e
        raise


def _prefix(dest: Path) -> str:
    return f".{dest.name}.{os.getpid()}-"


def sweep_dead_temporaries(dest: str | Path) -> list[Path]:
    """Remove the temporaries of `dest` (`.NAME.<pid>-*.tmp`, files or directories) whose writer
    process no longer exists on this host, and a `.NAME.old` left by a directory swap cut
    half-way when no live writer has a temporary of `dest`. Safe while other processes write
    `dest`: a live writer's temporary is kept. Returns what was removed."""
    dest = Path(dest)
    if not dest.parent.is_dir():
        return []
    removed, live = [], False
    for tmp in dest.parent.glob(f".{_glob_escape(dest.name)}.*.tmp"):
        pid = tmp.name[len(dest.name) + 2:].split("-", 1)[0]
        if pid.isdigit() and pid_alive(int(pid)):
            live = True
            continue
        _remove(tmp)
        removed.append(tmp)
    old = dest.with_name(f".{dest.name}.old")
    if not live and (old.exists() or old.is_symlink()):
        _remove(old)
        removed.append(old)
    return removed


def _glob_escape(name: str) -> str:
    import glob

    return glob.escape(name)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(dest: str | Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary file path next to `dest`; on success rename it to `dest`."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_prefix(dest), suffix=suffix + ".tmp", dir=dest.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        with _disk_full_named(dest):
            yield tmp_path
        os.replace(tmp_path, dest)
        _fsync_dir(dest.parent)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def atomic_write_text(dest: str | Path, text: str) -> Path:
    with atomic_path(dest) as tmp:
        tmp.write_text(text)
    return Path(dest)


def atomic_write_json(dest: str | Path, obj: Any) -> Path:
    return atomic_write_text(dest, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


@contextlib.contextmanager
def atomic_dir(dest: str | Path) -> Iterator[Path]:
    """Yield a temporary directory next to `dest`; on success it replaces `dest` whole."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_prefix(dest), suffix=".tmp", dir=dest.parent))
    try:
        with _disk_full_named(dest):
            yield tmp
        old = None
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(dest, old)
        os.replace(tmp, dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(dest.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def read_json(path: str | Path) -> Any:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"missing file: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
