"""The policy: frozen base (packed NVFP4 or dense) + PEFT LoRA + an AQN injector.

One `Policy` object serves rollout (transformers backend), update and evaluation. In
`qerl run` it stays loaded across steps and stages, so the per-step start-up cost is
the adapter swap only; each stage run alone (`qerl stage ...`, `dvc repro`) builds
its own.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from qerl_lib.config import QerlConfig
from qerl_lib.paths import Layout

log = logging.getLogger(__name__)


class Policy:
    def __init__(self, cfg: QerlConfig, layout: Layout):
        from qerl_lib.aqn import NoiseInjector
        from qerl_lib.lora import apply_lora
        from qerl_lib.model import load_base, load_tokenizer, resolve_device, resolve_dtype

        self.cfg = cfg
        self.device = resolve_device(cfg.model.device)
        self.dtype = resolve_dtype(cfg.model.compute_dtype, self.device)
        self.checkpoint = layout.checkpoint(cfg.model.quant)
        base = load_base(self.checkpoint, cfg.model.quant, self.dtype, self.device)
        self.tokenizer = load_tokenizer(self.checkpoint)
        self.model = apply_lora(base, cfg.lora)
        self.injector = NoiseInjector(self.model)
        self.version: int | None = None
        self.adapter_hash = ""
        self.noise: tuple[float, int, int] = (0.0, 0, 0)

    def load_adapter(self, adapter_dir: Path, version: int) -> None:
        """Put adapter `version` in place (LoRA weights, and norms when they train)."""
        from qerl_lib.lora import adapter_hash, load_adapter_weights

        # Norm weights may be trainable: never load them under noise.
        self.injector.reset()
        load_adapter_weights(self.model, adapter_dir)
        self.version = version
        self.adapter_hash = adapter_hash(adapter_dir)
        self.noise = (0.0, 0, 0)

    def set_noise(self, sigma: float, seed: int, step: int) -> None:
        """Make the RMSNorm weights clean + noise(seed, step); sigma 0 restores them."""
        self.injector.reset()
        if sigma > 0:
            self.injector.apply(sigma, seed, step)
        self.noise = (float(sigma), int(seed), int(step))

    @property
    def eos_ids(self) -> set[int]:
        ids = set()
        gen_cfg = getattr(self.model, "generation_config", None)
        eos = getattr(gen_cfg, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def generate(self, prompts: list[list[int]], seeds: list[int], params, batch_size: int, progress=None):
        """Sample one completion per (prompt, seed), `batch_size` rows at a time, in order."""
        from qerl_lib.sampling import sample_batch

        self.model.eval()
        out = []
        for start in range(0, len(prompts), batch_size):
            out.extend(
                sample_batch(
                    self.model, prompts[start:start + batch_size], seeds[start:start + batch_size], params,
                    self.eos_ids, self.tokenizer.pad_token_id,
                )
            )
            if progress is not None:
                progress(len(out))
        return out


_CACHE: dict[tuple, Policy] = {}


def get_policy(cfg: QerlConfig, layout: Layout, reuse: bool) -> Policy:
    """A loaded policy; with `reuse`, the one this process loaded before for the same base."""
    if not reuse:
        return Policy(cfg, layout)
    key = (str(layout.root.resolve()), cfg.model.quant, cfg.model.device, cfg.model.compute_dtype,
           cfg.lora.model_dump_json())
    if key not in _CACHE:
        _CACHE.clear()
        _CACHE[key] = Policy(cfg, layout)
    policy = _CACHE[key]
    policy.cfg = cfg
    return policy


def clear_policy_cache() -> None:
    _CACHE.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
