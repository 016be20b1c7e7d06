#!/usr/bin/env python3
"""How far an NVFP4 base's next-token distributions sit from its 16-bit original, on GSM8K (CPU is enough).

The NVFP4 base of issue 16 starts 3.9 greedy points below the BF16 base it was quantized from
(docs/results_qwen05_gsm8k.md), and RL on it never closes that gap. Checkpoints converted with
other group scales (`model.nvfp4_observer`) can be compared here before any GPU time: each model
reads the same teacher-forced text, the first `--n` GSM8K test problems in the experiment's prompt
(`data.prompt: stepwise`, the chat template) followed by their reference solutions (calculator
annotations `<<...>>` removed, ending in `#### N`), and over the solution tokens we report

- `kl`: mean KL(16-bit || quantized) of the next-token distributions, nats per token;
- `nll`: mean negative log-likelihood of the reference tokens (the 16-bit model's too);
- `top1_agree`: how often the quantized model's most likely next token is the 16-bit model's.

Models load as the trainer loads them (`qerl_lib.model.load_base`: packed NVFP4 layers, float32
compute on the CPU), one problem at a time through all of them, so no logits are stored.

    python benchmarks/nvfp4_base_fidelity.py --reference <bf16 checkpoint> \
        --nvfp4 minmax=<nvfp4 checkpoint> --nvfp4 expanded_mse=<another> --data <dir with test.jsonl> \
        --n 32 --out benchmarks/results/nvfp4_base_fidelity_qwen05.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qerl_lib.io import atomic_write_json  # noqa: E402


def read_problems(data: Path, n: int, split: str = "test") -> list[dict]:
    """The first `n` rows of `data`/<split>.jsonl as {question, solution} (the solution without its
    calculator annotations `<<...>>`)."""
    path = data / f"{split}.jsonl"
    if not path.is_file():
        raise SystemExit(f"--data {data}: no {split}.jsonl (a GSM8K folder with {split}.jsonl is needed)")
    rows = []
    with path.open() as f:
        for i, line in enumerate(f, start=1):
            if len(rows) == n:
                break
            try:
                row = json.loads(line)
                rows.append({"question": row["question"], "solution": re.sub(r"<<[^>]*>>", "", row["answer"])})
            except (json.JSONDecodeError, KeyError) as e:
                raise SystemExit(f"{path}: row {i}: {type(e).__name__}: {e} (needs `question` and `answer`)") from None
    return rows


def encode(tok, problem: dict) -> tuple[list[int], int]:
    """(token ids of prompt + solution, index of the first solution token)."""
    from qerl_lib.rewards import format_row

    prompt = format_row(tok, {"question": problem["question"], "grader": "gsm8k"}, "stepwise", True)
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    s_ids = tok(problem["solution"], add_special_tokens=False)["input_ids"]
    return p_ids + s_ids, len(p_ids)


def checkpoint_quant(path: Path) -> str:
    """"nvfp4" for a compressed-tensors checkpoint (its config names a quantization), else "bf16"."""
    return "nvfp4" if "quantization_config" in json.loads((path / "config.json").read_text()) else "bf16"


def compare(reference: Path, variants: dict[str, Path], problems: list[dict]) -> dict:
    import torch
    from transformers import AutoTokenizer

    from qerl_lib.model import load_base

    tok = AutoTokenizer.from_pretrained(str(reference))
    cpu = torch.device("cpu")
    ref = load_base(reference, "bf16", torch.float32, cpu)
    models = {name: load_base(path, checkpoint_quant(path), torch.float32, cpu) for name, path in variants.items()}
    sums = {name: {"kl": 0.0, "nll": 0.0, "agree": 0} for name in models}
    ref_nll, tokens = 0.0, 0
    with torch.no_grad():
        for problem in problems:
            ids, start = encode(tok, problem)
            x = torch.tensor([ids])
            # logits at position t predict token t + 1: the solution's tokens are ids[start:]
            target = x[0, start:]
            lp_ref = torch.log_softmax(ref(x).logits[0, start - 1:-1].float(), -1)  # [T, vocab]
            ref_nll -= lp_ref.gather(1, target[:, None]).sum().item()
            top_ref = lp_ref.argmax(-1)
            for name, model in models.items():
                lp = torch.log_softmax(model(x).logits[0, start - 1:-1].float(), -1)
                s = sums[name]
                s["kl"] += (lp_ref.exp() * (lp_ref - lp)).sum().item()
                s["nll"] -= lp.gather(1, target[:, None]).sum().item()
                s["agree"] += int((lp.argmax(-1) == top_ref).sum())
            tokens += len(target)
    out = {"tokens": tokens, "problems": len(problems), "reference_nll": ref_nll / tokens, "variants": {}}
    for name, s in sums.items():
        out["variants"][name] = {"checkpoint": str(variants[name]), "kl": s["kl"] / tokens, "nll": s["nll"] / tokens,
                                 "top1_agree": s["agree"] / tokens}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", type=Path, required=True, help="the 16-bit checkpoint (a convert stage's models/bf16)")
    ap.add_argument("--nvfp4", action="append", required=True, metavar="NAME=DIR",
                    help="an NVFP4 checkpoint of the same model (repeatable; a 16-bit one loads as such)")
    ap.add_argument("--data", type=Path, required=True, help="a GSM8K folder holding test.jsonl")
    ap.add_argument("--n", type=int, default=32, help="test problems, from the first")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    a = ap.parse_args(argv)
    variants = {}
    for item in a.nvfp4:
        name, sep, path = item.partition("=")
        if not sep or not name or not (Path(path) / "config.json").is_file():
            raise SystemExit(f"--nvfp4 {item!r}: expected NAME=DIR with DIR a checkpoint holding config.json")
        variants[name] = Path(path)
    t0 = time.perf_counter()
    res = compare(a.reference, variants, read_problems(a.data, a.n))
    res = {"command": "python benchmarks/nvfp4_base_fidelity.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "seconds": round(time.perf_counter() - t0, 1), **res}
    print(f"{res['problems']} problems, {res['tokens']} solution tokens; reference NLL {res['reference_nll']:.4f}")
    for name, v in res["variants"].items():
        print(f"  {name:24s} KL {v['kl']:.5f}  NLL {v['nll']:.4f}  top-1 agreement {v['top1_agree']:.4f}")
    if a.out:
        atomic_write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
