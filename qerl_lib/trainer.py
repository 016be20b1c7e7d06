"""One RL update: scored rollouts of step i + adapter i -> adapter i+1.

Sequences are laid out as the rollout engine saw them: prompts left-padded to a common
width P, completions right-padded to Tc, so the hidden states at columns P-1 .. P+Tc-2 predict
the completion tokens of every row; only those go through the head, chunk by chunk
(`qerl_lib.head_logprobs`), so the [B, Tc, V] logits never exist at once. P and Tc are those of
one micro-batch; `plan_update` groups rows of similar length into micro-batches
(`optim.sort_micro_batches`), so little of each [B, P + Tc] is padding.

The importance ratio uses `old_logp`: with one mini-batch per step the parameters at
the backward pass are the ones that "sampled", so old_logp = logp.detach() (ratio 1,
gradient of logp); with several mini-batches, old_logp is a no-grad pass before the
first optimizer step. The gap between old_logp and the rollout engine's logprobs is
reported (`mismatch_kl`) and corrected by truncated importance sampling (`tis_cap`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from dataclasses import dataclass
from typing import Sequence

import torch

from qerl_lib.config import QerlConfig

log = logging.getLogger(__name__)


@dataclass
class Batch:
    input_ids: torch.Tensor       # [B, P + Tc]
    attention_mask: torch.Tensor  # [B, P + Tc]
    position_ids: torch.Tensor    # [B, P + Tc]
    tokens: torch.Tensor          # [B, Tc] completion token ids (pad where mask is 0)
    mask: torch.Tensor            # [B, Tc] float, 1 on completion tokens that get loss
    rollout_logp: torch.Tensor    # [B, Tc] float32, sampling logprobs (0 where mask is 0)
    advantages: torch.Tensor      # [B] float32


def build_batch(rows: list[dict], pad_id: int, device: torch.device) -> Batch:
    """rows: dicts with prompt_token_ids, completion_token_ids, sampling_logprobs, advantage, kept."""
    B = len(rows)
    P = max(len(r["prompt_token_ids"]) for r in rows)
    Tc = max(max(len(r["completion_token_ids"]) for r in rows), 1)
    ids = torch.full((B, P + Tc), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + Tc), dtype=torch.long)
    tokens = torch.full((B, Tc), pad_id, dtype=torch.long)
    mask = torch.zeros((B, Tc))
    rlp = torch.zeros((B, Tc))
    for i, r in enumerate(rows):
        p, c = r["prompt_token_ids"], r["completion_token_ids"]
        ids[i, P - len(p):P] = torch.tensor(p)
        attn[i, P - len(p):P] = 1
        if c:
            ids[i, P:P + len(c)] = torch.tensor(c)
            attn[i, P:P + len(c)] = 1
            tokens[i, :len(c)] = torch.tensor(c)
            mask[i, :len(c)] = 1.0 if r.get("kept", True) else 0.0
            rlp[i, :len(c)] = torch.tensor(r["sampling_logprobs"], dtype=torch.float32)
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    adv = torch.tensor([float(r["advantage"]) for r in rows], dtype=torch.float32)
    return Batch(ids.to(device), attn.to(device), pos.to(device), tokens.to(device), mask.to(device),
                 rlp.to(device), adv.to(device))


# Model types whose logits are exactly lm_head(final hidden state): no soft-capping, logit scale or
# other post-processing that the chunked head would skip.
PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})


def split_head(model):
    """(decoder, lm_head) of a (PEFT-wrapped) causal LM whose logits are plain `lm_head(h)`, else None.

    `QERL_LOGPROBS=full` forces None (the full-logits path), for side-by-side benchmarks.
    """
    if os.environ.get("QERL_LOGPROBS", "chunked") == "full":
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    head = base.get_output_embeddings()
    if type(head) is not torch.nn.Linear:  # a LoRA- or quantization-wrapped head keeps the full path
        return None
    return base.get_decoder(), head


def policy_logprobs(model, batch: Batch, temperature: float, with_entropy: bool):
    """-> (logp [B, Tc], entropy [B, Tc] or None) of the completion tokens under softmax(logits / T).

    Plain heads (`split_head`) go through `qerl_lib.head_logprobs`, which never holds the [B, Tc, V]
    logits; other models compute the logits of the Tc + 1 last positions and take the log-softmax.
    """
    from qerl_lib.losses import gather_logprobs, token_entropy

    Tc = batch.tokens.shape[1]
    t = temperature if temperature > 0 else 1.0
    parts = split_head(model)
    if parts is not None:
        from qerl_lib.head_logprobs import head_logprobs

        decoder, head = parts
        out = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                      position_ids=batch.position_ids, use_cache=False)
        hidden = out.last_hidden_state[:, -(Tc + 1):-1, :]  # [B, Tc, H]: position P-1+t predicts token t
        return head_logprobs(hidden, head.weight, batch.tokens, t, head.bias, with_entropy)
    out = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
        use_cache=False, logits_to_keep=Tc + 1,
    )
    logits = out.logits[:, :-1, :].float()  # [B, Tc, V]: column P-1+t predicts completion token t
    if t != 1.0:
        logits = logits / t
    logp = gather_logprobs(logits, batch.tokens, 1.0)
    entropy = token_entropy(logits.detach()) if with_entropy else None
    return logp, entropy


def training_attention(device: torch.device):
    """Context for the training forward AND backward: SDPA may not pick cuDNN on CUDA.

    torch 2.11's cuDNN SDPA backward (the default backend on H100/H200) returns NaN grad_q when a
    mask tensor is passed, the sequence length is 64 mod 128 and some query row's logsumexp is below
    -88.7 (pytorch/pytorch#196678). Every left-padded prompt position is such a row (it attends to
    nothing: logsumexp -inf), so a micro-batch of width P + Tc = 64, 192, ... turned the LoRA
    gradients NaN; on the H200 all three issue-6 arms lost their adapter at update 2 this way.
    The memory-efficient kernel is exact on the same inputs. The context must also cover backward:
    gradient checkpointing re-runs the forward there.
    """
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _chunks(n: int, parts: int) -> list[range]:
    size = math.ceil(n / parts)
    return [range(s, min(s + size, n)) for s in range(0, n, size)]


# ------------------------------------------------------------------ micro-batch layout (pure)


def row_shape(row: dict) -> tuple[int, int]:
    """(prompt tokens, completion tokens) of a rollout row: what `build_batch` pads."""
    return len(row["prompt_token_ids"]), len(row["completion_token_ids"])


def padded_positions(shapes: Sequence[tuple[int, int]]) -> int:
    """Positions `build_batch` lays out for one micro-batch of rows with these (prompt, completion)
    lengths: rows x (longest prompt + longest completion, at least 1), as its [B, P + Tc] tensors."""
    if not shapes:
        return 0
    return len(shapes) * (max(p for p, _ in shapes) + max(max(c for _, c in shapes), 1))


def deal_to_ranks(items: Sequence, world_size: int) -> list:
    """`items` (largest first) reordered so that `distributed.shard` (item i to rank i % W) deals them
    boustrophedon: round k hands the next W items to ranks 0..W-1, odd rounds in reverse.

    Plain round robin over a descending list gives rank 0 the largest item of every round; the snake
    alternates, so every rank gets a similar sum while each still gets ceil or floor of n / W items
    (`update_work` counts on that). W = 1: `items` unchanged.
    """
    w, out = max(world_size, 1), []
    for k, s in enumerate(range(0, len(items), w)):
        block = list(items[s:s + w])
        out.extend(block[::-1] if k % 2 else block)
    return out


def plan_micro_batches(shapes: Sequence[tuple[int, int]], size: int, world_size: int = 1,
                       by_length: bool = True) -> list[list[int]]:
    """Row indices (into `shapes`, one mini-batch's rows) of each micro-batch, in the order the
    trainer runs them and `shard` deals them to ranks.

    by_length False: slices of `size` rows in rollout order (each padded to its own longest row).
    by_length True: rows sorted by total length (prompt + completion), longest first, ties by row
    index (a stable, input-only order: the same plan on every rank and every re-run), then sliced into
    `size` rows, so each micro-batch pads to rows of similar length. The micro-batches run largest
    first (padded positions; ties in slicing order): the peak-memory micro-batch comes first, where
    an out-of-memory error costs least, and `deal_to_ranks` balances the ranks' positions.
    Within a micro-batch the rows keep rollout order.

    The composition of the mini-batch does not change, only which rows share a forward: the
    trainer's loss normalisers are the mini-batch's (`LossNorm`), so the gradient is the same up to
    float summation order.
    """
    n = len(shapes)
    if not by_length:
        return [list(range(s, min(s + size, n))) for s in range(0, n, size)]
    order = sorted(range(n), key=lambda i: (-(shapes[i][0] + shapes[i][1]), i))
    micro = [sorted(order[s:s + size]) for s in range(0, n, size)]
    micro.sort(key=lambda m: -padded_positions([shapes[i] for i in m]))  # stable: ties keep slicing order
    return deal_to_ranks(micro, world_size)


def plan_update(shapes: Sequence[tuple[int, int]], cfg: QerlConfig, world_size: int = 1) -> list[list[list[int]]]:
    """The update's layout: for each of the `algo.mini_batches` mini-batches (consecutive rows in
    rollout order, whatever the micro-batch layout), the row indices (into `shapes`, all kept rows) of each micro-batch
    (`plan_micro_batches` with `optim.micro_batch_size` and `optim.sort_micro_batches`)."""
    return [[[idx.start + i for i in mb]
             for mb in plan_micro_batches(shapes[idx.start:idx.stop], cfg.optim.micro_batch_size, world_size,
                                          cfg.optim.sort_micro_batches)]
            for idx in _chunks(len(shapes), cfg.algo.mini_batches)] if shapes else []


def plan_positions(plan: list[list[list[int]]], shapes: Sequence[tuple[int, int]]) -> dict[str, int]:
    """Positions one pass over the rows computes under `plan` (`plan_update`): `update_positions` the
    real ones (prompt + completion tokens), `update_padded_positions` what the micro-batches' padded
    tensors hold. Each pass (training, behaviour, reference) repeats the same micro-batches."""
    mbs = [mb for mini in plan for mb in mini]
    return {"update_positions": sum(shapes[i][0] + shapes[i][1] for mb in mbs for i in mb),
            "update_padded_positions": sum(padded_positions([shapes[i] for i in mb]) for mb in mbs)}


def update_work(n_rows: int, cfg: QerlConfig, world_size: int = 1) -> int:
    """Micro-batch passes one rank runs in `train_on_rollouts` for `n_rows` kept rows (the unit of its
    progress): the training passes, plus the no-grad behaviour pass when there are several mini-batches."""
    mbs = cfg.optim.micro_batch_size
    per_mini = [math.ceil(len(r) / mbs) for r in _chunks(n_rows, cfg.algo.mini_batches)] if n_rows else []
    mine = sum(math.ceil(n / world_size) for n in per_mini)  # rank 0's share, the largest
    return mine * (2 if len(per_mini) > 1 else 1)


def train_on_rollouts(policy, optimizer, scheduler, rows: list[dict], cfg: QerlConfig, ctx=None,
                      progress=None) -> dict:
    """Run `algo.mini_batches` optimizer steps over `rows` (kept rows only). Returns metrics.

    Each mini-batch is split into micro-batches of `optim.micro_batch_size` sequences whose
    gradients accumulate (`plan_update`: grouped by length with `optim.sort_micro_batches`); the
    loss normalisers (sequences, tokens) are those of the whole mini-batch, so the accumulated
    gradient equals the full mini-batch's. The metrics' `update_positions` / `update_padded_positions`
    are the real and padded positions of one pass over the rows. With a
    `qerl_lib.distributed.DistContext`, this rank runs every world_size-th micro-batch and the
    gradients and metric sums are summed over the group (same result on every rank).
    `progress(n)`, when given, is called with the micro-batch passes done so far (`update_work`).
    """
    from qerl_lib.checkpointing import enable_checkpointing
    from qerl_lib.distributed import all_reduce_grads, all_reduce_sums, shard
    from qerl_lib.losses import LOSSES, LossInputs, LossNorm, add_stats
    from qerl_lib.optim import clip_grad_norm

    model = policy.model
    loss_fn = LOSSES[cfg.algo.loss]
    temperature = float(rows[0]["temperature"])
    params = [p for p in model.parameters() if p.requires_grad]
    pad = policy.tokenizer.pad_token_id
    use_ref = (cfg.algo.loss == "grpo" and cfg.algo.beta > 0) or cfg.algo.kl_metric
    if cfg.optim.gradient_checkpointing and not getattr(model, "is_gradient_checkpointing", False):
        enable_checkpointing(model, offload=cfg.optim.offload_activations,
                             mlp_chunk_tokens=cfg.optim.mlp_chunk_tokens)
    # Every rank builds the same plan (a function of the rows' lengths only), so the (mini, micro) keys
    # of `old_logps` and the micro-batches `shard` deals agree across the two passes and across ranks.
    shapes = [row_shape(r) for r in rows]
    plan = plan_update(shapes, cfg, 1 if ctx is None else ctx.world_size)
    micro = [[build_batch([rows[i] for i in mb], pad, policy.device) for mb in mini] for mini in plan]

    # The whole update (forward, backward, checkpoint recomputation) runs under one SDPA choice.
    with training_attention(policy.device):
        old_logps: dict[tuple[int, int], torch.Tensor] = {}
        passes = 0
        if len(micro) > 1:
            # Later mini-batches step a policy that has already moved: freeze the behaviour logprobs first.
            with torch.no_grad():
                for a, batches in enumerate(micro):
                    for b_i, b in shard(batches, ctx):
                        old_logps[a, b_i] = policy_logprobs(model, b, temperature, False)[0]
                        passes += 1
                        if progress is not None:
                            progress(passes)

        totals: dict[str, float] = {}
        entropy_sum = mismatch_sum = tokens_total = 0.0
        grad_norms, lrs, losses = [], [], []
        skipped = 0
        model.train()
        for a, batches in enumerate(micro):
            norm = LossNorm.from_masks([b.mask for b in batches], max_len=cfg.rollout.max_new_tokens)
            optimizer.zero_grad(set_to_none=True)
            loss_total = 0.0
            for b_i, b in shard(batches, ctx):
                logp, entropy = policy_logprobs(model, b, temperature, True)
                old = old_logps.get((a, b_i), logp.detach())
                ref = None
                if use_ref:
                    with torch.no_grad(), model.disable_adapter():
                        ref = policy_logprobs(model, b, temperature, False)[0]
                x = LossInputs(logp=logp, old_logp=old, advantages=b.advantages, mask=b.mask, norm=norm,
                               rollout_logp=b.rollout_logp, ref_logp=ref)
                loss, stats = loss_fn(x, cfg.algo)
                loss.backward()
                loss_total += float(loss.detach())
                add_stats(totals, stats)
                m = b.mask
                tokens_total += float(m.sum())
                entropy_sum += float((entropy * m).sum())
                # k1 estimate of KL(rollout engine || trainer) on the sampled tokens: the engine mismatch.
                mismatch_sum += float(((b.rollout_logp - old) * m).sum())
                passes += 1
                if progress is not None:
                    progress(passes)
            all_reduce_grads(params, ctx)
            gnorm = clip_grad_norm(params, cfg.optim.grad_clip)
            lrs.append(optimizer.param_groups[0]["lr"])
            losses.append(loss_total)
            if math.isfinite(gnorm):
                grad_norms.append(gnorm)
                optimizer.step()
            else:
                # A NaN/inf gradient would poison the adapter and every later rollout; skip the step as
                # verl does, keep the schedule moving, and say which parameters carried it.
                bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
                log.warning("update skipped: gradient norm %s in mini-batch %d; non-finite grads in %d tensors (%s)",
                            gnorm, a, len(bad), ", ".join(bad[:3]))
                skipped += 1
            scheduler.step()
    model.eval()
    sums = all_reduce_sums({"loss": sum(losses), "entropy": entropy_sum, "mismatch": mismatch_sum,
                            "tokens": tokens_total, **{f"stat.{k}": v for k, v in totals.items()}}, ctx)
    totals = {k.removeprefix("stat."): v for k, v in sums.items() if k.startswith("stat.")}
    entropy_sum, mismatch_sum, tokens_total = sums["entropy"], sums["mismatch"], sums["tokens"]
    n_mini = len(micro)
    denom = max(tokens_total, 1.0)
    out = {k: v / n_mini for k, v in totals.items()}  # each mini-batch's stats are already normalised
    out.update({
        "loss": sums["loss"] / n_mini,
        "entropy": entropy_sum / denom,
        "kl": out.get("kl", 0.0),
        "mismatch_kl": mismatch_sum / denom,
        "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
        "skipped_updates": skipped,
        "lr": lrs[0],
        "tokens": int(tokens_total),
        "optimizer_steps": n_mini - skipped,
        **plan_positions(plan, shapes),
    })
    return out
