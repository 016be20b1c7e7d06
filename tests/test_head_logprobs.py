"""Chunked head log-probs: the same values and gradients as the full-logits path, without the logits."""

from __future__ import annotations

import pytest
import torch

import qerl_lib.head_logprobs as hl
from qerl_lib.config import LoraConfig
from qerl_lib.losses import gather_logprobs, token_entropy


def _full(hidden, weight, bias, tokens, t):
    z = hidden @ weight.t()
    if bias is not None:
        z = z + bias
    z = z.to(torch.promote_types(z.dtype, torch.float32)) / t
    return gather_logprobs(z, tokens, 1.0), token_entropy(z.detach())


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_values_and_gradients_match_the_full_logits(monkeypatch, dtype, with_bias):
    monkeypatch.setattr(hl, "CHUNK_ELEMENTS", 3 * 50)  # 3 rows per chunk: 5 chunks, the last one short
    g = torch.Generator().manual_seed(0)
    B, T, H, V, t = 2, 7, 16, 50, 0.7
    hidden0 = torch.randn(B, T, H, generator=g).to(dtype)
    weight0 = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    bias0 = torch.randn(V, generator=g).to(dtype) if with_bias else None
    tokens = torch.randint(0, V, (B, T), generator=g)
    upstream = torch.randn(B, T, generator=g)

    results = []
    for fn in ("chunked", "full"):
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        bias = bias0.clone().requires_grad_() if with_bias else None
        if fn == "chunked":
            logp, ent = hl.head_logprobs(hidden, weight, tokens, t, bias, with_entropy=True)
        else:
            logp, ent = _full(hidden, weight, bias, tokens, t)
        (logp * upstream).sum().backward()
        results.append((logp.detach(), ent, hidden.grad, weight.grad, bias.grad if with_bias else None))
    (lp, e, gh, gw, gb), (lp_ref, e_ref, gh_ref, gw_ref, gb_ref) = results
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lp, lp_ref, **(tol if dtype == torch.float64 else dict(rtol=0, atol=1e-5)))
    torch.testing.assert_close(e, e_ref, **(tol if dtype == torch.float64 else dict(rtol=0, atol=1e-4)))
    torch.testing.assert_close(gh, gh_ref, **tol)
    torch.testing.assert_close(gw, gw_ref, **tol)
    if with_bias:
        torch.testing.assert_close(gb, gb_ref, **tol)
    assert not e.requires_grad


def test_frozen_weight_gets_no_gradient_and_bad_input_is_named():
    hidden = torch.randn(3, 8, requires_grad=True)
    weight = torch.randn(11, 8)
    logp, ent = hl.head_logprobs(hidden, weight, torch.tensor([0, 5, 10]))
    assert ent is None and logp.shape == (3,)
    logp.sum().backward()
    assert hidden.grad is not None and weight.grad is None
    with pytest.raises(ValueError, match="temperature"):
        hl.head_logprobs(hidden, weight, torch.tensor([0, 1, 2]), temperature=0)
    with pytest.raises(ValueError, match="disagree"):
        hl.head_logprobs(hidden, weight, torch.tensor([0, 1]))


def test_policy_logprobs_chunked_equals_full_on_a_lora_model(tiny_llama_dir, monkeypatch):
    """The trainer's pass: same logp, entropy and LoRA gradients with and without full logits."""
    from qerl_lib.lora import apply_lora
    from qerl_lib.nvfp4_loader import load_dense_model
    from qerl_lib.trainer import build_batch, policy_logprobs, split_head

    torch.manual_seed(0)
    model = apply_lora(load_dense_model(tiny_llama_dir, torch.float64), LoraConfig(r=4, alpha=8))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)  # B = 0 would hide a wrong adapter path
    rows = [{"prompt_token_ids": [5, 6, 7, 8, 9], "completion_token_ids": [10, 11, 12], "sampling_logprobs": [-1.0] * 3,
             "advantage": 1.0},
            {"prompt_token_ids": [20, 21], "completion_token_ids": [30, 31, 32, 33, 34], "sampling_logprobs": [-1.0] * 5,
             "advantage": -1.0}]
    batch = build_batch(rows, pad_id=1, device=torch.device("cpu"))
    assert split_head(model) is not None
    got = {}
    for mode in ("chunked", "full"):
        monkeypatch.setenv("QERL_LOGPROBS", mode)
        model.zero_grad(set_to_none=True)
        logp, ent = policy_logprobs(model, batch, 0.8, True)
        (logp * batch.mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        got[mode] = (logp.detach() * batch.mask, ent * batch.mask, grads)
    assert split_head(model) is None  # QERL_LOGPROBS=full is still set
    (lp, e, gr), (lp_ref, e_ref, gr_ref) = got["chunked"], got["full"]
    torch.testing.assert_close(lp, lp_ref.to(lp.dtype), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(e, e_ref.to(e.dtype), rtol=1e-6, atol=1e-6)
    assert gr.keys() == gr_ref.keys() and len(gr) > 0
    for n in gr:
        # The adapters are float32 (PEFT), so float32 rounding separates the two summation orders.
        torch.testing.assert_close(gr[n], gr_ref[n], rtol=1e-4, atol=1e-6)
