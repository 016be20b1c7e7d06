"""The stages of the QeRL loop: each a function of (config, layout, step) with its
inputs and outputs on disk (see `qerl_lib.paths`). The CLI (`qerl stage NAME`), DVC
and the Prefect tasks all call these functions, so every door gives the same bytes.

    prepare -> convert -> init_adapter -> [rollout@i -> reward@i -> update@i]* -> eval@k -> report

Every output is written through a temporary name; a stage killed half-way leaves the
previous state untouched and is simply run again.
"""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import time
from pathlib import Path

import numpy as np

from qerl_lib.config import QerlConfig, config_hash, save_config
from qerl_lib.io import atomic_dir, atomic_write_json, read_json
from qerl_lib.paths import OPTIMIZER_STATE, TRAINER_STATE, Layout
from qerl_lib.progress import progress
from qerl_lib.seeds import derive_seed, stable_id

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- helpers


def _git_commit() -> str:
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "."], cwd=here.parent,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha or "unknown") + ("-dirty" if dirty else "")


def _versions() -> dict[str, str]:
    out = {}
    for name in ("torch", "transformers", "peft", "vllm"):
        try:
            from importlib.metadata import version

            out[name] = version(name)
        except Exception:
            out[name] = ""
    return out


QUANT_SCHEMES = {"nvfp4": "NVFP4A16", "bf16": "BF16", "nf4": "NF4 (bitsandbytes, double quant)"}
"""`model.quant` -> the `quant_scheme` stamped on every Parquet file."""


def file_metadata(cfg: QerlConfig, layout: Layout, kind: str) -> dict[str, str]:
    report_path = layout.convert_report(cfg.model.quant)
    ckpt_hash = read_json(report_path)["checkpoint_hash"] if report_path.is_file() else ""
    return {
        "kind": kind,
        "base_model": cfg.model.base,
        "quant_scheme": QUANT_SCHEMES[cfg.model.quant],
        "checkpoint_hash": ckpt_hash,
        **_versions(),
        "git_commit": _git_commit(),
        "config_hash": config_hash(cfg),
    }


def provenance(seconds: float, **extra) -> dict:
    return {
        "seconds": round(seconds, 3),
        "flow_run_id": os.environ.get("PREFECT__FLOW_RUN_ID") or os.environ.get("QERL_FLOW_RUN_ID", ""),
        "host": platform.node(),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **extra,
    }


def select_prompts(prompt_ids: list[str], step: int, per_step: int, seed: int) -> list[int]:
    """Indices of the prompts of `step`: epochs of a seeded shuffle, walked in order.

    Sample j of step i is item (i*per_step + j) of the endless sequence made of epoch
    0's order, then epoch 1's, ...; each epoch orders the prompts by a hash of
    (seed, epoch, prompt_id). Any step can be computed alone (no state to resume).
    """
    n = len(prompt_ids)
    orders: dict[int, list[int]] = {}
    picked = []
    for j in range(per_step):
        flat = step * per_step + j
        epoch, pos = divmod(flat, n)
        if epoch not in orders:
            orders[epoch] = sorted(range(n), key=lambda k: derive_seed(seed, "epoch", epoch, prompt_ids[k]))
        picked.append(orders[epoch][pos])
    return picked


def _policy(cfg, layout, policy):
    from qerl_lib.policy import get_policy

    return policy if policy is not None else get_policy(cfg, layout, reuse=False)


# ----------------------------------------------------------------------------- prepare / convert / init


def prepare_stage(cfg: QerlConfig, layout: Layout) -> dict:
    from qerl_lib.data import prepare

    stats = prepare(cfg.data, cfg.run.seed, layout.prepared_dir)
    return stats


def convert_stage(cfg: QerlConfig, layout: Layout) -> dict:
    from qerl_lib.convert import convert
    from qerl_lib.model import materialize_base

    t0 = time.perf_counter()
    source_marker = f"{cfg.model.base}\n{cfg.model.gguf_file or ''}\n"
    marker = layout.base_model / "SOURCE"
    if not (marker.is_file() and marker.read_text() == source_marker):
        materialize_base(cfg.model.base, cfg.model.gguf_file, layout.base_model)
    t1 = time.perf_counter()
    report = convert(layout.base_model, layout.checkpoint(cfg.model.quant), cfg.model.quant)
    report["seconds_materialize"] = round(t1 - t0, 3)
    report["seconds_convert"] = round(time.perf_counter() - t1, 3)
    return report


def init_adapter_stage(cfg: QerlConfig, layout: Layout) -> Path:
    """Adapter 0: seeded A, zero B, so step 0 samples from the base itself."""
    from qerl_lib.lora import apply_lora, save_adapter
    from qerl_lib.model import load_base, resolve_device, resolve_dtype

    device = resolve_device(cfg.model.device)
    base = load_base(layout.checkpoint(cfg.model.quant), cfg.model.quant,
                     resolve_dtype(cfg.model.compute_dtype, device), device)
    model = apply_lora(base, cfg.lora)
    out = layout.adapter(0)
    with atomic_dir(out) as tmp:
        save_adapter(model, tmp)
        atomic_write_json(tmp / TRAINER_STATE, {"step": 0, "optimizer_steps": 0})
    return out


# ----------------------------------------------------------------------------- rollout


def rollout_stage(cfg: QerlConfig, layout: Layout, step: int, policy=None) -> Path:
    from qerl_lib.aqn import sigma_at
    from qerl_lib.data import load_prepared
    from qerl_lib.rewards import format_prompt
    from qerl_lib.sampling import SamplingParams
    from qerl_lib.schema import to_table, write_provenance, write_rollouts

    t0 = time.perf_counter()
    prompts = load_prepared(layout.prepared("train"))
    picked = [prompts[i] for i in select_prompts([p["prompt_id"] for p in prompts], step,
                                                 cfg.rollout.prompts_per_step, cfg.run.seed)]
    adapter_dir = layout.adapter(step)
    if not adapter_dir.is_dir():
        raise FileNotFoundError(f"rollout@{step} needs adapter {adapter_dir} (run update@{step - 1} or init_adapter)")
    pol = _policy(cfg, layout, policy)
    pol.load_adapter(adapter_dir, step)
    sigma = sigma_at(step, cfg.run.steps, cfg.aqn)
    pol.set_noise(sigma, cfg.aqn.seed, step)
    t_load = time.perf_counter() - t0

    rc = cfg.rollout
    params = SamplingParams(rc.temperature, rc.top_p, rc.max_new_tokens)
    tok = pol.tokenizer
    texts, ids, seeds, meta = [], [], [], []
    for p in picked:
        text = format_prompt(tok, p["question"], p["grader"], cfg.model.chat_template)
        pids = tok(text, add_special_tokens=False)["input_ids"]
        for g in range(rc.group_size):
            texts.append(text)
            ids.append(pids)
            seeds.append(derive_seed(cfg.run.seed, step, p["prompt_id"], g))
            meta.append((p, g))
    t1 = time.perf_counter()
    with progress(f"rollout@{step}", len(ids)) as done:
        completions = pol.generate(ids, seeds, params, rc.batch_size, progress=done)
    gen_seconds = time.perf_counter() - t1
    pol.set_noise(0.0, cfg.aqn.seed, step)

    rows = []
    for (p, g), text, pids, seed, comp in zip(meta, texts, ids, seeds, completions):
        rows.append({
            "step": step, "prompt_id": p["prompt_id"], "group_id": stable_id(step, p["prompt_id"]),
            "sample_idx": g, "prompt": p["question"], "prompt_text": text, "prompt_token_ids": pids,
            "completion_text": tok.decode(comp.token_ids, skip_special_tokens=True),
            "completion_token_ids": comp.token_ids, "sampling_logprobs": comp.logprobs,
            "finish_reason": comp.finish_reason, "truncated": comp.finish_reason == "length",
            "ground_truth": p["ground_truth"], "policy_version": step, "adapter_hash": pol.adapter_hash,
            "aqn_sigma": sigma, "aqn_seed": cfg.aqn.seed, "seed": seed, "temperature": rc.temperature,
            "top_p": rc.top_p, "max_new_tokens": rc.max_new_tokens,
        })
    path = layout.rollouts(step)
    meta_file = file_metadata(cfg, layout, "rollout")
    meta_file["grader"] = picked[0]["grader"] if picked else ""
    table = to_table(rows, str(path))
    n_tok = sum(len(c.token_ids) for c in completions)
    # The sidecar goes first: the Parquet file is the stage's done-marker, so a kill between
    # the two writes re-runs the stage instead of leaving a rollout without provenance.
    write_provenance(path, provenance(time.perf_counter() - t0, seconds_setup=round(t_load, 3),
                                      seconds_generate=round(gen_seconds, 3), completion_tokens=n_tok,
                                      tokens_per_second=round(n_tok / max(gen_seconds, 1e-9), 2),
                                      backend=rc.backend))
    write_rollouts(table, path, meta_file)
    return path


# ----------------------------------------------------------------------------- reward


def score_rows(rows: list[dict], cfg: QerlConfig) -> list[dict]:
    """Fill the reward columns of rollout rows (pure, shared with evaluation)."""
    from qerl_lib.rewards import resolve_grader, score

    grader = resolve_grader(cfg.reward.grader) if cfg.reward.grader != "auto" else None
    out = []
    for r in rows:
        g = grader or resolve_grader(r.get("_grader", "gsm8k"))
        rb = score(r["completion_text"], r["ground_truth"], g, n_tokens=len(r["completion_token_ids"]),
                   max_new_tokens=r["max_new_tokens"], truncated=r["truncated"], cfg=cfg.reward)
        r = {k: v for k, v in r.items() if not k.startswith("_")}
        r.update(extracted_answer=rb.extracted, reward_correct=rb.correct, reward_format=rb.format,
                 reward_overlong=rb.overlong, reward=rb.total)
        out.append(r)
    return out


def reward_stage(cfg: QerlConfig, layout: Layout, step: int) -> Path:
    from qerl_lib.advantages import group_advantages, zero_variance_mask
    from qerl_lib.schema import read_metadata, read_rollouts, to_table, write_rollouts

    src = layout.rollouts(step)
    table = read_rollouts(src)
    grader = read_metadata(src).get("grader") or "gsm8k"
    rows = [dict(r, _grader=grader) for r in table.to_pylist()]
    rows = score_rows(rows, cfg)
    rewards = np.array([r["reward"] for r in rows], dtype=np.float64)
    groups = np.array([r["group_id"] for r in rows])
    adv = group_advantages(rewards, groups, cfg.algo.scale_rewards, cfg.algo.std_eps)
    flat = zero_variance_mask(rewards, groups)
    truncated = np.array([r["truncated"] for r in rows], dtype=bool)
    kept = np.ones(len(rows), dtype=bool)
    if cfg.algo.dynamic_sampling:
        kept &= ~flat
    if cfg.reward.mask_truncated:
        kept &= ~truncated
    for r, a, k in zip(rows, adv, kept):
        r["advantage"] = float(a)
        r["kept"] = bool(k)
    out = layout.scored(step)
    meta = read_metadata(src)
    meta["kind"] = "scored"
    write_rollouts(to_table(rows, str(out)), out, meta, scored=True)
    n_groups = len(set(groups.tolist()))
    metrics = {
        "step": step,
        "reward_mean": float(rewards.mean()) if len(rows) else 0.0,
        "reward_std": float(rewards.std()) if len(rows) else 0.0,
        "correct_rate": float(np.mean([r["reward_correct"] > 0 for r in rows])) if rows else 0.0,
        "format_rate": float(np.mean([r["reward_format"] > 0 for r in rows])) if rows else 0.0,
        "truncated_frac": float(truncated.mean()) if len(rows) else 0.0,
        "kept_frac": float(kept.mean()) if len(rows) else 0.0,
        "zero_variance_groups": int(len(set(groups[flat].tolist()))),
        "groups": n_groups,
        "completion_len_mean": float(np.mean([len(r["completion_token_ids"]) for r in rows])) if rows else 0.0,
    }
    atomic_write_json(layout.reward_metrics(step), metrics)
    return out


# ----------------------------------------------------------------------------- update


def update_stage(cfg: QerlConfig, layout: Layout, step: int, policy=None) -> dict:
    """scored rollouts of step i + adapter i -> adapter i+1 (and its optimizer state, metrics).

    With `parallel.train_world_size` N > 1: joins the `torchrun` group this process was started
    in, or starts N local ranks itself and returns rank 0's metrics (`qerl_lib.distributed`).
    """
    from qerl_lib.distributed import context_from_env, run_update_group

    world = cfg.parallel.train_world_size
    ctx = context_from_env()
    if ctx is None and world > 1:
        run_update_group(world, _update_rank, cfg.model_dump_json(), str(layout.root), step)
        return read_json(layout.update_metrics(step))
    if ctx is not None and ctx.world_size != world:
        raise ValueError(f"parallel.train_world_size={world} but the process group has {ctx.world_size} ranks")
    return _update(cfg, layout, step, policy if ctx is None else None, ctx)


def _update_rank(cfg_json: str, root: str, step: int) -> None:
    from qerl_lib.distributed import context_from_env

    _update(QerlConfig.model_validate_json(cfg_json), Layout(root), step, None, context_from_env())


def _update(cfg: QerlConfig, layout: Layout, step: int, policy, ctx) -> dict:
    import torch

    from qerl_lib.aqn import noised
    from qerl_lib.lora import save_adapter
    from qerl_lib.optim import build_optimizer, make_scheduler
    from qerl_lib.schema import read_rollouts
    from qerl_lib.trainer import train_on_rollouts

    t0 = time.perf_counter()
    rows = read_rollouts(layout.scored(step), scored=True).to_pylist()
    sigmas = {(r["aqn_sigma"], r["aqn_seed"]) for r in rows}
    if len(sigmas) > 1:
        raise ValueError(f"{layout.scored(step)}: rows disagree on (aqn_sigma, aqn_seed): {sorted(sigmas)}")
    sigma, aqn_seed = sigmas.pop() if sigmas else (0.0, cfg.aqn.seed)
    pol = _policy(cfg, layout, policy)
    src = layout.adapter(step)
    pol.load_adapter(src, step)
    state = read_json(src / TRAINER_STATE) if (src / TRAINER_STATE).is_file() else {"optimizer_steps": 0}
    params = [p for p in pol.model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg.optim, pol.device)
    if (src / OPTIMIZER_STATE).is_file():
        optimizer.load_state_dict(torch.load(src / OPTIMIZER_STATE, map_location=pol.device, weights_only=True))
    total_opt = cfg.run.steps * cfg.algo.mini_batches
    scheduler = make_scheduler(optimizer, total_opt, cfg.optim)
    for _ in range(state["optimizer_steps"]):
        scheduler.step()  # replay the schedule to where adapter `step` left it
    t_setup = time.perf_counter() - t0

    kept = [r for r in rows if r["kept"]]
    rewards = np.array([r["reward"] for r in rows], dtype=np.float64)
    # Seeded per step so that dropout (if any) and any sampling inside the update repeat on resume.
    torch.manual_seed(derive_seed(cfg.run.seed, "update", step))
    if kept:
        # The update sees the very noise its rollout sampled with (sigma and seed from the rows).
        with noised(pol.injector, float(sigma), int(aqn_seed), step):
            metrics = train_on_rollouts(pol, optimizer, scheduler, kept, cfg, ctx)
    else:
        # Every group had equal rewards: nothing to learn; adapter step+1 = adapter step. Entropy and KL
        # are NaN, not 0: no policy token was scored, and a 0 would read as "the policy is the base".
        metrics = {"loss": 0.0, "entropy": float("nan"), "kl": float("nan"), "clip_frac": 0.0, "grad_norm": 0.0,
                   "lr": optimizer.param_groups[0]["lr"], "tokens": 0, "optimizer_steps": 0, "skipped": True}
    opt_steps = state["optimizer_steps"] + metrics.get("optimizer_steps", 0)
    pol.version = step + 1
    if ctx is not None and not ctx.is_main:
        return metrics  # every rank holds the same adapter; rank 0 writes it
    out = layout.adapter(step + 1)
    with atomic_dir(out) as tmp:
        save_adapter(pol.model, tmp)
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER_STATE)
        atomic_write_json(tmp / TRAINER_STATE, {"step": step + 1, "optimizer_steps": opt_steps})
    metrics.update({
        "step": step, "sigma": float(sigma), "aqn_stage": _aqn_stage(step, cfg),
        "reward_mean": float(rewards.mean()) if len(rows) else 0.0,
        "reward_std": float(rewards.std()) if len(rows) else 0.0,
        "samples": len(rows), "kept_samples": len(kept),
        "seconds": round(time.perf_counter() - t0, 3), "seconds_setup": round(t_setup, 3),
        "world_size": 1 if ctx is None else ctx.world_size,
    })
    atomic_write_json(layout.update_metrics(step), metrics)
    return metrics


def _aqn_stage(step: int, cfg: QerlConfig) -> int:
    from qerl_lib.aqn import stage_of

    return stage_of(step, cfg.run.steps, cfg.aqn.stages)


# ----------------------------------------------------------------------------- eval


def eval_stage(cfg: QerlConfig, layout: Layout, step: int, policy=None) -> dict:
    """pass@1 over k samples (eval.temperature, eval.top_p) and greedy accuracy of adapter `step`."""
    from qerl_lib.data import load_prepared
    from qerl_lib.rewards import format_prompt
    from qerl_lib.sampling import SamplingParams
    from qerl_lib.schema import to_table, write_provenance, write_rollouts

    t0 = time.perf_counter()
    ec = cfg.eval
    prompts = load_prepared(layout.prepared("test"))
    if ec.max_prompts is not None:
        prompts = prompts[: ec.max_prompts]
    pol = _policy(cfg, layout, policy)
    pol.load_adapter(layout.adapter(step), step)
    pol.set_noise(0.0, cfg.aqn.seed, step)  # evaluation sees the clean quantized base
    tok = pol.tokenizer
    runs = [("sampled", SamplingParams(ec.temperature, ec.top_p, ec.max_new_tokens), ec.k)]
    if ec.greedy:
        runs.append(("greedy", SamplingParams(0.0, 1.0, ec.max_new_tokens), 1))
    rows, result = [], {"step": step, "n_prompts": len(prompts), "k": ec.k}
    for name, params, k in runs:
        texts, ids, seeds, meta = [], [], [], []
        for p in prompts:
            text = format_prompt(tok, p["question"], p["grader"], cfg.model.chat_template)
            pids = tok(text, add_special_tokens=False)["input_ids"]
            for s in range(k):
                texts.append(text)
                ids.append(pids)
                seeds.append(derive_seed(cfg.run.seed, "eval", name, step, p["prompt_id"], s))
                meta.append((p, s))
        with progress(f"eval@{step} {name}", len(ids)) as done:
            comps = pol.generate(ids, seeds, params, cfg.rollout.batch_size, progress=done)
        batch = []
        for (p, s), text, pids, seed, c in zip(meta, texts, ids, seeds, comps):
            batch.append({
                "step": step, "prompt_id": p["prompt_id"], "group_id": stable_id("eval", name, step, p["prompt_id"]),
                "sample_idx": s, "prompt": p["question"], "prompt_text": text, "prompt_token_ids": pids,
                "completion_text": tok.decode(c.token_ids, skip_special_tokens=True),
                "completion_token_ids": c.token_ids, "sampling_logprobs": c.logprobs,
                "finish_reason": c.finish_reason, "truncated": c.finish_reason == "length",
                "ground_truth": p["ground_truth"], "policy_version": step, "adapter_hash": pol.adapter_hash,
                "aqn_sigma": 0.0, "aqn_seed": cfg.aqn.seed, "seed": seed, "temperature": params.temperature,
                "top_p": params.top_p, "max_new_tokens": params.max_new_tokens, "_grader": p["grader"],
            })
        batch = score_rows(batch, cfg)
        correct = np.array([r["reward_correct"] > 0 for r in batch], dtype=np.float64)
        key = "pass_at_1" if name == "sampled" else "greedy_acc"
        # pass@1 averaged over k samples = mean over prompts of (correct samples / k) = mean over all rows.
        result[key] = float(correct.mean()) if len(batch) else 0.0
        result[f"{name}_format_rate"] = float(np.mean([r["reward_format"] > 0 for r in batch])) if batch else 0.0
        rows.extend(batch)
    path = layout.eval_samples(step)
    write_rollouts(to_table(rows, str(path)), path, file_metadata(cfg, layout, "eval"))
    write_provenance(path, provenance(time.perf_counter() - t0))
    result["seconds"] = round(time.perf_counter() - t0, 3)
    atomic_write_json(layout.eval_metrics(step), result)
    return result


# ----------------------------------------------------------------------------- report


def report_stage(cfg: QerlConfig, layout: Layout) -> dict:
    from qerl_lib.report import aggregate

    save_config(cfg, layout.reports_dir / "config.yaml")
    return aggregate(layout, cfg.run.steps)
