#!/usr/bin/env python3
"""What GPTQ should calibrate on: an NVFP4 checkpoint rounded by GPTQ on GSM8K training text (CPU is enough).

`model.nvfp4_calibration: gptq` calibrates on the first `model.nvfp4_calibration_samples` rows
of the prepared training split, each the prompt as the rollouts format it followed by the row's
worked solution (`qerl_lib.stages.convert.calibration_text`). This script makes the same
checkpoint through the same `qerl_lib.convert.convert` straight from the first `--n` problems of
`--data`/train.jsonl (the GSM8K prompt style `stepwise`, chat template), and with `--prompts-only`
leaves the solutions out, to measure what they are worth. Compare the outputs with
`benchmarks/nvfp4_base_fidelity.py` (on the test split).

    python benchmarks/nvfp4_gptq_calibration.py --base <BF16 checkpoint> --data <GSM8K dir> --n 128 \
        [--prompts-only] --out <checkpoint dir> --json <summaries.json>
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.nvfp4_base_fidelity import read_problems  # noqa: E402
from qerl_lib.io import atomic_write_json  # noqa: E402


def calibration(base: Path, data: Path, n: int, prompts_only: bool):
    """The first `n` training problems as GPTQ's calibration sequences, as the convert stage
    builds them from prepared rows (or the prompts alone)."""
    from transformers import AutoTokenizer

    from qerl_lib.convert import Calibration
    from qerl_lib.stages.convert import calibration_ids

    # text fields stripped as `qerl stage prepare` strips them
    rows = [{"question": p["question"].strip(), "grader": "gsm8k", "solution": None if prompts_only else p["solution"].strip()}
            for p in read_problems(data, n, "train")]
    ids = calibration_ids(AutoTokenizer.from_pretrained(str(base)), rows, "stepwise", True)
    what = "prompts" if prompts_only else "prompts and their solutions"
    return Calibration(ids, f"train.jsonl, first {len(ids)} rows, {what}")


def main(argv: list[str] | None = None) -> int:
    from qerl_lib.convert import DEFAULT_OBSERVER, convert

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, required=True, help="the 16-bit HF checkpoint (a convert stage's models/base)")
    ap.add_argument("--data", type=Path, required=True, help="a GSM8K folder holding train.jsonl")
    ap.add_argument("--n", type=int, default=128, help="training problems, from the first")
    ap.add_argument("--prompts-only", action="store_true", help="leave out each problem's worked solution")
    ap.add_argument("--observer", default=DEFAULT_OBSERVER, help="model.nvfp4_observer")
    ap.add_argument("--out", type=Path, required=True, help="the NVFP4 checkpoint directory to write")
    ap.add_argument("--json", type=Path, help="append this run's summary to the JSON list here")
    a = ap.parse_args(argv)
    cal = calibration(a.base, a.data, a.n, a.prompts_only)
    t0 = time.perf_counter()
    report = convert(a.base, a.out, "nvfp4", a.observer, cal)
    res = {"command": "python benchmarks/nvfp4_gptq_calibration.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "seconds": round(time.perf_counter() - t0, 1), "checkpoint_hash": report["checkpoint_hash"],
           "rel_error_mean": report["rel_error_mean"], "rel_error_max": report["rel_error_max"],
           "recipe": {k: v for k, v in report["recipe"].items() if k != "calibration_prompt_ids"}}
    print(json.dumps(res, indent=1))
    if a.json:
        old = json.loads(a.json.read_text()) if a.json.is_file() else []
        atomic_write_json(a.json, [*old, res])
    return 0


if __name__ == "__main__":
    sys.exit(main())
