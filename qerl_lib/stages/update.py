"""update@i: scored rollouts of step i + adapter i -> adapter i+1 (PEFT format, optimizer state,
trainer state) and `metrics/step=i/update.json` (loss, entropy, KL, clip fraction, grad norm, sigma).

The update sees the very noise its rollout sampled with: sigma and noise seed come from the rows
(`qerl_lib.aqn.noised`), not from the config, so rollout and training agree on the policy.
"""

from __future__ import annotations

import time

import numpy as np

from qerl_lib.config import QerlConfig
from qerl_lib.io import atomic_dir, atomic_write_json, read_json
from qerl_lib.paths import OPTIMIZER_STATE, TRAINER_STATE, Layout
from qerl_lib.seeds import derive_seed
from qerl_lib.stages.common import policy_for


def update_stage(cfg: QerlConfig, layout: Layout, step: int, policy=None) -> dict:
    """scored rollouts of step i + adapter i -> adapter i+1 (and its optimizer state, metrics).

    With `parallel.train_world_size` N > 1: joins the `torchrun` group this process was started
    in, or starts N local ranks itself and returns rank 0's metrics (`qerl_lib.distributed`).

    A rollout server on the same devices (`qerl serve`, colocated) sleeps while this trains and is
    woken after (`qerl_lib.rollout.client.server_asleep`); one on other devices keeps running.
    """
    from qerl_lib.distributed import context_from_env, run_update_group
    from qerl_lib.rollout.client import server_asleep

    world = cfg.parallel.train_world_size
    ctx = context_from_env()
    if ctx is not None and ctx.world_size != world:
        raise ValueError(f"parallel.train_world_size={world} but the process group has {ctx.world_size} ranks")
    if ctx is not None and not ctx.is_main:
        return _update(cfg, layout, step, None, ctx)  # rank 0 of the group handles the server
    with server_asleep(layout.root):
        if ctx is None and world > 1:
            run_update_group(world, _update_rank, cfg.model_dump_json(), str(layout.root), step)
            return read_json(layout.update_metrics(step))
        return _update(cfg, layout, step, policy if ctx is None else None, ctx)


def _update_rank(cfg_json: str, root: str, step: int) -> None:
    from qerl_lib.distributed import context_from_env

    _update(QerlConfig.model_validate_json(cfg_json), Layout(root), step, None, context_from_env())


def _update(cfg: QerlConfig, layout: Layout, step: int, policy, ctx) -> dict:
    import torch

    from qerl_lib.aqn import noised
    from qerl_lib.lora import write_adapter_files
    from qerl_lib.optim import build_optimizer, make_scheduler
    from qerl_lib.schema import read_rollouts
    from qerl_lib.progress import progress
    from qerl_lib.trainer import train_on_rollouts, update_work

    t0 = time.perf_counter()
    rows = read_rollouts(layout.scored(step), scored=True).to_pylist()
    sigmas = {(r["aqn_sigma"], r["aqn_seed"]) for r in rows}
    if len(sigmas) > 1:
        raise ValueError(f"{layout.scored(step)}: rows disagree on (aqn_sigma, aqn_seed): {sorted(sigmas)}")
    sigma, aqn_seed = sigmas.pop() if sigmas else (0.0, cfg.aqn.seed)
    pol = policy_for(cfg, layout, policy)
    src = layout.adapter(step)
    pol.load_adapter(src, step)
    state = read_json(src / TRAINER_STATE) if (src / TRAINER_STATE).is_file() else {"optimizer_steps": 0}
    params = [p for p in pol.model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg.optim, pol.device)
    if (src / OPTIMIZER_STATE).is_file():
        opt_state = load_optimizer_state(src / OPTIMIZER_STATE, pol.device)
        try:
            optimizer.load_state_dict(opt_state)
        except (ValueError, KeyError, RuntimeError) as e:
            raise ValueError(f"{src / OPTIMIZER_STATE}: does not fit this adapter's parameters ({e})") from None
    total_opt = cfg.run.steps * cfg.algo.mini_batches
    scheduler = make_scheduler(optimizer, total_opt, cfg.optim, state["optimizer_steps"])  # where `step` left it
    t_setup = time.perf_counter() - t0

    kept = [r for r in rows if r["kept"]]
    rewards = np.array([r["reward"] for r in rows], dtype=np.float64)
    # Seeded per step so that dropout (if any) and any sampling inside the update repeat on resume.
    torch.manual_seed(derive_seed(cfg.run.seed, "update", step))
    if kept:
        # The update sees the very noise its rollout sampled with (sigma and seed from the rows).
        world = 1 if ctx is None else ctx.world_size
        show = ctx is None or ctx.is_main  # one rank speaks for the group
        with noised(pol.injector, float(sigma), int(aqn_seed), step, cfg.aqn.sigma_mode), \
                progress(f"update@{step}", update_work(len(kept), cfg, world) if show else 0, "micro-batches") as done:
            metrics = train_on_rollouts(pol, optimizer, scheduler, kept, cfg, ctx, progress=done)
    else:
        # Every group had equal rewards: nothing to learn; adapter step+1 = adapter step. Entropy and KL
        # are NaN, not 0: no policy token was scored, and a 0 would read as "the policy is the base".
        metrics = {"loss": 0.0, "entropy": float("nan"), "kl": float("nan"), "clip_frac": 0.0, "grad_norm": 0.0,
                   "lr": optimizer.param_groups[0]["lr"], "tokens": 0, "optimizer_steps": 0, "skipped": True,
                   "update_positions": 0, "update_padded_positions": 0}
    opt_steps = state["optimizer_steps"] + metrics.get("optimizer_steps", 0)
    pol.version = step + 1
    if ctx is not None and not ctx.is_main:
        return metrics  # every rank holds the same adapter; rank 0 writes it
    out = layout.adapter(step + 1)
    with atomic_dir(out) as tmp:
        write_adapter_files(pol.model, tmp)
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


def load_optimizer_state(path, device) -> dict:
    """The optimizer state saved beside an adapter, read with `weights_only=True` (a pickle
    payload that would run code is refused by torch); a damaged or foreign file is refused by
    name (ValueError) instead of a traceback."""
    import pickle
    import zipfile

    import torch

    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: not a readable optimizer state ({first[:200]}); delete the adapter "
                         "directory and re-run the update that wrote it") from None
    if not isinstance(state, dict) or "state" not in state or "param_groups" not in state:
        raise ValueError(f"{path}: not an optimizer state (no 'state' / 'param_groups')")
    return state


def _aqn_stage(step: int, cfg: QerlConfig) -> int:
    from qerl_lib.aqn import stage_of

    return stage_of(step, cfg.run.steps, cfg.aqn.stages)
