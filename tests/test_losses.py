"""Policy losses on hand-computed examples, gradient accumulation, gradient routing, helpers.

The running example: 2 sequences x 3 tokens, eps_low 0.2, eps_high 0.28, A = [1, -2],
mask [[1, 1, 1], [1, 1, 0]], ratios r = [[1.5, 0.5, 1.0], [1.1, 0.7, 1.3]].

  seq 0 (A=+1): r=1.5 -> min(1.5, 1.28) = 1.28 (clipped)   loss -1.28
                r=0.5 -> min(0.5, 0.8)  = 0.5               loss -0.5
                r=1.0 ->                                    loss -1.0
  seq 1 (A=-2): r=1.1 -> min(-2.2, -2.2)                    loss  2.2
                r=0.7 -> min(-1.4, -1.6) = -1.6 (clipped)   loss  1.6
                r=1.3 -> masked (would be 2.6, unclipped)
  token sum = -2.78 + 3.8 = 1.02 over 5 tokens; clip_frac = 2/5.
"""

from __future__ import annotations

import math

import pytest
import torch

from qerl_lib.config import AlgoConfig
from qerl_lib.losses import (
    LOSSES,
    LossInputs,
    LossNorm,
    add_stats,
    gather_logprobs,
    get_loss,
    masked_mean,
    policy_loss,
    register_loss,
    token_entropy,
)

RATIOS = [[1.5, 0.5, 1.0], [1.1, 0.7, 1.3]]
ADV = torch.tensor([1.0, -2.0])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def example(tis_cap=None, beta=0.0, loss="dapo"):
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -2.2]], dtype=torch.float64)
    logp = (old + torch.log(torch.tensor(RATIOS, dtype=torch.float64))).requires_grad_(True)
    cfg = AlgoConfig(loss=loss, eps_low=0.2, eps_high=0.28, tis_cap=tis_cap, beta=beta)
    return logp, old, cfg


def run(name, logp, old, cfg, rollout=None, ref=None, mask=MASK, adv=ADV, norm=None, max_len=None):
    norm = norm or LossNorm.from_masks(mask, max_len=max_len)
    x = LossInputs(logp=logp, old_logp=old, advantages=adv, mask=mask, norm=norm,
                   rollout_logp=old if rollout is None else rollout, ref_logp=ref)
    return LOSSES[name](x, cfg)


def test_registry():
    assert {"grpo", "dapo", "dr_grpo"} <= set(LOSSES)
    with pytest.raises(KeyError, match="registered"):
        get_loss("nope")
    with pytest.raises(ValueError):
        register_loss("dapo")(lambda *a: None)


def test_norm_counts():
    n = LossNorm.from_masks([MASK, torch.zeros(1, 5)], max_len=None)
    assert (n.n_seqs, n.n_tokens, n.max_len) == (2, 5, 5)  # the empty sequence carries no loss


def test_dapo_hand():
    logp, old, cfg = example()
    loss, st = run("dapo", logp, old, cfg)
    assert loss.item() == pytest.approx(1.02 / 5)
    assert st["clip_frac"] == pytest.approx(0.4)
    assert st["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.0 + 1.1 + 0.7) / 5)
    assert st["tis_mean"] == pytest.approx(1.0)
    assert "kl" not in st


def test_grpo_hand():
    logp, old, cfg = example(loss="grpo")
    loss, st = run("grpo", logp, old, cfg)
    # seq means: -2.78/3 and 3.8/2, averaged over 2 sequences
    assert loss.item() == pytest.approx((-2.78 / 3 + 1.9) / 2)
    assert st["clip_frac"] == pytest.approx(0.4)


def test_grpo_kl_hand():
    logp, old, cfg = example(beta=0.1, loss="grpo")
    ref = logp.detach().clone()
    ref[0, 0] += math.log(2.0)  # ref - logp = ln 2 -> k3 = 2 - ln 2 - 1; elsewhere 0
    k3 = 1.0 - math.log(2.0)
    loss, st = run("grpo", logp, old, cfg, ref=ref)
    assert loss.item() == pytest.approx((-2.78 / 3 + 1.9) / 2 + 0.1 * (k3 / 3 + 0.0) / 2)
    assert st["kl"] == pytest.approx(k3 / 5)
    assert st["kl_loss"] == pytest.approx(0.1 * k3 / 6)
    with pytest.raises(ValueError, match="ref_logp"):
        run("grpo", logp, old, cfg)


def test_dapo_ignores_kl_but_reports_it():
    logp, old, cfg = example(beta=0.5)
    ref = logp.detach().clone()
    ref[0, 0] += math.log(2.0)
    loss, st = run("dapo", logp, old, cfg, ref=ref)
    assert loss.item() == pytest.approx(1.02 / 5)
    assert st["kl"] == pytest.approx((1.0 - math.log(2.0)) / 5)


def test_dr_grpo_hand():
    logp, old, cfg = example(loss="dr_grpo")
    loss, _ = run("dr_grpo", logp, old, cfg)
    assert loss.item() == pytest.approx(1.02 / (2 * 3))
    loss, _ = run("dr_grpo", logp, old, cfg, max_len=4)  # the generation cap, not the padded width
    assert loss.item() == pytest.approx(1.02 / (2 * 4))


def test_tis_hand():
    logp, old, cfg = example(tis_cap=2.0)
    rollout = old.clone()
    rollout[0, 0] -= math.log(3.0)  # w = 3 -> capped at 2
    rollout[1, 0] += math.log(2.0)  # w = 0.5
    loss, st = run("dapo", logp, old, cfg, rollout=rollout)
    # per token: [-1.28*2, -0.5, -1.0], [2.2*0.5, 1.6]
    assert loss.item() == pytest.approx((-2.56 - 0.5 - 1.0 + 1.1 + 1.6) / 5)
    assert st["tis_mean"] == pytest.approx((2 + 1 + 1 + 0.5 + 1) / 5)
    assert st["tis_capped_frac"] == pytest.approx(1 / 5)
    # no cap -> no correction at all
    loss, st = run("dapo", logp, old, example(tis_cap=None)[2], rollout=rollout)
    assert loss.item() == pytest.approx(1.02 / 5) and st["tis_mean"] == 1.0


def test_gradients_flow_only_through_logp():
    logp, old, cfg = example(tis_cap=2.0, beta=0.1, loss="grpo")
    old = old.clone().requires_grad_(True)
    rollout = (old.detach() - 0.1).requires_grad_(True)
    ref = (logp.detach() + 0.2).requires_grad_(True)
    adv = ADV.clone().requires_grad_(True)
    x = LossInputs(logp=logp, old_logp=old, advantages=adv, mask=MASK, norm=LossNorm.from_masks(MASK),
                   rollout_logp=rollout, ref_logp=ref)
    loss, _ = LOSSES["grpo"](x, cfg)
    loss.backward()
    assert logp.grad is not None
    for t in (old, rollout, ref, adv):
        assert t.grad is None


def test_dapo_gradient_values():
    logp, old, cfg = example()
    loss, _ = run("dapo", logp, old, cfg)
    loss.backward()
    # d/dlogp of -A r / n = -A r / n where unclipped; 0 where clipped or masked
    expected = torch.tensor([[0.0, -0.5 / 5, -1.0 / 5], [2 * 1.1 / 5, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected)


@pytest.mark.parametrize("name", ["grpo", "dapo", "dr_grpo"])
def test_micro_batches_sum_to_full_batch(name):
    g = torch.Generator().manual_seed(0)
    B, T = 6, 5
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    base = old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    rollout = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.tensor([5, 3, 1, 4, 2, 0])  # last sequence fully masked
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    cfg = AlgoConfig(loss=name, beta=0.05 if name == "grpo" else 0.0, tis_cap=1.5)

    full = base.clone().requires_grad_(True)
    norm = LossNorm.from_masks(mask, max_len=8)
    x = LossInputs(logp=full, old_logp=old, advantages=adv, mask=mask, norm=norm, rollout_logp=rollout, ref_logp=ref)
    loss_full, st_full = LOSSES[name](x, cfg)
    loss_full.backward()

    micro = base.clone().requires_grad_(True)
    # micro-batches trimmed to their own widest sequence: only the GLOBAL norm makes them agree
    parts = [(0, 2, 5), (2, 4, 4), (4, 6, 2)]
    norm_m = LossNorm.from_masks([mask[a:b, :w] for a, b, w in parts], max_len=8)
    assert norm_m == norm
    total, stats = 0.0, {}
    for a, b, w in parts:
        x = LossInputs(logp=micro[a:b, :w], old_logp=old[a:b, :w], advantages=adv[a:b], mask=mask[a:b, :w],
                       norm=norm_m, rollout_logp=rollout[a:b, :w], ref_logp=ref[a:b, :w])
        loss, st = LOSSES[name](x, cfg)
        loss.backward()
        total += loss.item()
        add_stats(stats, st)
    assert total == pytest.approx(loss_full.item(), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(micro.grad, full.grad)
    for k, v in st_full.items():
        assert stats[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


def test_policy_loss_dispatch():
    logp, old, cfg = example(loss="dr_grpo")
    loss, _ = policy_loss(LossInputs(logp=logp, old_logp=old, advantages=ADV, mask=MASK, norm=LossNorm.from_masks(MASK)), cfg)
    assert loss.item() == pytest.approx(1.02 / 6)


def test_loss_inputs_checks_shapes():
    logp, old, _ = example()
    norm = LossNorm.from_masks(MASK)
    with pytest.raises(ValueError, match="ref_logp has shape"):
        LossInputs(logp=logp, old_logp=old, advantages=ADV, mask=MASK, norm=norm, ref_logp=old[:, :2])
    with pytest.raises(ValueError, match="advantages must be"):
        LossInputs(logp=logp, old_logp=old, advantages=ADV[:1], mask=MASK, norm=norm)
    with pytest.raises(TypeError):  # keyword-only: tensors cannot be swapped by position
        LossInputs(logp, old, ADV, MASK, norm)


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert masked_mean(x, MASK).item() == pytest.approx(15 / 5)
    torch.testing.assert_close(masked_mean(x, MASK, dim=-1), torch.tensor([2.0, 4.5]))
    assert masked_mean(x, torch.zeros_like(x)).item() == 0.0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gather_logprobs(temperature):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 4, 11, generator=g) * 5).requires_grad_(True)
    tokens = torch.randint(0, 11, (2, 4), generator=g)
    got = gather_logprobs(logits, tokens, temperature)
    want = torch.log_softmax(logits / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(got, want)
    got.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    # bf16 logits are upcast; huge logits stay finite
    big = torch.tensor([[[1e4, -1e4, 0.0]]])
    assert torch.isfinite(gather_logprobs(big, torch.tensor([[1]]))).all()
    assert gather_logprobs(logits.detach().bfloat16(), tokens).dtype == torch.float32


def test_gather_logprobs_chunks(monkeypatch):
    import qerl_lib.losses as L

    monkeypatch.setattr(L, "_token_chunks", lambda n, v, budget=0: 3)  # force several chunks
    logits = torch.randn(2, 5, 7)
    tokens = torch.randint(0, 7, (2, 5))
    want = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(gather_logprobs(logits, tokens), want)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(token_entropy(logits), -(p * p.log()).sum(-1))


def test_token_entropy():
    uniform = torch.zeros(1, 2, 8)
    torch.testing.assert_close(token_entropy(uniform), torch.full((1, 2), math.log(8)))
    peaked = torch.tensor([[[1e4, 0.0, -1e4]]])
    h = token_entropy(peaked)
    assert torch.isfinite(h).all() and h.item() == pytest.approx(0.0, abs=1e-6)
    two = torch.tensor([[[0.0, 0.0, -float("inf")]]])
    assert token_entropy(two).item() == pytest.approx(math.log(2))
