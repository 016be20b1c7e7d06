"""Batched autoregressive sampling with one seeded generator per row (transformers models).

`transformers.generate` draws every row from one global RNG, so a row's tokens depend
on what else is in the batch. Here each row owns a `torch.Generator` seeded with its
stored seed, and draws exactly one categorical sample per decode step from it, so a
row is a function of (model, prompt, seed, sampling params) and of the batch layout
only through floating-point rounding.

The logprob recorded for each sampled token is log softmax(logits / temperature) at
that token: the full tempered distribution, before top-p truncation. The trainer
computes the same quantity (`losses.gather_logprobs`), so the importance ratio
compares like with like. With temperature 0 (greedy) the untempered log softmax is
recorded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float
    """0 means greedy."""
    top_p: float = 1.0
    max_new_tokens: int = 48


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail of `probs` [V] outside the smallest set of mass >= top_p; renormalise."""
    if top_p >= 1.0:
        return probs
    sorted_p, order = torch.sort(probs, descending=True)
    cum = torch.cumsum(sorted_p, dim=-1)
    # Keep a token if the mass before it is < top_p (so the first token is always kept).
    keep_sorted = (cum - sorted_p) < top_p
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order[keep_sorted]] = True
    filtered = torch.where(keep, probs, torch.zeros_like(probs))
    return filtered / filtered.sum()


def _left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def sample_batch(
    model,
    prompts: list[list[int]],
    seeds: list[int],
    params: SamplingParams,
    eos_ids: set[int],
    pad_id: int,
) -> list[Completion]:
    """Sample one completion per prompt. prompts: B lists of token ids; seeds: B ints."""
    device = next(model.parameters()).device
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
    past = None
    step_ids, step_pos = ids, positions
    for t in range(params.max_new_tokens):
        out = model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[:, -1, :].float().cpu()
        temp = params.temperature if params.temperature > 0 else 1.0
        logprobs = torch.log_softmax(logits / temp, dim=-1)
        next_ids = torch.empty(B, dtype=torch.long)
        for i in range(B):
            if finish[i] is not None:
                next_ids[i] = pad_id
                continue
            if params.temperature <= 0:
                tok = int(torch.argmax(logprobs[i]))
            else:
                probs = top_p_filter(logprobs[i].exp(), params.top_p)
                tok = int(torch.multinomial(probs, 1, generator=gens[i]))
            out_tokens[i].append(tok)
            out_lps[i].append(float(logprobs[i, tok]))
            next_ids[i] = tok
            if tok in eos_ids:
                finish[i] = "stop"
        if all(f is not None for f in finish):
            break
        step_ids = next_ids.view(B, 1).to(device)
        mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=device)], dim=1)
        step_pos = step_pos[:, -1:] + 1
    return [
        Completion(out_tokens[i], out_lps[i], finish[i] or "length")
        for i in range(B)
    ]
