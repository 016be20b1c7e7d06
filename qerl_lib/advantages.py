"""Group-relative advantages (GRPO / DAPO / Dr. GRPO) and DAPO's zero-variance filter.

Pure numpy. A batch is N samples; `group_ids[i]` names the group (the prompt) sample i
was drawn for. Groups need not be contiguous or equal in size.

Which standard deviation: by default the *population* std of the group (numpy
`ddof=0`, dividing by G). TRL's GRPOTrainer and verl compute `torch.std`, which is the
Bessel-corrected sample std (`ddof=1`, dividing by G - 1); pass `ddof=1` to match them.
With groups of equal size G the two differ by the constant factor sqrt(G / (G - 1))
(1.15 at G = 4): the advantages, and so the gradient, scale by it (Adam largely absorbs
a constant scale, the KL term's relative weight does not).
"""

from __future__ import annotations

import numpy as np


def _group_index(group_ids) -> tuple[np.ndarray, int]:
    """Dense group index [N] in 0..K-1 and K, for any hashable ids (str or int)."""
    ids = np.asarray(group_ids)
    if ids.ndim != 1:
        raise ValueError(f"group_ids must be 1-D, got shape {ids.shape}")
    _, inverse = np.unique(ids, return_inverse=True)
    inverse = inverse.reshape(-1)
    return inverse, int(inverse.max()) + 1 if inverse.size else 0


def _as_rewards(rewards, n: int) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    if r.shape != (n,):
        raise ValueError(f"rewards must have shape ({n},) like group_ids, got {r.shape}")
    if not np.all(np.isfinite(r)):
        raise ValueError("rewards contain NaN or inf")
    return r


def group_stats(rewards, group_ids, ddof: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample group mean [N] and group std [N] (std with `ddof`; 0 for a group of
    one sample when ddof=1, where the sample std is undefined)."""
    idx, k = _group_index(group_ids)
    r = _as_rewards(rewards, idx.size)
    count = np.bincount(idx, minlength=k).astype(np.float64)
    mean = np.bincount(idx, weights=r, minlength=k) / np.maximum(count, 1)
    sq = np.bincount(idx, weights=(r - mean[idx]) ** 2, minlength=k)
    denom = count - ddof
    std = np.sqrt(np.divide(sq, denom, out=np.zeros_like(sq), where=denom > 0))
    return mean[idx], std[idx]


def group_advantages(rewards, group_ids, scale: bool = True, eps: float = 1e-6, ddof: int = 0) -> np.ndarray:
    """Advantage of every sample relative to its group.

    rewards [N] float, group_ids [N] (any hashable) -> advantages [N] float64.
    scale=True (GRPO, DAPO): (r - mean_group) / (std_group + eps), std the population
    std unless `ddof=1`. scale=False (Dr. GRPO): r - mean_group, which removes the
    question-difficulty bias the std division introduces. A group whose rewards are all
    equal gets advantage 0 either way.
    """
    mean, std = group_stats(rewards, group_ids, ddof=ddof)
    centred = np.asarray(rewards, dtype=np.float64) - mean
    if not scale:
        return centred
    return centred / (std + eps)


def zero_variance_mask(rewards, group_ids) -> np.ndarray:
    """bool [N]: True where the sample's whole group has equal rewards.

    DAPO dynamic sampling drops these groups: their advantages are all zero, so they add
    no gradient, only dilute the token-level mean. Exact equality is used (rewards are
    sums of a few fixed weights, so equal outcomes give equal floats).
    """
    idx, k = _group_index(group_ids)
    r = _as_rewards(rewards, idx.size)
    lo = np.full(k, np.inf)
    hi = np.full(k, -np.inf)
    np.minimum.at(lo, idx, r)
    np.maximum.at(hi, idx, r)
    return (lo == hi)[idx]
