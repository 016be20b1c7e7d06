"""Content hashes of the files that identify a policy and a checkpoint (standard library only, so
a stage that only names an adapter, such as a rollout on a server, never imports torch or PEFT)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from qerl_lib.paths import ADAPTER_WEIGHTS


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def adapter_hash(adapter_dir: str | Path) -> str:
    """sha256 hex digest of the adapter's adapter_model.safetensors bytes."""
    return file_sha256(Path(adapter_dir) / ADAPTER_WEIGHTS)
