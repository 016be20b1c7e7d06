"""Adaptive Quantization Noise (AQN): a scheduled Gaussian vector added to RMSNorm weights.

Schedule. The T training steps are split evenly into K stages, stage(step) = step * K // T.
Stage 0 adds nothing (the quantization noise of NVFP4 alone). Stages k = 1..K-1 decay from
sigma_start toward sigma_end along a fraction f_k in [0, 1]:

    paper (default, `reach_end=False`):  f_k = (k - 1) / (K - 1)
    reference code (`reach_end=True`):   f_k = (k - 1) / (K - 2)   (K = 2: f_1 = 0, see below)

    exponential (default):  sigma = s * (e / s) ** f          (geometric; the paper's formula)
    linear:                 sigma = s + (e - s) * f
    cosine:                 sigma = e + (s - e) * (1 + cos(pi f)) / 2
    log:                    sigma = s + (e - s) * log(1 + 9 f) / log(10)   (fast early drop)

The default is the paper's exponential formula with f = (k-1)/(K-1) because it is what the
paper states and what its reported results are attributed to; note it never quite reaches
sigma_end (the last stage is s*(e/s)^((K-2)/(K-1))). `reach_end=True` reproduces the reference
code (np.logspace over K-1 values), whose last stage equals sigma_end exactly. With K = 2 there is
a single noisy stage: both variants give it f = 0, i.e. sigma_start (the first noisy stage is
always sigma_start, as np.logspace(num=1) also gives).

Targets. The noise Z ~ N(0, sigma^2 I) is added to the weight of every `input_layernorm` (it then
scales the inputs of q/k/v) and `post_attention_layernorm` (inputs of gate/up) of each decoder
layer: w <- w + Z. Targets are found by module *name*, never by class: vLLM's model uses its own
`RMSNorm` class, so the reference code's isinstance check on transformers' classes never reached
its rollouts.

Reproducibility. The noise of one norm is a function of (seed, step, key) only: a CPU
torch.Generator seeded with derive_seed("aqn", seed, step, key), drawn in float32, then moved to
the weight's device and dtype. The same noise lands in the trainer (transformers/PEFT) and in
vLLM workers whatever the device.

No random walk. `NoiseInjector` keeps a clean copy of every target weight; `apply` always writes
clean + noise (never weight + noise on top of an older noise), `reset` writes the clean copy back
bit for bit. Writes are in place (`copy_`), so a CUDA graph captured on the parameter's storage
(vLLM) sees the new values; the Parameter object is never rebound.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
from typing import Iterator

import torch
from torch import nn

from qerl_lib.config import AQNConfig
from qerl_lib.seeds import derive_seed

NORM_NAMES = ("input_layernorm", "post_attention_layernorm")
_KEY_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(input_layernorm|post_attention_layernorm)$")


# --------------------------------------------------------------------------- schedule


def stage_of(step: int, total_steps: int, stages: int) -> int:
    """Stage index in 0..K-1 of `step` (0-based) when `total_steps` are split evenly into K stages:
    stage = step * K // total_steps (steps beyond the end stay in the last stage)."""
    if total_steps < 1 or stages < 1:
        raise ValueError(f"total_steps and stages must be >= 1, got {total_steps}, {stages}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return min(step * stages // total_steps, stages - 1)


def decay_fraction(stage: int, stages: int, reach_end: bool = False) -> float:
    """f_k for noisy stage k in 1..K-1: (k-1)/(K-1) (paper) or (k-1)/(K-2) (reference; 0 when K=2)."""
    if not 1 <= stage <= stages - 1:
        raise ValueError(f"noisy stages are 1..{stages - 1}, got {stage}")
    denom = (stages - 2) if reach_end else (stages - 1)
    return 0.0 if denom <= 0 else (stage - 1) / denom


def interpolate(start: float, end: float, frac: float, schedule: str) -> float:
    """sigma between `start` (frac 0) and `end` (frac 1) along `schedule` (formulas in the module doc)."""
    if schedule == "exponential":
        if start <= 0 or end <= 0:
            raise ValueError("the exponential schedule needs sigma_start > 0 and sigma_end > 0")
        return start * (end / start) ** frac
    if schedule == "linear":
        return start + (end - start) * frac
    if schedule == "cosine":
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * frac))
    if schedule == "log":
        return start + (end - start) * math.log1p(9.0 * frac) / math.log(10.0)
    raise ValueError(f"unknown AQN schedule {schedule!r}")


def sigma_at(step: int, total_steps: int, cfg: AQNConfig) -> float:
    """Noise std of `step`: 0 when AQN is disabled or in stage 0, else the scheduled value."""
    if not cfg.enabled:
        return 0.0
    k = stage_of(step, total_steps, cfg.stages)
    if k == 0:
        return 0.0
    return float(interpolate(cfg.sigma_start, cfg.sigma_end, decay_fraction(k, cfg.stages, cfg.reach_end), cfg.schedule))


# --------------------------------------------------------------------------- targets


def norm_key(module_name: str) -> str | None:
    """Canonical key `layers.<i>.<input_layernorm|post_attention_layernorm>` of a module path.

    Works for HF (`model.layers.3.input_layernorm`), PEFT (`base_model.model.model.layers.3...`)
    and vLLM (`model.layers.3.input_layernorm`) names; None for any other module.
    """
    m = _KEY_RE.search(module_name)
    return f"layers.{int(m.group(1))}.{m.group(2)}" if m else None


def _sort_key(key: str) -> tuple[int, int]:
    _, layer, name = key.split(".")
    return int(layer), NORM_NAMES.index(name)


def aqn_norms(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(key, module) of every AQN target: modules named input_layernorm / post_attention_layernorm
    with a 1-D `weight` tensor, whatever their class; sorted by (layer, input before post)."""
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        key = norm_key(name)
        if key is None:
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            continue
        if key in found and found[key] is not module:
            raise ValueError(f"two different modules map to the AQN key {key!r}")
        found[key] = module
    return [(k, found[k]) for k in sorted(found, key=_sort_key)]


def noise_vector(key: str, hidden: int, sigma: float, seed: int, step: int) -> torch.Tensor:
    """Z ~ N(0, sigma^2 I), float32 `[hidden]` on the CPU, from derive_seed("aqn", seed, step, key).

    Drawn on a CPU generator so every device and engine gets identical values; zeros at sigma 0.
    """
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    if sigma == 0:
        return torch.zeros(hidden, dtype=torch.float32)
    g = torch.Generator(device="cpu")
    g.manual_seed(derive_seed("aqn", seed, step, key))
    return torch.randn(hidden, generator=g, dtype=torch.float32) * float(sigma)


# --------------------------------------------------------------------------- injection


@torch.no_grad()
def write_noise(targets: list[tuple[str, nn.Module]], clean: dict[str, torch.Tensor], sigma: float, seed: int,
                step: int) -> None:
    """weight <- clean[key] + noise_vector(key, ...) for every (key, module) of `targets`, in place.

    The one arithmetic of AQN, shared by the trainer (`NoiseInjector`) and the vLLM workers
    (`qerl_lib.vllm_worker.NormNoise`) so both hold the same bits: float32 sum, one cast to the
    weight's dtype, `copy_` into the existing storage (never a rebind: CUDA graphs keep pointers).
    sigma 0 writes the clean weights back exactly.
    """
    for key, mod in targets:
        w = mod.weight
        if sigma == 0:
            w.copy_(clean[key])
            continue
        z = noise_vector(key, w.shape[0], sigma, seed, step).to(w.device)
        w.copy_((clean[key].float() + z).to(w.dtype))


class NoiseInjector:
    """Writes clean + noise into the AQN targets of one model, in place, and restores them exactly.

    Built once per model: keeps a clean copy of each target weight (norm weights are tiny).
    Frozen norms: the copy taken here is the clean weight for the injector's lifetime.
    Trainable norms (`weight.requires_grad`): `apply` first re-snapshots the CURRENT weight as the
    clean one, writes snapshot + noise, and `reset` writes the snapshot back. The optimizer thus
    always steps the clean weight, and the gradient taken under noise is the right one since
    d/dw [(w + z) * x] = x does not depend on z (the backward must run before `reset`, the
    optimizer step after it).
    """

    def __init__(self, model: nn.Module):
        self.targets = aqn_norms(model)
        if not self.targets:
            raise ValueError("no AQN targets (input_layernorm / post_attention_layernorm) in this model")
        self._clean = {key: mod.weight.detach().clone() for key, mod in self.targets}
        self.state: tuple[float, int, int] | None = None
        """(sigma, seed, step) of the noise in place; None when the weights are clean."""

    @property
    def keys(self) -> list[str]:
        return [key for key, _ in self.targets]

    @torch.no_grad()
    def apply(self, sigma: float, seed: int, step: int) -> None:
        """weight <- clean + noise_vector(key, hidden, sigma, seed, step), for every target.

        Replaces any noise already in place (never stacks). Sums in float32, then casts once to the
        weight's dtype.
        """
        if self.state is not None:
            self.reset()
        for key, mod in self.targets:
            if mod.weight.requires_grad:
                self._clean[key].copy_(mod.weight)  # trainable: the clean weight is whatever the optimizer left
        write_noise(self.targets, self._clean, sigma, seed, step)
        self.state = (float(sigma), int(seed), int(step))

    @torch.no_grad()
    def reset(self) -> None:
        """Write the clean weights back (bitwise identical to before `apply`)."""
        for key, mod in self.targets:
            mod.weight.copy_(self._clean[key])
        self.state = None

    def fingerprint(self) -> str:
        return _fingerprint(self.targets)


@contextlib.contextmanager
def noised(model_or_injector: nn.Module | NoiseInjector, sigma: float, seed: int, step: int) -> Iterator[NoiseInjector]:
    """`with noised(model, sigma, seed, step):` runs the block under noise and always resets."""
    inj = model_or_injector if isinstance(model_or_injector, NoiseInjector) else NoiseInjector(model_or_injector)
    inj.apply(sigma, seed, step)
    try:
        yield inj
    finally:
        inj.reset()


def _fingerprint(targets: list[tuple[str, nn.Module]]) -> str:
    h = hashlib.sha256()
    for key, mod in targets:
        w = mod.weight.detach().to("cpu").contiguous()
        h.update(f"{key}|{w.dtype}|{tuple(w.shape)}|".encode())
        h.update(w.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fingerprint(model: nn.Module | NoiseInjector) -> str:
    """sha256 over (key, dtype, shape, raw bytes) of the current AQN target weights, in key order.

    Equal fingerprints mean bit-identical norm weights, so a stage can record (and a test prove)
    which noise was in place. Comparable only between models of the same dtype.
    """
    targets = model.targets if isinstance(model, NoiseInjector) else aqn_norms(model)
    return _fingerprint(targets)
