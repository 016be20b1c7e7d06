"""Optimizer choice, learning-rate schedule values, gradient clipping."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from qerl_lib.config import OptimConfig
from qerl_lib.optim import build_optimizer, clip_grad_norm, lr_factor, make_scheduler, set_lr


def test_lr_cosine_with_warmup():
    c = OptimConfig(lr=1e-3, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    got = [lr_factor(s, 11, c) for s in range(11)]
    # warm-up (s+1)/2, then p = (s-2)/8: f = 0.1 + 0.9 * (1 + cos(pi p)) / 2
    assert got[0] == pytest.approx(0.5)
    assert got[1] == pytest.approx(1.0)
    assert got[2] == pytest.approx(1.0)
    assert got[4] == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2)  # 0.868198
    assert got[4] == pytest.approx(0.8681980515, rel=1e-9)
    assert got[6] == pytest.approx(0.55)  # half way
    assert got[10] == pytest.approx(0.1)  # last step reaches the floor
    assert lr_factor(50, 11, c) == pytest.approx(0.1)  # and stays there
    assert all(a >= b for a, b in zip(got[2:], got[3:]))


def test_lr_constant_and_edge_cases():
    c = OptimConfig(warmup_steps=4, schedule="constant")
    assert [lr_factor(s, 10, c) for s in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1, 1, 1])
    c0 = OptimConfig(warmup_steps=0, schedule="cosine", min_lr_ratio=0.0)
    assert lr_factor(0, 1, c0) == 1.0  # a single step gets the full rate
    assert [lr_factor(s, 3, c0) for s in range(3)] == pytest.approx([1.0, 0.5, 0.0])


def test_scheduler_follows_lr_factor():
    c = OptimConfig(lr=2e-3, warmup_steps=1, schedule="cosine", min_lr_ratio=0.2, eight_bit=True)
    p = torch.nn.Parameter(torch.zeros(3))
    opt = build_optimizer([p], c, "cpu")
    sched = make_scheduler(opt, 5, c)
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"])
        p.grad = torch.ones(3)
        opt.step()
        sched.step()
    assert seen == pytest.approx([2e-3 * lr_factor(s, 5, c) for s in range(5)])
    assert seen[-1] == pytest.approx(2e-3 * 0.2)
    assert set_lr(opt, 1, 5, c) == pytest.approx(2e-3) and opt.param_groups[0]["lr"] == pytest.approx(2e-3)


def test_build_optimizer_cpu_is_torch_adamw(caplog):
    c = OptimConfig(lr=5e-4, betas=(0.8, 0.95), weight_decay=0.01, eight_bit=True)
    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    live = torch.nn.Parameter(torch.zeros(2))
    with caplog.at_level(logging.INFO, logger="qerl_lib.optim"):
        opt = build_optimizer([frozen, live], c, torch.device("cpu"))
    assert type(opt) is torch.optim.AdamW
    g = opt.param_groups[0]
    assert g["lr"] == 5e-4 and g["betas"] == (0.8, 0.95) and g["weight_decay"] == 0.01
    assert len(g["params"]) == 1 and g["params"][0] is live  # frozen parameters are left out
    groups = build_optimizer([{"params": [live], "lr": 1e-5}, {"params": [frozen]}], c, "cpu").param_groups
    assert len(groups) == 1 and groups[0]["lr"] == 1e-5
    with pytest.raises(ValueError, match="no trainable"):
        build_optimizer([frozen], c, "cpu")


def test_clip_grad_norm():
    a = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(1))
    none = torch.nn.Parameter(torch.zeros(1))
    a.grad = torch.tensor([3.0, 0.0])
    b.grad = torch.tensor([4.0])
    assert clip_grad_norm([a, b, none], 0.0) == pytest.approx(5.0)  # measure only
    assert torch.equal(a.grad, torch.tensor([3.0, 0.0]))
    assert clip_grad_norm([a, b, none], 10.0) == pytest.approx(5.0)  # below: untouched
    assert torch.equal(b.grad, torch.tensor([4.0]))
    assert clip_grad_norm([a, b, none], 1.0) == pytest.approx(5.0)  # pre-clip norm returned
    torch.testing.assert_close(a.grad, torch.tensor([0.6, 0.0]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.grad, torch.tensor([0.8]), atol=1e-5, rtol=1e-5)
    assert clip_grad_norm([none], 1.0) == 0.0
