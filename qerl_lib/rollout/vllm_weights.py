"""Weight arithmetic of the vLLM worker that needs no vLLM, so the CPU tests reach it
(tests/test_vllm_engine.py): AQN written into an engine's own norms (`NormNoise`), the dense weight of
one of vLLM's fused NVFP4 layers (`dequantize_partitions`), and a saved adapter merged into it
(`adapter_deltas`, `merge_partitions`). `qerl_lib.rollout.vllm_worker` runs them inside vLLM's worker.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from qerl_lib.aqn import NoiseInjector, norm_key


class NormNoise(NoiseInjector):
    """The trainer's `NoiseInjector` on an engine's model, plus trained norms that come with an
    adapter: the same targets (by module *name*, so vLLM's own `RMSNorm` classes are found), the
    same arithmetic (`qerl_lib.aqn.write_noise`: float32 sum, one cast to the weight's dtype, `copy_`
    into the existing storage, so CUDA graphs see it), hence the trainer's bits for the same clean
    weights. `base` holds the checkpoint's norms; the clean weights (`_clean`) are `base`
    overridden by the adapter's trained norms (`set_overrides`).
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__(model, track_trainable=False)
        self.model = model
        self.base = {k: v.clone() for k, v in self._clean.items()}
        self._others: dict[str, tuple[torch.nn.Module, torch.Tensor]] = {}
        """Other norms overridden by an adapter (e.g. the final `model.norm`): module and checkpoint weight."""

    @property
    def clean(self) -> dict[str, torch.Tensor]:
        """The noise-free norm weights by AQN key: the checkpoint's, with the adapter's trained norms on top."""
        return self._clean

    @torch.no_grad()
    def set_overrides(self, tensors: dict[str, torch.Tensor] | None) -> int:
        """Clean weights = checkpoint norms with `tensors` (trained norms by parameter name) on top.

        AQN targets are matched by `norm_key`; any other name (the final norm) by module name.
        Writes the clean weights (noise off) and returns how many tensors were applied; a later
        call without a tensor restores the checkpoint's weight.
        """
        self.state = None
        self._clean = {k: v.clone() for k, v in self.base.items()}
        for module, base in self._others.values():
            module.weight.copy_(base)
        modules = None
        n = 0
        for name, value in (tensors or {}).items():
            mod_name = name.removesuffix(".weight")
            key = norm_key(mod_name)
            if key in self._clean:
                self._clean[key].copy_(value.to(self._clean[key].dtype))
                n += 1
                continue
            if modules is None:
                modules = dict(self.model.named_modules())
            module = modules.get(mod_name)
            if module is None or getattr(module, "weight", None) is None or module.weight.shape != value.shape:
                raise KeyError(f"trained norm {name!r} has no matching module in the engine's model")
            if mod_name not in self._others:
                self._others[mod_name] = (module, module.weight.detach().clone())
            module.weight.copy_(value.to(module.weight.dtype))
            n += 1
        self.apply(0.0, 0, 0)
        return n

    def describe(self) -> dict[str, Any]:
        """What the engine's AQN writes into (`qerl_set_noise`, `qerl_norm_info`): targets, their classes, the last
        (sigma, seed, step), the sigma mode, dtype and a fingerprint of the current weights."""
        classes = sorted({f"{type(m).__module__}.{type(m).__name__}" for _, m in self.targets})
        return {"targets": len(self.targets), "classes": classes, "state": list(self.state or (0.0, 0, 0)),
                "mode": self.mode, "dtype": str(self.targets[0][1].weight.dtype), "fingerprint": self.fingerprint()}


def dequantize_partitions(
    packed: torch.Tensor, scale: torch.Tensor, global_scales: torch.Tensor, widths: list[int],
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Dense weight [N, K] of a (possibly fused) NVFP4 layer in vLLM's loaded layout.

    vLLM stacks fused projections (q|k|v, gate|up) along the output rows and keeps one
    compressed-tensors global scale per partition; each partition is dequantized with its
    own scale by `qerl_lib.nvfp4.dequantize_nvfp4` (bit-identical to compressed-tensors).
    """
    from qerl_lib.nvfp4 import dequantize_nvfp4

    if sum(widths) != packed.shape[0] or global_scales.numel() != len(widths):
        raise ValueError(f"partitions {widths} / {global_scales.numel()} scales do not match {tuple(packed.shape)}")
    out = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=dtype, device=packed.device)
    row = 0
    for i, w in enumerate(widths):
        out[row:row + w] = dequantize_nvfp4(packed[row:row + w], scale[row:row + w],
                                            global_scales.reshape(-1)[i:i + 1], dtype)
        row += w
    return out


def merge_partitions(dense: torch.Tensor, widths: list[int], deltas: list[torch.Tensor | None]) -> torch.Tensor:
    """`dense` [N, K] with `deltas[i]` [widths[i], K] (float32, already scaled) added to partition i, in place.

    float32 sum, one cast to `dense.dtype`; a None delta leaves its rows untouched.
    """
    if sum(widths) != dense.shape[0] or len(deltas) != len(widths):
        raise ValueError(f"partitions {widths} / {len(deltas)} deltas do not match {tuple(dense.shape)}")
    row = 0
    for w, d in zip(widths, deltas):
        if d is not None:
            if tuple(d.shape) != (w, dense.shape[1]):
                raise ValueError(f"delta {tuple(d.shape)} does not fit partition [{w}, {dense.shape[1]}]")
            dense[row:row + w] = (dense[row:row + w].float() + d.to(dense.device, torch.float32)).to(dense.dtype)
        row += w
    return dense


def adapter_deltas(adapter_dir: str | Path) -> tuple[dict[str, dict[str, torch.Tensor]], float, dict[str, Any]]:
    """(PEFT module name -> {"lora_A": [r, K], "lora_B": [N, r]}, scaling, adapter_config) of a saved adapter.

    Module names drop PEFT's `base_model.model.` prefix (`model.layers.0.self_attn.q_proj`).
    Scaling is lora_alpha / r (lora_alpha / sqrt(r) with `use_rslora`); per-module rank or
    alpha patterns and DoRA are refused, since vLLM serves neither.
    """
    from safetensors.torch import load_file

    adapter_dir = Path(adapter_dir)
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern") or cfg.get("use_dora"):
        raise ValueError(f"{adapter_dir}/adapter_config.json: rank/alpha patterns and DoRA cannot be merged")
    r = int(cfg["r"])
    alpha = float(cfg.get("lora_alpha", r))
    scaling = alpha / (r ** 0.5) if cfg.get("use_rslora") else alpha / r
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in load_file(str(adapter_dir / "adapter_model.safetensors")).items():
        for ab in ("lora_A", "lora_B"):
            suffix = f".{ab}.weight"
            if key.endswith(suffix):
                name = key[: -len(suffix)].removeprefix("base_model.model.")
                pairs.setdefault(name, {})[ab] = t
    for name, p in pairs.items():
        if set(p) != {"lora_A", "lora_B"}:
            raise ValueError(f"{adapter_dir}/adapter_model.safetensors: {name} lacks {({'lora_A', 'lora_B'} - set(p))}")
    return pairs, scaling, cfg
