"""reward@i: rollouts of step i -> `rewards/step=i/scored.parquet` (the same rows with reward
components, group advantages and kept flags) and `metrics.json`.

advantage = (r - mean_group) / (std_group + eps) (`qerl_lib.advantages`); DAPO's dynamic
sampling drops groups whose rewards are all equal, and `reward.mask_truncated` drops rows cut
by the length limit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from qerl_lib.config import QerlConfig
from qerl_lib.io import atomic_write_json
from qerl_lib.paths import Layout


def reward_stage(cfg: QerlConfig, layout: Layout, step: int) -> Path:
    from qerl_lib.advantages import group_advantages, zero_variance_mask
    from qerl_lib.schema import read_metadata, read_rollouts, to_table, write_rollouts
    from qerl_lib.scoring import score_rows

    src = layout.rollouts(step)
    table = read_rollouts(src)
    grader = read_metadata(src).get("grader") or "gsm8k"
    rows = [dict(r, _grader=grader) for r in table.to_pylist()]
    rows = score_rows(rows, cfg.reward)
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
