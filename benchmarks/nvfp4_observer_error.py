#!/usr/bin/env python3
"""How much quantization error each NVFP4 weight observer leaves, on a real checkpoint (CPU is enough).

`convert` picks each 16-weight group's FP8 scale with llm-compressor's weight observer
(`model.nvfp4_observer`). This quantizes the linears of a few decoder layers of a plain HF
checkpoint with each observer, through the same `oneshot` call and recipe as `convert`
(`qerl_lib.convert.nvfp4_recipe`, its targets narrowed to those layers: the MSE searches take minutes
per layer on a CPU), and reports per linear the relative Frobenius error ||W - deq(q(W))|| / ||W||
with the project's own dequantization (`qerl_lib.convert.quantization_errors`, the figure the convert
report gives), and each observer's mean over the linears as a ratio to min-max's.

    python benchmarks/nvfp4_observer_error.py --base <models/base of a Qwen workspace> --layers 0,12,23 \
        --out benchmarks/results/nvfp4_observer_error_qwen05.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qerl_lib.io import atomic_write_json  # noqa: E402

OBSERVERS = ["memoryless_minmax", "memoryless_mse", "nvfp4_expanded_mse"]


def measure(base: Path, layers: list[int], observer: str) -> tuple[dict[str, float], float]:
    """(relative error per quantized linear, seconds of the oneshot call) for one observer."""
    import torch
    from llmcompressor import oneshot
    from llmcompressor.core import reset_session
    from transformers import AutoModelForCausalLM

    from qerl_lib.convert import _quiet_llmcompressor, nvfp4_recipe, quantization_errors

    pattern = "re:.*layers\\.(" + "|".join(str(i) for i in layers) + ")\\..*_proj$"
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.bfloat16)
    with _quiet_llmcompressor(), tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        try:
            oneshot(model=model, recipe=nvfp4_recipe(observer, targets=pattern))
            seconds = time.perf_counter() - t0
            model.save_pretrained(tmp, save_compressed=True)
        finally:
            reset_session()
        errors = quantization_errors(base, Path(tmp))
    if not errors:
        raise SystemExit(f"{base}: no linear matched {pattern!r} (layers {layers})")
    return errors, seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, required=True, help="a plain HF checkpoint directory (e.g. models/base)")
    ap.add_argument("--layers", default="0,12,23", help="decoder layers whose linears are quantized")
    ap.add_argument("--observers", default=",".join(OBSERVERS), help="llm-compressor weight observers to compare")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    a = ap.parse_args(argv)
    if not (a.base / "config.json").is_file():
        raise SystemExit(f"--base {a.base}: no config.json (a plain HF checkpoint directory is needed)")
    layers = [int(x) for x in a.layers.split(",")]
    observers = a.observers.split(",")
    res = {"command": "python benchmarks/nvfp4_observer_error.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "host": platform.node(), "layers": layers, "observers": {}}
    for obs in observers:
        errors, seconds = measure(a.base, layers, obs)
        res["observers"][obs] = {"seconds": round(seconds, 1), "linears": len(errors),
                                 "rel_error_mean": statistics.fmean(errors.values()),
                                 "rel_error_max": max(errors.values()), "rel_error": errors}
        print(f"{obs:20s} {len(errors)} linears  mean rel. error {res['observers'][obs]['rel_error_mean']:.5f}  "
              f"max {res['observers'][obs]['rel_error_max']:.5f}  ({seconds:.0f} s)", flush=True)
    ref = res["observers"].get("memoryless_minmax")
    if ref:
        for obs, r in res["observers"].items():
            r["mean_over_minmax"] = round(r["rel_error_mean"] / ref["rel_error_mean"], 4)
            r["linears_better_than_minmax"] = sum(r["rel_error"][k] < ref["rel_error"][k] for k in r["rel_error"])
        print("mean error / min-max's: " + ", ".join(f"{o} {r['mean_over_minmax']}" for o, r in res["observers"].items()))
    if a.out:
        atomic_write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
