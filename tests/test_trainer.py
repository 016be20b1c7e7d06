"""The LoRA update's guard against non-finite gradients, and its attention-backend choice."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import copy_workspace

import qerl_lib.trainer as trainer


def _poison(monkeypatch, calls_to_poison: set[int]):
    """Make the gradient of the n-th training forward's logprobs NaN for n in `calls_to_poison`.

    The forward values stay finite (as on the H200, where only cuDNN's backward went NaN), so the
    loss looks healthy and only the gradient norm can tell.
    """
    real = trainer.policy_logprobs
    count = {"n": 0}

    def poisoned(model, batch, temperature, with_entropy):
        logp, ent = real(model, batch, temperature, with_entropy)
        if with_entropy and logp.requires_grad:
            if count["n"] in calls_to_poison:
                logp.register_hook(lambda g: torch.full_like(g, float("nan")))
            count["n"] += 1
        return logp, ent

    monkeypatch.setattr(trainer, "policy_logprobs", poisoned)


def _adapter(layout, step):
    from safetensors.torch import load_file

    return load_file(str(layout.adapter(step) / "adapter_model.safetensors"))


def test_a_nan_gradient_skips_its_optimizer_step_and_keeps_the_adapter(scored_workspace, tmp_path, monkeypatch):
    from qerl_lib.stages import update_stage

    cfg, layout = scored_workspace
    work = copy_workspace(layout, tmp_path / "w")
    c = cfg.model_copy(deep=True)
    c.run.root = str(work.root)
    _poison(monkeypatch, set(range(100)))  # every micro-batch of both mini-batches
    m = update_stage(c, work, 0)
    assert m["skipped_updates"] == 2 and m["optimizer_steps"] == 0
    assert math.isnan(m["grad_norm"])
    before, after = _adapter(layout, 0), _adapter(work, 1)
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k


def test_only_the_poisoned_mini_batch_is_skipped(scored_workspace, tmp_path, monkeypatch):
    from qerl_lib.stages import update_stage

    cfg, layout = scored_workspace
    work = copy_workspace(layout, tmp_path / "w")
    c = cfg.model_copy(deep=True)
    c.run.root = str(work.root)
    _poison(monkeypatch, {0})  # the first micro-batch of mini-batch 0
    m = update_stage(c, work, 0)
    assert m["skipped_updates"] == 1 and m["optimizer_steps"] == 1
    assert math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    before, after = _adapter(layout, 0), _adapter(work, 1)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_training_attention_excludes_cudnn_only_on_cuda():
    import contextlib

    assert isinstance(trainer.training_attention(torch.device("cpu")), contextlib.nullcontext)


@pytest.mark.gpu
def test_left_padded_backward_is_finite_at_width_64_mod_128():
    """pytorch/pytorch#196678 on the H200: with a mask, width 64 mod 128 and fully masked (left-pad)
    query rows, the default SDPA backward gives NaN grad_q; under `training_attention` it is finite."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    B, H, D = 4, 9, 64
    for L in (64, 192):
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        mask = torch.ones(L, L, dtype=torch.bool, device="cuda").tril().expand(B, 1, L, L).clone()
        mask[1:, :, :, :5] = False  # rows 1.. left-padded by 5: their first 5 queries see nothing
        with trainer.training_attention(torch.device("cuda")):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            out.backward(torch.randn_like(out))
        for t in (q, k, v):
            assert torch.isfinite(t.grad).all(), L


def test_a_step_with_no_kept_group_keeps_the_adapter_and_reports_no_kl(scored_workspace, tmp_path):
    """Dynamic sampling can drop every group (all rewards equal): no update, and KL/entropy are NaN, not 0."""
    from qerl_lib.schema import read_metadata, read_rollouts, to_table, write_rollouts
    from qerl_lib.stages import update_stage

    cfg, layout = scored_workspace
    work = copy_workspace(layout, tmp_path / "w")
    rows = read_rollouts(work.scored(0), scored=True).to_pylist()
    for r in rows:
        r["kept"] = False
    write_rollouts(to_table(rows), work.scored(0), read_metadata(work.scored(0)), scored=True)
    c = cfg.model_copy(deep=True)
    c.run.root = str(work.root)
    m = update_stage(c, work, 0)
    assert m["optimizer_steps"] == 0 and m["kept_samples"] == 0 and m["samples"] == len(rows)
    assert math.isnan(m["kl"]) and math.isnan(m["entropy"])
    before, after = _adapter(layout, 0), _adapter(work, 1)
    for k in before:
        assert torch.equal(before[k], after[k]), k


def test_offloaded_checkpointing_trains_the_same_adapter(scored_workspace, tmp_path):
    """optim.offload_activations moves the checkpointed layer inputs to the host; the update is the same."""
    from qerl_lib.stages import update_stage

    cfg, layout = scored_workspace
    adapters = {}
    for offload in (False, True):
        work = copy_workspace(layout, tmp_path / f"w{offload}")
        c = cfg.model_copy(deep=True)
        c.run.root = str(work.root)
        c.optim.gradient_checkpointing = True
        c.optim.offload_activations = offload
        m = update_stage(c, work, 0)
        assert m["optimizer_steps"] > 0
        adapters[offload] = _adapter(work, 1)
    before = _adapter(layout, 0)
    assert any(not torch.equal(before[k], adapters[True][k]) for k in before)
    for k in before:
        assert torch.allclose(adapters[True][k], adapters[False][k], rtol=1e-4, atol=1e-6), k
