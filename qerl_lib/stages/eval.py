"""eval@k: adapter k on the test set -> `eval/step=k/samples.parquet` (every sample, graded) and
`metrics.json`: pass@1 averaged over `eval.k` samples at `eval.temperature`, and greedy accuracy.
Evaluation always sees the clean quantized base (no AQN) with adapter k in place.
"""

from __future__ import annotations

import time

import numpy as np

from qerl_lib.config import QerlConfig
from qerl_lib.io import atomic_write_json
from qerl_lib.paths import Layout
from qerl_lib.progress import progress
from qerl_lib.seeds import derive_seed, stable_id
from qerl_lib.stages.common import file_metadata, provenance, sampler_for


def standard_error(correct: np.ndarray, prompt_ids: list[str]) -> float:
    """Standard error of a mean accuracy over prompts: the rows of a prompt (its k samples) are
    averaged first, since they are not independent; then std (ddof 1) of the per-prompt means over
    sqrt(prompts). correct: [rows] 0/1. 0.0 with fewer than two prompts."""
    per: dict[str, list[float]] = {}
    for c, pid in zip(correct.tolist(), prompt_ids):
        per.setdefault(pid, []).append(c)
    means = np.array([np.mean(v) for v in per.values()], dtype=np.float64)
    if len(means) < 2:
        return 0.0
    return float(means.std(ddof=1) / np.sqrt(len(means)))


def eval_stage(cfg: QerlConfig, layout: Layout, step: int, policy=None) -> dict:
    """pass@1 over k samples (eval.temperature, eval.top_p) and greedy accuracy of adapter `step`."""
    from qerl_lib.data import load_prepared
    from qerl_lib.rewards import format_row
    from qerl_lib.rollout.sampling import SamplingParams
    from qerl_lib.schema import to_table, write_provenance, write_rollouts
    from qerl_lib.scoring import score_rows

    t0 = time.perf_counter()
    ec = cfg.eval
    prompts = load_prepared(layout.prepared("test"))
    if ec.max_prompts is not None:
        prompts = prompts[: ec.max_prompts]
    pol = sampler_for(cfg, layout, policy)
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
            text = format_row(tok, p, cfg.data.prompt, cfg.model.chat_template)
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
        batch = score_rows(batch, cfg.reward)
        correct = np.array([r["reward_correct"] > 0 for r in batch], dtype=np.float64)
        key = "pass_at_1" if name == "sampled" else "greedy_acc"
        # pass@1 averaged over k samples = mean over prompts of (correct samples / k) = mean over all rows.
        result[key] = float(correct.mean()) if len(batch) else 0.0
        result[f"{key}_se"] = standard_error(correct, [r["prompt_id"] for r in batch])
        result[f"{name}_format_rate"] = float(np.mean([r["reward_format"] > 0 for r in batch])) if batch else 0.0
        rows.extend(batch)
    path = layout.eval_samples(step)
    write_rollouts(to_table(rows, str(path)), path, file_metadata(cfg, layout, "eval"))
    write_provenance(path, provenance(time.perf_counter() - t0))
    result["seconds"] = round(time.perf_counter() - t0, 3)
    atomic_write_json(layout.eval_metrics(step), result)
    return result
