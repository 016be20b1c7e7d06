"""What one step of `benchmarks/rl_step.py` is made of, and how its results add up: pure functions,
no GPU and no vLLM (the benchmark's docstring says what the step does and why).

- the step's inputs: completion lengths (log-normal, seeded), random prompts, per-row seeds, which rows
  answer right (`step_inputs`), the rows the rollout stage would write (`rollout_rows`) and the reward
  stage on them in memory (`score_step`);
- sizes: the positions the trainer's update computes (`update_positions`, from the trainer's own
  layout), the KV cache the rows need (`kv_cache_gib`, `kv_gib_of`), the engine's CUDA-graph sizes;
- the config the benchmark runs (`bench_config`) and the model shape (`shape_of`, `register_shape`);
- the result file (`assemble`: headline keys, per-arm summaries, ratios).
"""

from __future__ import annotations

import importlib
import math
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_PROFILE = importlib.import_module("benchmarks.decode_gemm_profile")
SHAPE_7B = _PROFILE.SHAPE  # Qwen2.5-7B, as the decode profile has it

GIB = 1 << 30
ARMS = ("bf16", "nvfp4", "nvfp4-aqn")
SHAPES = {"7b": SHAPE_7B,
          "tiny": {"hidden": 512, "inter": 1536, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 128, "vocab": 8192}}
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)
PHASES = ("handover", "rollout", "reward", "update")
_WORDS = ("so", "the", "total", "is", "we", "have", "then", "each", "=", "+", "*", "3", "12", "40", "and", "step")


def completion_lengths(n: int, max_len: int, seed: int, median: float | None = None, sigma: float = 0.6) -> list[int]:
    """Length of each of `n` completions: exp(N(log median, sigma^2)) from numpy's default_rng(seed),
    rounded, clipped to [1, max_len]; the median defaults to 0.3 * max_len."""
    med = 0.3 * max_len if median is None else float(median)
    x = np.exp(math.log(med) + sigma * np.random.default_rng(seed).standard_normal(n))
    return np.clip(np.rint(x), 1, max_len).astype(int).tolist()


def length_stats(lengths: list[int], max_len: int) -> dict:
    a = np.asarray(lengths)
    p10, p50, p90 = (float(np.percentile(a, q)) for q in (10, 50, 90))
    return {"rows": int(a.size), "tokens": int(a.sum()), "mean": round(float(a.mean()), 1), "p10": p10, "p50": p50,
            "p90": p90, "max": int(a.max()), "at_cap_frac": round(float((a >= max_len).mean()), 4)}


def kv_cache_gib(lengths: list[int], prompt: int, shape: dict, block: int = 16, headroom: float = 1.1) -> float:
    """KV cache (GiB) holding every row at its full length at once: bf16 K and V in `block`-token blocks."""
    per_token = _PROFILE.kv_bytes_per_token(shape)
    tokens = sum(math.ceil((prompt + n) / block) * block for n in lengths)
    return math.ceil(tokens * per_token * headroom / GIB * 100) / 100


def update_positions(rows: list[dict], cfg) -> dict:
    """Positions one pass of the trainer over the kept `rows` computes, from the trainer's own layout
    (`qerl_lib.trainer.plan_update`): `update_positions` real (prompt + completion tokens),
    `update_padded_positions` as the config lays the micro-batches out, and
    `update_padded_positions_rollout_order` for slices in rollout order (the layout before
    `optim.sort_micro_batches`)."""
    from qerl_lib.trainer import plan_positions, plan_update, row_shape

    shapes = [row_shape(r) for r in rows]
    rollout_order = cfg.model_copy(deep=True)
    rollout_order.optim.sort_micro_batches = False
    return {**plan_positions(plan_update(shapes, cfg), shapes),
            "update_padded_positions_rollout_order":
                plan_positions(plan_update(shapes, rollout_order), shapes)["update_padded_positions"]}


def positions_of_lengths(lengths: list[int], prompt: int, cfg) -> dict:
    """`update_positions` of a step whose rows all train: prompts of `prompt` tokens, these completions."""
    return update_positions([{"prompt_token_ids": [0] * prompt, "completion_token_ids": [0] * n} for n in lengths], cfg)


def step_inputs(args, vocab: int, step: int) -> dict:
    """Step `step`'s rows (-1: the warm-up): random prompts (one per group), per-row seeds and lengths,
    ground truths and which rows answer right (half of each group; row 0 right, row 1 wrong)."""
    prompts, seed = (args.warmup_prompts, args.seed + 999) if step < 0 else (args.prompts, args.seed + step)
    g = args.group
    rng = np.random.default_rng([seed, 17])
    ids = rng.integers(0, vocab, (prompts, args.prompt)).tolist()
    right = rng.random((prompts, g)) < 0.5
    right[:, 0], right[:, 1] = True, False  # both outcomes in every group: DAPO keeps them all
    return {"prompts": [ids[i // g] for i in range(prompts * g)], "group_ids": [i // g for i in range(prompts * g)],
            "seeds": [seed * 1_000_003 + i for i in range(prompts * g)],
            "lengths": completion_lengths(prompts * g, args.max_completion, seed, args.len_median, args.len_sigma),
            "answers": rng.integers(1, 10_000, prompts).tolist(), "right": right.reshape(-1).tolist()}


def stand_in_text(token_ids: list[int], answer: int) -> str:
    """The decode stand-in: one word per token id, then the final-answer line."""
    return " ".join(_WORDS[t % len(_WORDS)] for t in token_ids) + f"\n#### {answer}"


def rollout_rows(inp: dict, completions: list, max_len: int) -> list[dict]:
    """Rows with the keys the rollout stage writes and the reward stage and the trainer read."""
    rows = []
    for i, c in enumerate(completions):
        g = inp["group_ids"][i]
        truth = inp["answers"][g]
        rows.append({"group_id": g, "prompt_token_ids": inp["prompts"][i], "completion_token_ids": list(c.token_ids),
                     "sampling_logprobs": list(c.logprobs), "ground_truth": str(truth), "_grader": "gsm8k",
                     "completion_text": stand_in_text(c.token_ids, truth if inp["right"][i] else truth + 1),
                     "truncated": len(c.token_ids) >= max_len, "max_new_tokens": max_len, "temperature": 1.0})
    return rows


def score_step(rows: list[dict], cfg) -> list[dict]:
    """The reward stage on rows in memory: rewards, group advantages, dynamic sampling, kept flags."""
    from qerl_lib.advantages import group_advantages, zero_variance_mask
    from qerl_lib.scoring import score_rows

    rows = score_rows(rows, cfg.reward)
    rewards = np.array([r["reward"] for r in rows], dtype=np.float64)
    groups = np.array([r["group_id"] for r in rows])
    adv = group_advantages(rewards, groups, cfg.algo.scale_rewards, cfg.algo.std_eps)
    kept = np.ones(len(rows), dtype=bool)
    if cfg.algo.dynamic_sampling:
        kept &= ~zero_variance_mask(rewards, groups)
    if cfg.reward.mask_truncated:
        kept &= ~np.array([r["truncated"] for r in rows], dtype=bool)
    for r, a, k in zip(rows, adv, kept):
        r["advantage"], r["kept"] = float(a), bool(k)
    return rows


def _mean(xs):
    return round(statistics.fmean(xs), 3) if xs else None


def arm_summary(res: dict) -> dict:
    steps = res.get("steps", [])
    return {"s_per_step": _mean([s["step_s"] for s in steps]),
            "phases_s": {p: _mean([s["phases_s"][p] for s in steps]) for p in PHASES} if steps else None,
            "peak_gib": max((s["memory"]["peak_gib"] for s in steps), default=None),
            "peak_sum_gib": max((s["memory"]["peak_sum_gib"] for s in steps), default=None)}


def assemble(parts: dict[str, dict], command: str, settings: dict) -> dict:
    """The result file: the headline keys, per-arm summaries and steps, each child's own record."""
    arms, errors, skipped = {}, {}, {}
    for group, part in parts.items():
        arms.update(part.get("arms", {}))
        errors.update({f"{group}:{k}": v for k, v in part.get("errors", {}).items()})
        skipped.update(part.get("skipped", {}))
    skipped = {a: why for a, why in skipped.items() if not arms.get(a, {}).get("steps")}  # a later call ran it
    summ = {a: arm_summary(r) for a, r in arms.items()}
    sps = {a: s["s_per_step"] for a, s in summ.items()}

    def ratio(arm):
        return round(sps["bf16"] / sps[arm], 3) if sps.get("bf16") and sps.get(arm) else None

    return {"command": command, "bf16_s_per_step": sps.get("bf16"), "nvfp4_s_per_step": sps.get("nvfp4"),
            "nvfp4_aqn_s_per_step": sps.get("nvfp4-aqn"), "ratio": ratio("nvfp4"), "ratio_aqn": ratio("nvfp4-aqn"),
            "ratio_definition": "BF16 seconds per step / NVFP4 seconds per step (> 1: NVFP4 is faster)",
            **{k: {a: s[k] for a, s in summ.items()} for k in ("peak_gib", "peak_sum_gib", "phases_s")},
            "settings": settings, "arms": arms, "errors": errors, "skipped": skipped,
            "children": {g: {k: v for k, v in p.items() if k != "arms"} for g, p in parts.items()}}


def capture_sizes(rows: int) -> list[int]:
    """CUDA-graph batch sizes of the engine: `CAPTURE_SIZES` below `rows`, and `rows` itself."""
    return sorted({s for s in CAPTURE_SIZES if s < rows} | {rows})


def shape_of(args) -> dict:
    return dict(SHAPES[args.shape], layers=args.layers or SHAPES[args.shape]["layers"])


def register_shape(name: str, shape: dict) -> None:
    """Make `shape` known by `name` to `benchmarks.train_step.build_model`, which looks shapes up by name."""
    from benchmarks import train_step as ts

    ts.QWEN25.setdefault(name, {"hidden_size": shape["hidden"], "intermediate_size": shape["inter"],
                                "num_hidden_layers": shape["layers"], "num_attention_heads": shape["heads"],
                                "num_key_value_heads": shape["kv_heads"], "vocab_size": shape["vocab"], "rms_norm_eps": 1e-6})


def kv_gib_of(args) -> float:
    """`--kv-gib`, else the most any step (warm-up included) needs, at least 0.5 GiB."""
    return args.kv_gib or max([0.5] + [kv_cache_gib(step_inputs(args, 2, s)["lengths"], args.prompt, shape_of(args))
                                       for s in range(-1, args.steps)])


def bench_config(args, kv_gib: float | None = None):
    """The project's config with this benchmark's rollout and update sizes (the rest: its defaults)."""
    from qerl_lib.config import QerlConfig

    return QerlConfig.model_validate({
        "run": {"steps": 100, "seed": args.seed}, "lora": {"r": 16, "alpha": 32.0}, "aqn": {"enabled": True},
        "rollout": {"backend": "vllm", "prompts_per_step": args.prompts, "group_size": args.group,
                    "max_new_tokens": args.max_completion, "temperature": 1.0, "top_p": 1.0, "vllm_lora_dual_stream": True,
                    "vllm_kv_cache_gib": kv_gib, "vllm_max_model_len": args.prompt + args.max_completion + 16,
                    **({} if args.gemv_rows is None else {"vllm_gemv_rows": args.gemv_rows}),
                    **({} if args.gemv_kernel is None else {"vllm_gemv_kernel": args.gemv_kernel}),
                    **({} if args.dense_above is None else {"vllm_dense_above": args.dense_above}),
                    **({} if args.engine_mem is None else {"vllm_gpu_memory_utilization": args.engine_mem})},
        "optim": {"lr": 1e-4, "micro_batch_size": args.micro_batch, "gradient_checkpointing": True,
                  "sort_micro_batches": args.micro_batch_order == "length"}})
