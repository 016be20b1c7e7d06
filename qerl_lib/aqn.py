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

Scale (`AQNConfig.sigma_mode`). `absolute` (default, the paper's): Z ~ N(0, sigma^2 I), the same
std for every element of every norm of every model. `relative`: element i of a norm weight w gets
std sigma * |w_i| (the same standard normal draw eps, scaled: Z_i = sigma * |w_i| * eps_i). Why
per element rather than per vector: the paper's justification of noise on the norm weight is that
W diag(w + Z) = W diag(w) (I + diag(Z / w)), i.e. Z acts as a multiplicative noise Z_i / w_i on the
columns of the effective linear W diag(w) that follows, standing in for quantization error (which
is itself relative, proportional to each block's scale). With absolute Z that relative noise is
sigma / |w_i|: it depends on the model's norm magnitudes (sigma 1e-2 is a median 3.7 % perturbation
of SmolLM2-135M's norm elements but 0.48 % of Qwen2.5-Coder-0.5B's, whose norm weights average 2.1
against 0.27: benchmarks/results/norm_magnitudes.json) and explodes on small channels.
With Z_i = sigma |w_i| eps_i it is exactly sigma * eps_i on every column of every layer of every
model, so one schedule means the same thing everywhere. (Scaling by the vector's RMS instead would
fix the size per layer but keep the sigma / |w_i| blow-up inside it.) Sigma 0 is the clean weight
exactly in both modes.

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
SIGMA_MODES = ("absolute", "relative")
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


def noise_for(weight_clean: torch.Tensor, sigma: float, seed: int, step: int, key: str,
              mode: str = "absolute") -> torch.Tensor:
    """The AQN noise of one norm: float32 `[hidden]` on `weight_clean`'s device.

    weight_clean: `[hidden]` clean norm weight (any float dtype, any device); key: its
    `norm_key` (`layers.<i>.<input_layernorm|post_attention_layernorm>`). `absolute`: sigma * eps;
    `relative`: sigma * |weight_clean| * eps (elementwise, float32), with eps = the standard normal
    draw of (seed, step, key) (`noise_vector`), so both modes share one random stream and the
    result depends on (seed, step, key, weight_clean) only. Zeros at sigma 0.
    """
    if mode not in SIGMA_MODES:
        raise ValueError(f"aqn.sigma_mode must be one of {SIGMA_MODES}, got {mode!r}")
    if weight_clean.dim() != 1:
        raise ValueError(f"AQN noise of {key}: expected a 1-D norm weight, got shape {tuple(weight_clean.shape)}")
    z = noise_vector(key, weight_clean.shape[0], sigma, seed, step).to(weight_clean.device)
    if mode == "relative":
        z = z * weight_clean.detach().float().abs()  # float32 elementwise: bit-identical on CPU and CUDA
    return z


def noisy_weight(weight_clean: torch.Tensor, sigma: float, seed: int, step: int, key: str,
                 mode: str = "absolute") -> torch.Tensor:
    """clean + noise_for(...), summed in float32 and cast once to `weight_clean`'s dtype; `[hidden]`.

    sigma 0 returns (a copy of) the clean weight bit for bit, whatever the dtype.
    """
    if sigma == 0:
        return weight_clean.detach().clone()
    z = noise_for(weight_clean, sigma, seed, step, key, mode)
    return (weight_clean.detach().float() + z).to(weight_clean.dtype)


# --------------------------------------------------------------------------- injection


@torch.no_grad()
def write_noise(targets: list[tuple[str, nn.Module]], clean: dict[str, torch.Tensor], sigma: float, seed: int,
                step: int, mode: str = "absolute") -> None:
    """weight <- noisy_weight(clean[key], sigma, seed, step, key, mode) for every (key, module) of
    `targets`, in place.

    The one arithmetic of AQN, shared by the trainer (`NoiseInjector`) and the vLLM workers
    (`qerl_lib.rollout.vllm_weights.NormNoise`) so both hold the same bits: float32 sum, one cast to the
    weight's dtype, `copy_` into the existing storage (never a rebind: CUDA graphs keep pointers).
    sigma 0 writes the clean weights back exactly. `mode`: `AQNConfig.sigma_mode`.
    """
    for key, mod in targets:
        w = mod.weight
        if sigma == 0:
            w.copy_(clean[key])
            continue
        w.copy_(noisy_weight(clean[key].to(w.device), sigma, seed, step, key, mode))


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

    def __init__(self, model: nn.Module, track_trainable: bool = True):
        self.targets = aqn_norms(model)
        if not self.targets:
            raise ValueError("no AQN targets (input_layernorm / post_attention_layernorm) in this model")
        self.track_trainable = track_trainable
        """Re-snapshot trainable norms on `apply` (the trainer); off where the clean weights are set
        explicitly (an engine's `NormNoise`)."""
        self._clean = {key: mod.weight.detach().clone() for key, mod in self.targets}
        self.state: tuple[float, int, int] | None = None
        """(sigma, seed, step) of the noise in place; None when the weights are clean."""
        self.mode = "absolute"
        """`sigma_mode` of the last `apply`."""

    @property
    def keys(self) -> list[str]:
        return [key for key, _ in self.targets]

    @torch.no_grad()
    def apply(self, sigma: float, seed: int, step: int, mode: str = "absolute") -> None:
        """weight <- clean + noise_for(clean, sigma, seed, step, key, mode), for every target.

        Replaces any noise already in place (never stacks). Sums in float32, then casts once to the
        weight's dtype. `mode`: `AQNConfig.sigma_mode` (`absolute` or `relative`).
        """
        if mode not in SIGMA_MODES:
            raise ValueError(f"aqn.sigma_mode must be one of {SIGMA_MODES}, got {mode!r}")
        if self.state is not None:
            self.reset()
        for key, mod in self.targets:
            if self.track_trainable and mod.weight.requires_grad:
                self._clean[key].copy_(mod.weight)  # trainable: the clean weight is whatever the optimizer left
        write_noise(self.targets, self._clean, sigma, seed, step, mode)
        self.state = (float(sigma), int(seed), int(step))
        self.mode = mode

    @torch.no_grad()
    def reset(self) -> None:
        """Write the clean weights back (bitwise identical to before `apply`)."""
        for key, mod in self.targets:
            mod.weight.copy_(self._clean[key])
        self.state = None

    def fingerprint(self) -> str:
        return _fingerprint(self.targets)


@contextlib.contextmanager
def noised(model_or_injector: nn.Module | NoiseInjector, sigma: float, seed: int, step: int,
           mode: str = "absolute") -> Iterator[NoiseInjector]:
    """`with noised(model, sigma, seed, step, mode):` runs the block under noise and always resets."""
    inj = model_or_injector if isinstance(model_or_injector, NoiseInjector) else NoiseInjector(model_or_injector)
    inj.apply(sigma, seed, step, mode)
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


# --------------------------------------------------------------------------- magnitudes


def _magnitudes(w: torch.Tensor) -> dict[str, float]:
    """mean |w|, RMS, min, max, median |w| and the share of |w| < 0.05 of a float32 vector `[n]`."""
    a = w.abs()
    return {"n": int(w.numel()), "mean_abs": float(a.mean()), "rms": float(w.pow(2).mean().sqrt()),
            "min": float(w.min()), "max": float(w.max()), "median_abs": float(a.median()),
            "share_abs_below_0.05": float((a < 0.05).float().mean())}


@torch.no_grad()
def norm_magnitudes(model: nn.Module) -> dict[str, dict]:
    """Magnitude statistics of a model's AQN targets, which set what an absolute sigma means.

    Returns {"input_layernorm": s, "post_attention_layernorm": s, "all": s}, each s pooling every
    element of those norms over all layers: `_magnitudes` (n, mean_abs, rms, min, max, median_abs,
    share_abs_below_0.05) plus `layer_rms_min` / `layer_rms_max`, the smallest and largest RMS of
    one layer's vector. The relative size of an absolute noise sigma is about sigma / rms.
    """
    targets = aqn_norms(model)
    if not targets:
        raise ValueError("no AQN targets (input_layernorm / post_attention_layernorm) in this model")
    out: dict[str, dict] = {}
    for kind in (*NORM_NAMES, "all"):
        ws = [m.weight.detach().float().cpu() for k, m in targets if kind == "all" or k.endswith(kind)]
        stats = _magnitudes(torch.cat(ws))
        rms = [float(w.pow(2).mean().sqrt()) for w in ws]
        stats.update(layers=len(ws), layer_rms_min=min(rms), layer_rms_max=max(rms))
        out[kind] = stats
    return out
