"""Scoring of sampled rows, shared by the reward stage and evaluation: one grader, one reward."""

from __future__ import annotations

from qerl_lib.config import RewardConfig


def score_rows(rows: list[dict], cfg: RewardConfig) -> list[dict]:
    """Fill the reward columns of rollout rows (pure).

    Each row needs `completion_text`, `ground_truth`, `completion_token_ids`, `max_new_tokens`,
    `truncated`, and `_grader` (the dataset's grader) when `cfg.grader` is "auto". Keys that
    start with `_` are dropped from the returned rows.
    """
    from qerl_lib.rewards import resolve_grader, score

    grader = resolve_grader(cfg.grader) if cfg.grader != "auto" else None
    out = []
    for r in rows:
        g = grader or resolve_grader(r.get("_grader", "gsm8k"))
        rb = score(r["completion_text"], r["ground_truth"], g, n_tokens=len(r["completion_token_ids"]),
                   max_new_tokens=r["max_new_tokens"], truncated=r["truncated"], cfg=cfg)
        r = {k: v for k, v in r.items() if not k.startswith("_")}
        r.update(extracted_answer=rb.extracted, reward_correct=rb.correct, reward_format=rb.format,
                 reward_overlong=rb.overlong, reward=rb.total)
        out.append(r)
    return out
