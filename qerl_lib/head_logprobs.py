"""Log-probs of given tokens straight from the last hidden states, chunk by chunk.

The trainer needs log softmax(h W^T / T)[y] for every completion token, and the entropy of that
distribution as a metric. Materialising the logits costs [N, V] per pass: for a Qwen2.5-7B step at
micro-batch 8 x 2049 positions and V = 152064 that is 4.7 GiB in bf16, plus the float32 copies
autograd keeps (about 32 GiB of the step's 37 GiB peak, measured on the H200). Here the head's
matmul runs over row chunks of about `CHUNK_ELEMENTS / V` positions:

    forward:   z = (h_c W^T + b) / T in float32;  lse = logsumexp(z);  logp = z[y] - lse;
               entropy = lse - sum softmax(z) * z          (a detached metric)
    backward:  recompute z per chunk;  dz = g (onehot(y) - softmax(z)) / T;
               dh_c = dz W;  dW += dz^T h_c;  db += sum dz   (only the inputs that need grad)

Only h, W and the per-position lse are kept between forward and backward, so one chunk's [rows, V]
float32 temporaries are the most that ever exists. The numerics are those of the full path
(`lm_head` in the weights' dtype, upcast, scale, log-softmax in float32; the gradient cast back to
the weights' dtype before the head's backward matmul), so values and gradients agree with it to
float rounding.
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 26
"""[rows, V] elements per chunk: 64 Mi float32 = 256 MiB per temporary (about 440 rows at V = 152064)."""


def _rows_per_chunk(n: int, v: int) -> int:
    return max(1, min(n, CHUNK_ELEMENTS // max(v, 1)))


def _scaled_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, t: float) -> torch.Tensor:
    """(h W^T + b) / t in at least float32 (float64 stays float64, for exact tests)."""
    z = h @ weight.t()
    if bias is not None:
        z = z + bias
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    return z / t if t != 1.0 else z


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, t: float, with_entropy: bool):
        n, v = hidden.shape[0], weight.shape[0]
        rows = _rows_per_chunk(n, v)
        logp = torch.empty(n, dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if with_entropy else None
        for s in range(0, n, rows):
            z = _scaled_logits(hidden[s:s + rows], weight, bias, t)
            lse_c = torch.logsumexp(z, dim=-1)
            lse[s:s + rows] = lse_c
            logp[s:s + rows] = z.gather(1, tokens[s:s + rows, None]).squeeze(1) - lse_c
            if ent is not None:
                p = (z - lse_c[:, None]).exp_()
                ent[s:s + rows] = lse_c - (p * z).sum(dim=-1)
        ctx.save_for_backward(hidden, weight, bias, tokens, lse)
        ctx.t, ctx.rows = t, rows
        if ent is not None:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, _g_ent):
        hidden, weight, bias, tokens, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if need_h else None
        acc = torch.promote_types(hidden.dtype, torch.float32)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        rows, t = ctx.rows, ctx.t
        for s in range(0, hidden.shape[0], rows):
            h = hidden[s:s + rows]
            z = _scaled_logits(h, weight, bias, t)
            g = g_logp[s:s + rows].to(z.dtype)
            dz = (z - lse[s:s + rows, None]).exp_().mul_(-g[:, None])
            dz.scatter_add_(1, tokens[s:s + rows, None], g[:, None])
            if t != 1.0:
                dz.div_(t)
            if need_b:
                grad_b += dz.sum(dim=0)
            dz = dz.to(hidden.dtype)  # as autograd does: the upcast's backward casts back, then the matmul
            if need_h:
                grad_h[s:s + rows] = dz @ weight
            if need_w:
                grad_w += (dz.t() @ h).to(acc)
        return (grad_h, grad_w.to(weight.dtype) if need_w else None, grad_b.to(bias.dtype) if need_b else None,
                None, None, None)


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax((hidden W^T + b) / T)[tokens] and (optionally) the entropy, without full logits.

    hidden: [B, T, H] (or [N, H]); weight: [V, H]; bias: [V] or None; tokens: [B, T] (or [N]) ids.
    Returns (logp, entropy) of shape [B, T] (or [N]), float32 (float64 for float64 inputs); entropy is None unless asked and
    carries no gradient. Gradients flow to `hidden` (and to `weight` / `bias` if they need it).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    lead = tokens.shape
    if hidden.shape[:-1] != lead:
        raise ValueError(f"hidden {tuple(hidden.shape)} and tokens {tuple(lead)} disagree")
    h = hidden.reshape(-1, hidden.shape[-1])
    logp, ent = _HeadLogprobs.apply(h, weight, bias, tokens.reshape(-1).long(), float(temperature), with_entropy)
    return logp.reshape(lead), (ent.reshape(lead) if ent is not None else None)
