"""Length-aware micro-batching of the update (`optim.sort_micro_batches`, `qerl_lib.trainer.plan_update`).

The layout itself (pure functions): every row once, mini-batches untouched, stable order, padding cut,
ranks balanced. The trainer with it: the same loss, gradient and adapter as rollout-order slices within
float tolerance (float64 tiny Llama, one and two mini-batches, DAPO and GRPO with its KL term), fewer
padded positions in the metrics, and the same bytes on a re-run.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from qerl_lib.config import load_config
from qerl_lib.distributed import DistContext, shard
from qerl_lib.trainer import (deal_to_ranks, padded_positions, plan_micro_batches, plan_positions, plan_update,
                              row_shape, update_work)

# (prompt, completion) lengths of a GRPO-like step: groups of 4 sharing a prompt, completions from 1 to 60
SHAPES = [(p, c) for p, cs in ((5, (60, 2, 31, 9)), (12, (1, 44, 17, 3)), (3, (25, 58, 6, 13))) for c in cs]


def _cfg(**optim):
    return load_config(None, {"optim": {"micro_batch_size": 2, **optim}, "algo": {"mini_batches": 1}})


# ----------------------------------------------------------------------------- the layout


def test_rollout_order_is_the_earlier_slicing():
    assert plan_micro_batches(SHAPES, 5, by_length=False) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11]]
    assert plan_micro_batches(SHAPES, 5, world_size=3, by_length=False) == plan_micro_batches(SHAPES, 5, by_length=False)


def test_length_order_groups_similar_rows_longest_first():
    plan = plan_micro_batches(SHAPES, 3)
    assert sorted(i for mb in plan for i in mb) == list(range(len(SHAPES)))  # every row exactly once
    assert [len(mb) for mb in plan] == [3, 3, 3, 3]
    assert all(mb == sorted(mb) for mb in plan)  # rows keep rollout order inside a micro-batch
    totals = [[SHAPES[i][0] + SHAPES[i][1] for i in mb] for mb in plan]
    assert all(min(a) >= max(b) for a, b in zip(totals, totals[1:]))  # no overlap: a micro-batch is one length band
    costs = [padded_positions([SHAPES[i] for i in mb]) for mb in plan]
    assert costs == sorted(costs, reverse=True)  # the peak-memory micro-batch runs first
    assert plan_micro_batches(list(SHAPES), 3) == plan  # a function of the lengths only


def test_equal_lengths_keep_row_order():
    same = [(4, 7)] * 7
    assert plan_micro_batches(same, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    mixed = [(4, 7), (2, 9), (4, 7), (1, 10)]  # all total 11: ties are broken by row index, so the slices
    # are [0, 1] and [2, 3]; those pad to 2 x (4 + 9) and 2 x (4 + 10), and the larger runs first
    assert plan_micro_batches(mixed, 2) == [[2, 3], [0, 1]]


def test_padded_positions_count_what_build_batch_lays_out():
    from qerl_lib.trainer import build_batch

    rows = [{"prompt_token_ids": [3] * p, "completion_token_ids": [4] * c, "sampling_logprobs": [-1.0] * c,
             "advantage": 0.0} for p, c in ((5, 0), (2, 6), (4, 1))]
    b = build_batch(rows, 0, torch.device("cpu"))
    assert padded_positions([row_shape(r) for r in rows]) == b.input_ids.numel() == 3 * (5 + 6)
    assert padded_positions([(5, 0)]) == build_batch(rows[:1], 0, torch.device("cpu")).input_ids.numel() == 6
    assert padded_positions([]) == 0


def test_sorting_cuts_the_padded_positions_and_keeps_the_real_ones():
    cfg, off = _cfg(), _cfg(sort_micro_batches=False)
    on_pos, off_pos = plan_positions(plan_update(SHAPES, cfg), SHAPES), plan_positions(plan_update(SHAPES, off), SHAPES)
    assert on_pos["update_positions"] == off_pos["update_positions"] == sum(p + c for p, c in SHAPES)
    assert on_pos["update_padded_positions"] < off_pos["update_padded_positions"]
    # rollout order: [0, 1] 2 x (5 + 60), [2, 3] 2 x 36, [4, 5] 2 x 56, [6, 7] 2 x 29, [8, 9] 2 x 61, [10, 11] 2 x 16;
    # by length: [0, 9] 2 x (5 + 60), [2, 5] 2 x (12 + 44), [6, 8] 2 x 37, [7, 11] 2 x 25, [3, 4] 2 x 21, [1, 10] 2 x 11
    assert (on_pos["update_padded_positions"], off_pos["update_padded_positions"], on_pos["update_positions"]) == (430, 526, 349)


def test_mini_batches_keep_their_rollout_order_rows():
    for mini_batches in (1, 2, 3, 5):
        cfg = load_config(None, {"optim": {"micro_batch_size": 2}, "algo": {"mini_batches": mini_batches}})
        plan = plan_update(SHAPES, cfg)
        off = cfg.model_copy(deep=True)
        off.optim.sort_micro_batches = False
        for a, b in zip(plan, plan_update(SHAPES, off)):
            assert sorted(i for mb in a for i in mb) == sorted(i for mb in b for i in mb)
            assert len(a) == len(b)  # same micro-batch count: update_work's progress total holds
    assert plan_update([], _cfg()) == []


def _rank_positions(plan, shapes, world):
    return [sum(padded_positions([shapes[i] for i in mb]) for _, mb in shard(plan, DistContext(r, world, None)))
            for r in range(world)]


def test_ranks_get_balanced_work_and_their_usual_counts():
    assert deal_to_ranks(list(range(7)), 3) == [0, 1, 2, 5, 4, 3, 6]
    assert deal_to_ranks(list(range(5)), 1) == list(range(5))
    assert deal_to_ranks([], 4) == []
    rng = np.random.default_rng(0)  # the rl_step benchmark's draw: 512 log-normal completions up to 1024
    shapes = [(256, int(c)) for c in np.clip(np.rint(np.exp(np.log(307.2) + 0.6 * rng.standard_normal(512))), 1, 1024)]
    cfg = load_config(None, {"optim": {"micro_batch_size": 8}, "algo": {"mini_batches": 1}})
    for world in (2, 4, 8):
        plan = plan_update(shapes, cfg, world)[0]
        assert sorted(map(tuple, plan)) == sorted(map(tuple, plan_update(shapes, cfg)[0]))  # same micro-batches
        dealt = _rank_positions(plan, shapes, world)
        round_robin = _rank_positions(plan_update(shapes, cfg)[0], shapes, world)
        assert max(dealt) / min(dealt) < 1.1 and max(dealt) / min(dealt) < max(round_robin) / min(round_robin)
        counts = [len(shard(plan, DistContext(r, world, None))) for r in range(world)]
        assert max(counts) == update_work(len(shapes), cfg, world) and max(counts) - min(counts) <= 1


# ----------------------------------------------------------------------------- the trainer


def _rows(seed: int = 0) -> list[dict]:
    """Rows of very different lengths (prompts 3-12, completions 1-60), advantages of both signs."""
    rng = np.random.default_rng(seed)
    rows = []
    for i, (p, c) in enumerate(SHAPES):
        rows.append({"prompt_token_ids": rng.integers(10, 250, p).tolist(), "completion_token_ids": rng.integers(10, 250, c).tolist(),
                     "sampling_logprobs": (-rng.random(c) * 4 - 0.5).tolist(), "advantage": float(rng.normal()),
                     "temperature": 1.0, "kept": True})
    return rows


def _policy(model_dir, dtype, cfg):
    from transformers import AutoModelForCausalLM

    from qerl_lib.lora import apply_lora

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    peft = apply_lora(model, cfg.lora)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B = 0 at init would leave A without gradient in the first step
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))
    peft.eval()
    return SimpleNamespace(model=peft, device=torch.device("cpu"),
                           tokenizer=SimpleNamespace(pad_token_id=model.config.pad_token_id))


def _lora(policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}


def _train(model_dir, cfg, rows, dtype=torch.float64, optimizer="sgd"):
    """One `train_on_rollouts` from the same start; (metrics, LoRA weights after, LoRA weights before)."""
    from qerl_lib.optim import build_optimizer
    from qerl_lib.trainer import train_on_rollouts

    pol = _policy(model_dir, dtype, cfg)
    before = _lora(pol)
    params = [p for p in pol.model.parameters() if p.requires_grad]
    # SGD: the weight change is lr x the gradient, so the adapters compare the gradients themselves
    # (AdamW's first step, g / |g|, would turn a float-rounding gradient of ~0 into a whole lr).
    opt = torch.optim.SGD(params, lr=cfg.optim.lr) if optimizer == "sgd" else build_optimizer(params, cfg.optim, "cpu")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    metrics = train_on_rollouts(pol, opt, sched, rows, cfg)
    return metrics, _lora(pol), before


@pytest.mark.parametrize("loss,mini_batches", [("dapo", 1), ("dapo", 2), ("grpo", 2)])
def test_sorted_micro_batches_give_the_same_update(tiny_llama_dir, loss, mini_batches):
    rows = _rows()
    out = {}
    for sort in (False, True):
        cfg = load_config(None, {
            "optim": {"lr": 0.5, "micro_batch_size": 3, "grad_clip": 0.0, "sort_micro_batches": sort},
            "algo": {"loss": loss, "mini_batches": mini_batches, **({"beta": 0.05} if loss == "grpo" else {})},
            "rollout": {"max_new_tokens": 64}})
        out[sort] = _train(tiny_llama_dir, cfg, rows)
    (m0, w0, start), (m1, w1, _) = out[False], out[True]
    assert m0["optimizer_steps"] == m1["optimizer_steps"] == mini_batches
    for key in ("loss", "grad_norm", "entropy", "kl", "mismatch_kl", "clip_frac", "ratio_mean", "pg_loss"):
        assert m1[key] == pytest.approx(m0[key], rel=1e-9, abs=1e-12), key
    assert m1["tokens"] == m0["tokens"] == sum(c for _, c in SHAPES)
    moved = 0
    for name in w0:
        torch.testing.assert_close(w1[name], w0[name], rtol=1e-9, atol=1e-12, msg=name)
        moved += int(not torch.equal(w0[name], start[name]))
    assert moved == len(w0)  # A and B both trained: the comparison covers every LoRA tensor
    assert m1["update_positions"] == m0["update_positions"] == sum(p + c for p, c in SHAPES)
    assert m1["update_padded_positions"] < m0["update_padded_positions"]


def test_the_same_rows_give_the_same_adapter_bytes(tiny_llama_dir, tmp_path):
    """float32 and the project's AdamW, as a run trains: a re-run writes a byte-identical adapter."""
    from qerl_lib.lora import write_adapter_files
    from qerl_lib.optim import build_optimizer
    from qerl_lib.trainer import train_on_rollouts

    cfg = load_config(None, {"optim": {"lr": 1e-2, "micro_batch_size": 3}, "algo": {"mini_batches": 2}})
    assert cfg.optim.sort_micro_batches  # the default
    runs = []
    for i in range(2):
        pol = _policy(tiny_llama_dir, torch.float32, cfg)
        opt = build_optimizer([p for p in pol.model.parameters() if p.requires_grad], cfg.optim, "cpu")
        metrics = train_on_rollouts(pol, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0), _rows(), cfg)
        assert metrics["optimizer_steps"] == 2 and math.isfinite(metrics["loss"])
        write_adapter_files(pol.model, tmp_path / f"a{i}")
        runs.append((metrics, (tmp_path / f"a{i}" / "adapter_model.safetensors").read_bytes()))
    assert runs[0][1] == runs[1][1]
    assert runs[0][0] == runs[1][0]  # the metrics too, float for float
