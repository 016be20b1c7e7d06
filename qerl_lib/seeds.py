"""Seeds derived with hashlib, so that every random draw is a pure function of its coordinates.

`derive_seed(seed, step, prompt_id, sample_idx)` gives the sampling seed of one rollout
row; it is stored in the row, so any sample can be regenerated alone. Python's `hash`
is salted per process and must never be used for this.
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any tuple of str/int parts (stable across processes and machines)."""
    text = "\x1f".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def generator(*parts: object, device: str | torch.device = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(*parts))
    return g


def stable_id(*parts: object, length: int = 16) -> str:
    """A short hex id (prompt ids, group ids)."""
    text = "\x1f".join(str(p) for p in parts)
    return hashlib.sha256(text.encode()).hexdigest()[:length]
