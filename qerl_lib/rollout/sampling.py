"""Batched autoregressive sampling with one seeded generator per row (transformers models).

`transformers.generate` draws every row from one global RNG, so a row's tokens depend
on what else is in the batch. Here each row owns a CPU `torch.Generator` seeded with its
stored seed and draws exactly one uniform number u per decode step from it; the token is
then picked by inverse-CDF sampling on the accelerator, for all rows at once: sort the
row's probabilities (descending, stable), keep the top-p nucleus, and take the first
token whose cumulative kept mass exceeds u times the kept total. That is an exact draw
from the nucleus distribution, and a row is a function of (model, prompt, seed, sampling
params) and of the batch layout only through floating-point rounding. Only B uniforms
go to the device and B tokens and logprobs come back per step: an earlier per-row loop
over [V] probability vectors on the CPU took minutes per evaluation of a 49k-token vocabulary.

The logprob recorded for each sampled token is log softmax(logits / temperature) at
that token: the full tempered distribution, before top-p truncation. The trainer
computes the same quantity (`losses.gather_logprobs`), so the importance ratio
compares like with like. With temperature 0 (greedy) the untempered log softmax is
recorded.

The prefix that every prompt of a batch shares (at least `MIN_SHARED_PREFIX` tokens: the chat
template's system turn and the task's worked example, or a GRPO group's one prompt) is prefilled
once, as one row, and its KV cache repeated over the rows. On the embedded default (86 of 116-130
prompt tokens shared) an evaluation batch of 32 rows x 32 tokens took 13.9 s against 17.4 s without
(greedy; 15.3 s against 20.1 s sampled), every row with the same tokens and logprobs within 2e-5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float
    """0 means greedy."""
    top_p: float = 1.0
    max_new_tokens: int = 48


def logit_scale(params: SamplingParams) -> float:
    """Multiplier of the logits when an engine folds the temperature into them (vLLM, rollout
    servers): 1/T when sampling, 1 when greedy. Requests then sample at temperature 1, and the
    recorded logprob is log softmax(logits / T), the convention above."""
    return 1.0 if params.temperature <= 0 else 1.0 / float(params.temperature)


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"


def _left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor, top_p: float = 1.0) -> torch.Tensor:
    """One token per row from the top-p nucleus of each row of `probs`.

    probs: [B, V] non-negative, each row summing to ~1; u: [B] uniforms in [0, 1) on the
    same device. Returns [B] long token ids. The nucleus is the smallest prefix of the row
    sorted by descending probability (stable, so ties keep the lower id first) whose mass
    reaches top_p; the first token is always in it.
    """
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    cum = sorted_p.cumsum(dim=-1)
    keep = (cum - sorted_p) < top_p  # [B, V], a prefix of each row
    kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    kept_cum = kept.cumsum(dim=-1)
    target = u.to(kept_cum.dtype).unsqueeze(-1) * kept_cum[:, -1:]
    idx = (kept_cum <= target).sum(dim=-1)
    # Rounding can put target at the very end; a row without finite mass keeps nothing, and its
    # index is clamped to 0 so the caller can name it instead of hitting a device-side assert.
    idx = torch.minimum(idx, keep.sum(dim=-1) - 1).clamp_min(0)
    return order.gather(-1, idx.unsqueeze(-1)).squeeze(-1)


MIN_SHARED_PREFIX = 16
"""Shortest token prefix common to every row of a batch that `sample_batch` prefills once."""


def shared_prefix_length(prompts: list[list[int]]) -> int:
    """Tokens at the start of every prompt that all rows share, leaving each row at least one token of
    its own (the last prompt token's logits start decoding); 0 for a single row."""
    if len(prompts) < 2:
        return 0
    first, n = prompts[0], min(len(p) for p in prompts) - 1
    i = 0
    while i < n and all(p[i] == first[i] for p in prompts):
        i += 1
    return i


@torch.no_grad()
def sample_batch(
    model,
    prompts: list[list[int]],
    seeds: list[int],
    params: SamplingParams,
    eos_ids: set[int],
    pad_id: int,
    on_step=None,
) -> list[Completion]:
    """Sample one completion per prompt. prompts: B lists of token ids; seeds: B ints.

    `on_step(tokens_decoded, rows_finished)`, when given, is called after every decode step (progress
    inside a batch; it never changes a token)."""
    device = next(model.parameters()).device
    past = None
    shared = shared_prefix_length(prompts)
    if shared >= MIN_SHARED_PREFIX:
        # The prefix every row shares (a chat template's system turn, a worked example, a GRPO group's
        # prompt) is computed once and its KV cache repeated over the rows; only the suffixes, left-padded
        # behind it (padding masked out, positions continuing from the prefix), prefill per row.
        with torch.no_grad():
            pre = torch.tensor([prompts[0][:shared]], dtype=torch.long, device=device)
            out = model(input_ids=pre, attention_mask=torch.ones_like(pre), position_ids=torch.arange(
                shared, device=device).view(1, -1), use_cache=True, logits_to_keep=1)
        past = out.past_key_values
        if hasattr(past, "batch_repeat_interleave"):
            past.batch_repeat_interleave(len(prompts))
            ids, suffix_mask = _left_pad([p[shared:] for p in prompts], pad_id, device)
            positions = shared + (suffix_mask.cumsum(-1) - 1).clamp_min(0)
            mask = torch.cat([torch.ones((len(prompts), shared), dtype=suffix_mask.dtype, device=device), suffix_mask], 1)
        else:  # a legacy tuple cache: no sharing
            past = None
    if past is None:
        ids, mask = _left_pad(prompts, pad_id, device)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
    gens = []
    for s in seeds:
        g = torch.Generator(device="cpu")
        g.manual_seed(int(s))
        gens.append(g)
    B = len(prompts)
    out_tokens: list[list[int]] = [[] for _ in range(B)]
    out_lps: list[list[float]] = [[] for _ in range(B)]
    finish = [None] * B
    step_ids, step_pos = ids, positions
    temp = params.temperature if params.temperature > 0 else 1.0
    for t in range(params.max_new_tokens):
        # logits_to_keep=1: the prefill would otherwise materialise [B, prompt, V] logits.
        out = model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, past_key_values=past,
                    use_cache=True, logits_to_keep=1)
        past = out.past_key_values
        logprobs = torch.log_softmax(out.logits[:, -1, :].float() / temp, dim=-1)  # [B, V]
        if params.temperature <= 0:
            toks = logprobs.argmax(dim=-1)
        else:
            # Every row draws its step-t uniform, finished or not, so its stream never shifts.
            u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in gens]).to(device)
            toks = inverse_cdf_sample(logprobs.exp(), u, params.top_p)
        lps = logprobs.gather(-1, toks.unsqueeze(-1)).squeeze(-1)
        tok_list, lp_list = toks.tolist(), lps.tolist()
        bad = [i for i, lp in enumerate(lp_list) if not math.isfinite(lp)]
        if bad and params.temperature > 0:
            raise FloatingPointError(
                f"sampling step {t}: non-finite logprobs in rows {bad[:8]} of {B} (seeds {[seeds[i] for i in bad[:8]]});"
                " the policy's logits are NaN/inf, so no token can be drawn")
        next_ids = torch.empty(B, dtype=torch.long)
        for i in range(B):
            if finish[i] is not None:
                next_ids[i] = pad_id
                continue
            tok = tok_list[i]
            out_tokens[i].append(tok)
            out_lps[i].append(lp_list[i])
            next_ids[i] = tok
            if tok in eos_ids:
                finish[i] = "stop"
        if on_step is not None:
            on_step(t + 1, sum(f is not None for f in finish))
        if all(f is not None for f in finish):
            break
        step_ids = next_ids.view(B, 1).to(device)
        mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=device)], dim=1)
        step_pos = step_pos[:, -1:] + 1
    return [
        Completion(out_tokens[i], out_lps[i], finish[i] or "length")
        for i in range(B)
    ]
