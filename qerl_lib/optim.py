"""Optimizer, learning-rate schedule and gradient clipping of the LoRA update.

The schedule is indexed by the optimizer step s = 0..S-1 over the whole run
(S = run.steps * algo.mini_batches), so every `update@i` stage can rebuild it from numbers
alone (`lr_factor`) or from a saved LambdaLR state.
"""

from __future__ import annotations

import logging
import math
from typing import Iterable

import torch

from qerl_lib.config import OptimConfig

log = logging.getLogger(__name__)
_announced: set[str] = set()


def _announce(msg: str) -> None:
    """Log a choice once per process (update stages build an optimizer per mini-batch run)."""
    if msg not in _announced:
        _announced.add(msg)
        log.info(msg)


def _trainable(params: Iterable) -> list:
    """Keep parameters (or param-group dicts) that need gradients; a group keeps its options."""
    out = []
    for p in params:
        if isinstance(p, dict):
            kept = [q for q in p["params"] if q.requires_grad]
            if kept:
                out.append({**p, "params": kept})
        elif p.requires_grad:
            out.append(p)
    if not out:
        raise ValueError("no trainable parameters were given to the optimizer")
    return out


def build_optimizer(params: Iterable, cfg: OptimConfig, device: str | torch.device) -> torch.optim.Optimizer:
    """AdamW(lr, betas, weight_decay) over the trainable `params` (tensors or param groups).

    bitsandbytes' AdamW8bit when `cfg.eight_bit`, `device` is CUDA and bitsandbytes imports
    (8-bit moments: a quarter of the optimizer memory); torch's AdamW otherwise. Which one was
    chosen is logged once.
    """
    params = _trainable(params)
    kwargs = dict(lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    if cfg.eight_bit and torch.device(device).type == "cuda":
        try:
            import bitsandbytes as bnb  # noqa: PLC0415 - optional GPU dependency

            _announce("optimizer: bitsandbytes AdamW8bit")
            return bnb.optim.AdamW8bit(params, **kwargs)
        except Exception as e:  # ImportError, or a broken CUDA setup inside bitsandbytes
            _announce(f"optimizer: torch AdamW (bitsandbytes unavailable: {e.__class__.__name__}: {e})")
    else:
        reason = "eight_bit off" if not cfg.eight_bit else f"device {torch.device(device).type}"
        _announce(f"optimizer: torch AdamW ({reason})")
    return torch.optim.AdamW(params, **kwargs)


def lr_factor(opt_step: int, total_opt_steps: int, cfg: OptimConfig) -> float:
    """Multiplier of cfg.lr at optimizer step `opt_step` (0-based) of `total_opt_steps`.

    Warm-up (W = cfg.warmup_steps): f = (s + 1) / W for s < W, so the first step already moves
    and step W-1 reaches the full rate. Then
      constant: f = 1;
      cosine:   p = (s - W) / max(1, S - W - 1) clipped to [0, 1],
                f = m + (1 - m) * (1 + cos(pi p)) / 2 with m = cfg.min_lr_ratio,
                so the first post-warm-up step has the peak rate and the last one (S - 1)
                exactly m.
    """
    s, total, warm = int(opt_step), int(total_opt_steps), int(cfg.warmup_steps)
    if s < warm:
        return (s + 1) / warm
    if cfg.schedule == "constant":
        return 1.0
    p = min(max((s - warm) / max(1, total - warm - 1), 0.0), 1.0)
    m = cfg.min_lr_ratio
    return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * p))


def make_scheduler(optimizer: torch.optim.Optimizer, total_opt_steps: int, cfg: OptimConfig,
                   done: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over `lr_factor`: call `scheduler.step()` after each `optimizer.step()`. `done`
    optimizer steps already taken (a resumed adapter) are replayed, so the next lr is step `done`'s."""
    import warnings

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total_opt_steps, cfg))
    with warnings.catch_warnings():
        # The replay steps the schedule before this process's first optimizer.step(), which torch
        # warns about (a misordered training loop); here it is the intent.
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        for _ in range(done):
            scheduler.step()
    return scheduler


def set_lr(optimizer: torch.optim.Optimizer, opt_step: int, total_opt_steps: int, cfg: OptimConfig) -> float:
    """Set every group's lr to cfg.lr * lr_factor(opt_step) (resume without scheduler state); returns it."""
    lr = cfg.lr * lr_factor(opt_step, total_opt_steps, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> float:
    """Global L2 norm of all gradients BEFORE clipping; when it exceeds `max_norm` the gradients
    are scaled in place by max_norm / norm. max_norm <= 0 only measures.

    A non-finite norm (inf/nan) is returned as is; the caller should then skip the optimizer step.
    """
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    if max_norm <= 0:
        return float(torch.nn.utils.get_total_norm([p.grad for p in params]))
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
