"""Reading tensor files that a stage did not write itself, refused by name when they are damaged
(torch and safetensors only: a rollout stage on a server checks an adapter without importing PEFT)."""

from __future__ import annotations

from pathlib import Path

import torch


class NonFiniteAdapter(ValueError):
    """An adapter (on disk or in memory) holds NaN or infinite weights."""


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, refused by name when the file is damaged (truncated,
    not safetensors) or any floating tensor holds NaN or infinity."""
    from safetensors.torch import load_file

    try:
        state = load_file(str(path))
    except Exception as e:  # noqa: BLE001  (SafetensorError, OSError, ...: the file is unusable)
        raise ValueError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e}); "
                         "delete it and re-run the stage that writes it") from None
    for key, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise NonFiniteAdapter(f"{path}: tensor {key} holds NaN or infinite values; refusing to load it")
    return state
