"""Policy-gradient losses, registered by name (verl style), and the log-prob helpers they need.

Every loss takes one `LossInputs` (the tensors of a micro-batch and the mini-batch's global
normalisers; shapes and meanings are documented on its fields) and the `AlgoConfig`:
`LOSSES[name](x, cfg) -> (loss, stats)`.

Per token (all but `logp` are detached):

    r_t   = exp(logp - old_logp)                                  PPO ratio
    s_t   = -min(r_t * A, clip(r_t, 1 - eps_low, 1 + eps_high) * A) clipped surrogate
    w_t   = min(exp(old_logp - rollout_logp), tis_cap)            truncated importance weight
    l_t   = w_t * s_t
    k3_t  = exp(ref - logp) - (ref - logp) - 1                    Schulman's k3 KL estimator

Aggregation (the `norm` carries GLOBAL counts of the whole mini-batch, so the returned losses of
its micro-batches add up to exactly the mini-batch loss; backward on each micro-batch loss and
the accumulated gradient is the full-batch gradient):

- `grpo`    sum_i (sum_t l_it / |y_i|) / n_seqs  + beta * (same aggregation of k3)
            ("seq-mean-token-mean": each sequence weighs the same, whatever its length);
- `dapo`    sum_{i,t} l_it / n_tokens  (token-level mean over the mini-batch, no KL);
- `dr_grpo` sum_{i,t} l_it / (n_seqs * max_len)  (Dr. GRPO's constant normaliser, no KL). Dr.
            GRPO also drops the std division of the advantages; that lives in the advantage
            computation (`AlgoConfig.scale_rewards=False`), not here.

Stats are normalised by the same global counts, so they too add up across micro-batches: summing
the stats dicts of the micro-batches gives the mini-batch's token means (`clip_frac`, `ratio_mean`,
`tis_mean`, `kl`) and its loss parts (`pg_loss`, `kl_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from qerl_lib.config import AlgoConfig

# exp() of a log-ratio beyond +-20 overflows in fp16/bf16 and means the sample is useless anyway;
# clamping the log-ratio keeps one outlier token from turning the loss into inf/NaN.
_LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class LossNorm:
    """Global normalisers of one mini-batch (all its micro-batches together).

    n_seqs:   sequences that carry loss (at least one mask token); GRPO's and Dr. GRPO's divisor.
    n_tokens: loss tokens (sum of the mask); DAPO's divisor.
    max_len:  Dr. GRPO's constant length: the generation cap (`max_new_tokens`) when given,
              else the widest mask of the mini-batch.
    """

    n_seqs: int
    n_tokens: int
    max_len: int

    @classmethod
    def from_masks(cls, masks: Iterable[torch.Tensor] | torch.Tensor, max_len: int | None = None) -> "LossNorm":
        """Count over every micro-batch mask (`[b, t]` each, widths may differ) of a mini-batch."""
        if isinstance(masks, torch.Tensor):
            masks = [masks]
        n_seqs = n_tokens = width = 0
        for m in masks:
            m = m.detach()
            n_seqs += int((m.sum(dim=-1) > 0).sum())
            n_tokens += int(m.sum())
            width = max(width, int(m.shape[-1]))
        return cls(n_seqs=n_seqs, n_tokens=n_tokens, max_len=int(max_len) if max_len is not None else width)


@dataclass(frozen=True, eq=False, kw_only=True)
class LossInputs:
    """What a policy loss reads for one micro-batch of B sequences and T completion positions.

    Everything except `logp` is treated as constant (detached inside the losses). Built once per
    micro-batch by the trainer; the shapes are checked here, so a loss never sees mismatched ones.
    Keyword-only, so that no two (B, T) tensors can be swapped by position; eq=False, because
    tensors have no single truth value and identity is the only sensible equality.
    """

    logp: torch.Tensor
    """(B, T) float32 (float64 in exact tests): log pi_theta(y_t | ...) of the sampled tokens under
    the current policy; the only input that carries gradient."""
    old_logp: torch.Tensor
    """(B, T): the behaviour policy of the PPO ratio, the trainer's log-probs before this RL step's
    first optimizer step (equal to `logp` in value on the first mini-batch)."""
    advantages: torch.Tensor
    """(B,): one advantage per sequence (GRPO group-normalised), broadcast over T."""
    mask: torch.Tensor
    """(B, T) float: 1 on completion tokens that get loss, 0 on padding and filtered samples."""
    norm: LossNorm
    """Global counts of the whole mini-batch this micro-batch belongs to (not of this micro-batch
    alone), so that the micro-batch losses add up to the mini-batch loss."""
    rollout_logp: torch.Tensor | None = None
    """(B, T) float32: the log-probs the rollout engine (vLLM / transformers sampler) sampled with;
    None means "same as old_logp" (no importance correction)."""
    ref_logp: torch.Tensor | None = None
    """(B, T) float32: the reference policy (the base with the LoRA adapter disabled) for the KL;
    None when no KL is computed."""

    def __post_init__(self) -> None:
        want = tuple(self.mask.shape)
        for name in ("logp", "old_logp", "rollout_logp", "ref_logp"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != want:
                raise ValueError(f"LossInputs.{name} has shape {tuple(t.shape)}, mask has {want}; they must agree")
        if tuple(self.advantages.shape) != (want[0],):
            raise ValueError(f"LossInputs.advantages must be [B]={want[0]}, got {tuple(self.advantages.shape)}")


LossFn = Callable[[LossInputs, AlgoConfig], "tuple[torch.Tensor, dict[str, float]]"]
LOSSES: dict[str, LossFn] = {}


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
    """Decorator: `@register_loss("dapo")` makes the function available as `LOSSES["dapo"]`."""

    def wrap(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is already registered")
        LOSSES[name] = fn
        return fn

    return wrap


def get_loss(name: str) -> LossFn:
    try:
        return LOSSES[name]
    except KeyError:
        raise KeyError(f"unknown loss {name!r}; registered: {sorted(LOSSES)}") from None


# --------------------------------------------------------------------------- helpers


def _f(x: torch.Tensor) -> torch.Tensor:
    """At least float32 (bf16/fp16 log-probs are upcast; float64 stays float64 for exact tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) over `dim` (all dims when None); `mask` broadcastable to `x`."""
    prod = x * mask
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) / sum(mask) over `dim` (all dims when None); 0 where the mask is empty."""
    mask = mask.to(x.dtype)
    return masked_sum(x, mask, dim) / masked_sum(torch.ones_like(x), mask, dim).clamp(min=1.0)


def _token_chunks(n: int, v: int, budget: int = 1 << 24) -> int:
    """Rows per chunk so that one chunk's [rows, V] float32 temporary stays near `budget` elements."""
    return max(1, min(n, budget // max(v, 1)))


def gather_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[tokens]: `logits [B, T, V]`, `tokens [B, T]` -> `[B, T]`
    (float32; float64 for float64 logits).

    logp = z[y] - logsumexp(z) with z = logits / temperature, computed in float32 over chunks of
    positions, so beside `logits` at most one [B, T, V] float tensor exists (the scaled chunks
    autograd keeps for backward); no full log_softmax is materialised.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    b, t, v = logits.shape
    flat = logits.reshape(b * t, v)
    ids = tokens.reshape(b * t, 1).long()
    out = []
    step = _token_chunks(b * t, v)
    for i in range(0, b * t, step):
        z = _f(flat[i : i + step])
        if temperature != 1.0:
            z = z / temperature
        out.append(z.gather(1, ids[i : i + step]).squeeze(1) - torch.logsumexp(z, dim=-1))
    return torch.cat(out).reshape(b, t) if out else flat.new_zeros(b, t, dtype=torch.float32)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position: `[B, T, V]` -> `[B, T]`
    (float32; float64 for float64 logits).

    H = -sum_v p_v log p_v with log p = log_softmax(z): stable for any logit scale (no exp of a
    large number); entries with p = 0 (e.g. logits masked to -inf) count 0. Chunked like
    `gather_logprobs`.
    """
    b, t, v = logits.shape
    flat = logits.reshape(b * t, v)
    out = []
    step = _token_chunks(b * t, v)
    for i in range(0, b * t, step):
        z = _f(flat[i : i + step])
        if temperature != 1.0:
            z = z / temperature
        logp = torch.log_softmax(z, dim=-1)
        p = logp.exp()
        # masked vocabulary entries (logit -inf) give 0 * -inf = nan; their share is 0 by definition
        out.append(-(p * logp).masked_fill(p == 0, 0.0).sum(dim=-1))
    return torch.cat(out).reshape(b, t) if out else flat.new_zeros(b, t, dtype=torch.float32)


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor | None, cap: float | None) -> torch.Tensor:
    """Truncated importance weight min(exp(old_logp - rollout_logp), cap), detached, `[B, T]`.

    Corrects the mismatch between the engine that sampled (vLLM, NVFP4 kernels, noise) and the
    trainer's numerics. 1 everywhere when `cap` is None or `rollout_logp` is None.
    """
    if cap is None or rollout_logp is None:
        return torch.ones_like(_f(old_logp.detach()))
    log_w = (_f(old_logp.detach()) - _f(rollout_logp.detach())).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return log_w.exp().clamp(max=float(cap))


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 >= 0, `[B, T]`.

    Unbiased for KL(pi||ref) on samples from pi, always non-negative; gradient flows through logp.
    """
    d = (_f(ref_logp.detach()) - _f(logp)).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return d.exp() - d - 1.0


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO loss -min(r A, clip(r, 1-eps_low, 1+eps_high) A), `[B, T]`.

    Returns (loss, ratio r detached, clipped): `clipped` is 1 where the clipped branch is the
    one taken and differs from the unclipped one (there the token's gradient is zero).
    """
    adv = _f(advantages.detach()).reshape(-1, 1)
    ratio = (_f(logp) - _f(old_logp.detach())).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP).exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    return loss, ratio.detach(), (clipped > unclipped).to(loss.dtype)


def _per_sequence_mean(x: torch.Tensor, mask: torch.Tensor, n_seqs: int) -> torch.Tensor:
    """sum_i (sum_t x_it m_it / sum_t m_it) / n_seqs; empty sequences contribute 0."""
    seq = masked_sum(x, mask, dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
    return seq.sum() / max(n_seqs, 1)


def _common(x: LossInputs, cfg: AlgoConfig) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """Per-token weighted surrogate l_t = w_t s_t `[B, T]`, per-token k3 `[B, T]` (or None), additive
    token stats."""
    mask = x.mask.detach().float()
    surrogate, ratio, clipped = clipped_surrogate(x.logp, x.old_logp, x.advantages, cfg.eps_low, cfg.eps_high)
    w = tis_weights(x.old_logp, x.rollout_logp, cfg.tis_cap)
    per_token = w * surrogate
    n_tok = max(x.norm.n_tokens, 1)
    with torch.no_grad():
        stats = {
            "clip_frac": float(masked_sum(clipped, mask) / n_tok),
            "ratio_mean": float(masked_sum(ratio, mask) / n_tok),
            "tis_mean": float(masked_sum(w, mask) / n_tok),
            "tis_capped_frac": float(masked_sum((w >= cfg.tis_cap).float(), mask) / n_tok)
            if cfg.tis_cap is not None and x.rollout_logp is not None
            else 0.0,
        }
    kl = None
    if x.ref_logp is not None:
        kl = k3_kl(x.logp, x.ref_logp)
        stats["kl"] = float(masked_sum(kl.detach(), mask) / n_tok)
    return per_token, kl, stats


# --------------------------------------------------------------------------- losses


@register_loss("grpo")
def grpo_loss(x: LossInputs, cfg: AlgoConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO: seq-mean-token-mean of the surrogate + beta * seq-mean-token-mean of k3.

    loss = (1/n_seqs) sum_i [ (1/|y_i|) sum_t (w s)_it + beta (1/|y_i|) sum_t k3_it ].
    `x.ref_logp` is required when beta > 0 (the base with the adapter disabled).
    """
    if cfg.beta > 0 and x.ref_logp is None:
        raise ValueError("grpo with beta > 0 needs ref_logp (the base with the adapter disabled)")
    per_token, kl, stats = _common(x, cfg)
    m = x.mask.detach().float()
    pg = _per_sequence_mean(per_token, m, x.norm.n_seqs)
    loss = pg
    stats["pg_loss"] = float(pg.detach())
    if kl is not None and cfg.beta > 0:
        kl_loss = cfg.beta * _per_sequence_mean(kl, m, x.norm.n_seqs)
        loss = loss + kl_loss
        stats["kl_loss"] = float(kl_loss.detach())
    return loss, stats


@register_loss("dapo")
def dapo_loss(x: LossInputs, cfg: AlgoConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """DAPO: token-level mean over the mini-batch, loss = sum_{i,t} (w s)_it m_it / n_tokens; no KL
    (a given `x.ref_logp` only feeds the `kl` stat)."""
    per_token, _, stats = _common(x, cfg)
    loss = masked_sum(per_token, x.mask.detach().float()) / max(x.norm.n_tokens, 1)
    stats["pg_loss"] = float(loss.detach())
    return loss, stats


@register_loss("dr_grpo")
def dr_grpo_loss(x: LossInputs, cfg: AlgoConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Dr. GRPO: loss = sum_{i,t} (w s)_it m_it / (n_seqs * max_len), a constant normaliser that
    removes GRPO's length bias; no KL. Unscaled advantages (r - mean, no std) are the caller's
    part (`AlgoConfig.scale_rewards=False`)."""
    per_token, _, stats = _common(x, cfg)
    loss = masked_sum(per_token, x.mask.detach().float()) / max(x.norm.n_seqs * x.norm.max_len, 1)
    stats["pg_loss"] = float(loss.detach())
    return loss, stats


def policy_loss(x: LossInputs, cfg: AlgoConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Dispatch to `LOSSES[cfg.loss]`."""
    return get_loss(cfg.loss)(x, cfg)


def add_stats(total: dict[str, float], part: dict[str, float]) -> dict[str, float]:
    """Accumulate a micro-batch's stats into `total` (in place; also returned)."""
    for k, v in part.items():
        total[k] = total.get(k, 0.0) + float(v)
    return total
