"""rollout@i: checkpoint + adapter i + AQN noise of step i + the prompts of step i ->
`rollouts/step=i/rollouts.parquet`: G samples per prompt with their token ids and the logprobs
the engine sampled with (`qerl_lib.schema`), and `provenance.json` beside it.

The noise is AQN's sigma of step i (`qerl_lib.aqn.sigma_at`) drawn from (aqn.seed, i); every
row records sigma, the noise seed and its own sampling seed `derive_seed(seed, i, prompt_id,
sample_idx)`, so any row can be re-sampled alone.
"""

from __future__ import annotations

import time
from pathlib import Path

from qerl_lib.config import QerlConfig
from qerl_lib.paths import Layout
from qerl_lib.progress import progress
from qerl_lib.seeds import derive_seed, stable_id
from qerl_lib.stages.common import file_metadata, provenance, sampler_for


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


def rollout_stage(cfg: QerlConfig, layout: Layout, step: int, policy=None) -> Path:
    from qerl_lib.aqn import sigma_at
    from qerl_lib.data import load_prepared
    from qerl_lib.rewards import format_row
    from qerl_lib.rollout.sampling import SamplingParams
    from qerl_lib.schema import to_table, write_provenance, write_rollouts

    t0 = time.perf_counter()
    prompts = load_prepared(layout.prepared("train"))
    picked = [prompts[i] for i in select_prompts([p["prompt_id"] for p in prompts], step,
                                                 cfg.rollout.prompts_per_step, cfg.run.seed)]
    adapter_dir = layout.adapter(step)
    if not adapter_dir.is_dir():
        raise FileNotFoundError(f"rollout@{step} needs adapter {adapter_dir} (run update@{step - 1} or init_adapter)")
    pol = sampler_for(cfg, layout, policy)
    pol.load_adapter(adapter_dir, step)
    sigma = sigma_at(step, cfg.run.steps, cfg.aqn)
    pol.set_noise(sigma, cfg.aqn.seed, step, cfg.aqn.sigma_mode)
    t_load = time.perf_counter() - t0

    rc = cfg.rollout
    params = SamplingParams(rc.temperature, rc.top_p, rc.max_new_tokens)
    tok = pol.tokenizer
    texts, ids, seeds, meta = [], [], [], []
    for p in picked:
        text = format_row(tok, p, cfg.data.prompt, cfg.model.chat_template)
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
