"""init_adapter: checkpoint -> `adapters/step=0/`, a PEFT adapter with seeded A and zero B, so
step 0 samples from the base itself."""

from __future__ import annotations

from pathlib import Path

from qerl_lib.config import QerlConfig
from qerl_lib.io import atomic_dir, atomic_write_json
from qerl_lib.paths import TRAINER_STATE, Layout


def init_adapter_stage(cfg: QerlConfig, layout: Layout) -> Path:
    from qerl_lib.lora import apply_lora, write_adapter_files
    from qerl_lib.model import load_base, resolve_device, resolve_dtype

    device = resolve_device(cfg.model.device)
    base = load_base(layout.checkpoint(cfg.model.quant), cfg.model.quant,
                     resolve_dtype(cfg.model.compute_dtype, device), device)
    model = apply_lora(base, cfg.lora)
    out = layout.adapter(0)
    with atomic_dir(out) as tmp:
        write_adapter_files(model, tmp)
        atomic_write_json(tmp / TRAINER_STATE, {"step": 0, "optimizer_steps": 0})
    return out
