"""Greedy GSM8K accuracy of a packaged base model (no adapter) on the CPU, with the project's prompt.

A small first look at the base before the GPU experiment (experiments/qwen05_gsm8k): the first N
problems of a GSM8K test file in file order, the project's prompt (`qerl_lib.rewards.format_prompt`,
gsm8k style: one worked exchange, answer as `#### N`), greedy decoding in float32 through
transformers' `generate`, graded by the project's grader (`extract_answer` / `is_correct`).
Also times the join + hash of the package parts (first use only) and the GGUF -> HF load.

    nice -n 10 .venv/bin/python benchmarks/qwen_base_gsm8k.py --data /work/shared/data/gsm8k/test.jsonl -n 20

prints one line per problem and writes benchmarks/results/qwen05_base_gsm8k_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="a packaged model (qerl_lib.registry_models)")
    ap.add_argument("--data", required=True, help="GSM8K test.jsonl (question / answer rows)")
    ap.add_argument("-n", type=int, default=20, help="first N problems")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=10, help="problems decoded together (left-padded)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--style", choices=["project", "stepwise"], default="project",
                    help="project: qerl_lib.rewards' gsm8k prompt (one worked exchange); stepwise: no example, "
                         "'Solve it step by step, then give the final answer on the last line in the form "
                         "#### <number>.'")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/qwen05_base_gsm8k_cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl_lib.data import gsm8k_answer
    from qerl_lib.registry_models import packaged_gguf_path
    from qerl_lib.rewards import PromptStyle, extract_answer, format_prompt, is_correct

    style = None if args.style == "project" else PromptStyle(
        instruction="{question}\nSolve it step by step, then give the final answer on the last line in the form "
                    "#### <number>.")

    t0 = time.perf_counter()
    gguf = packaged_gguf_path(args.model)
    t_join = time.perf_counter() - t0
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    t_load = time.perf_counter() - t0
    model.eval()
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    stop = sorted({*eos, tok.eos_token_id} - {None})  # <|im_end|> (end of turn) and <|endoftext|>
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token

    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()][: args.n]
    results, t_gen, n_tokens = [], 0.0, 0
    for start in range(0, len(rows), args.batch):
        batch = rows[start:start + args.batch]
        prompts = [format_prompt(tok, r["question"], "gsm8k", style=style) for r in batch]
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**enc, do_sample=False, max_new_tokens=args.max_new_tokens, eos_token_id=stop,
                                 pad_token_id=tok.pad_token_id)
        t_gen += time.perf_counter() - t0
        for i, r in enumerate(batch):
            ids = out[i, enc["input_ids"].shape[1]:].tolist()
            ended = next((j for j, t in enumerate(ids) if t in stop), None)
            ids = ids if ended is None else ids[:ended]
            n_tokens += len(ids)
            text = tok.decode(ids, skip_special_tokens=True)
            truth = gsm8k_answer(r["answer"])
            got = extract_answer(text, "gsm8k")
            ok = is_correct(got, truth, "gsm8k")
            results.append({"index": start + i, "truth": truth, "extracted": got, "correct": ok,
                            "tokens": len(ids), "truncated": ended is None, "completion": text})
            print(f"{start + i:3d} truth={truth:>8} got={str(got):>8} {'OK ' if ok else 'no '} "
                  f"{len(ids):3d} tok", flush=True)
    acc = sum(r["correct"] for r in results) / len(results)
    summary = {
        "command": "nice -n 10 .venv/bin/python benchmarks/qwen_base_gsm8k.py " + " ".join(sys.argv[1:]),
        "model": args.model, "gguf": gguf.name, "data": args.data, "n": len(results),
        "prompt": ("qerl_lib.rewards.format_prompt(tok, question, 'gsm8k') (chat template, one worked example)"
                   if style is None else f"chat template, no example, instruction {style.instruction!r}"),
        "decoding": f"greedy, float32, max_new_tokens={args.max_new_tokens}, batch {args.batch} left-padded",
        "greedy_accuracy": acc, "format_rate": sum(r["extracted"] is not None for r in results) / len(results),
        "truncated": sum(r["truncated"] for r in results),
        "seconds": {"join_and_hash_or_cache_hit": round(t_join, 2), "gguf_load": round(t_load, 1),
                    "generate": round(t_gen, 1)},
        "generated_tokens": n_tokens,
        "machine": f"{platform.machine()}, torch threads {torch.get_num_threads()}",
        "torch": torch.__version__,
        "rows": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=2))


if __name__ == "__main__":
    main()
