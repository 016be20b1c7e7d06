"""RMSNorm weight magnitudes of the AQN targets, per model: what an absolute sigma means there.

For each model: `qerl_lib.aqn.norm_magnitudes` of its input_layernorm / post_attention_layernorm
weights (mean |w|, RMS, min, max, median |w|, share of |w| < 0.05, smallest / largest RMS of one
layer), and the relative size of the paper's schedule end points, sigma / RMS and the median over
elements of sigma / |w_i| (the multiplicative noise an absolute sigma puts on the linear that
follows the norm; `aqn.sigma_mode: relative` makes it sigma on every element).

    nice -n 10 .venv/bin/python benchmarks/norm_magnitudes.py

Models: `smollm2` (SmolLM2-135M-Instruct, the default) and `qwen2.5-coder-0.5b` by default,
loaded from their GGUF files (dequantized, float32; norm weights are stored as F32 in both files,
so the values are exact). Writes benchmarks/results/norm_magnitudes.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIGMAS = (1e-2, 5e-4)  # the paper's sigma_start and sigma_end (the config defaults)


@torch.no_grad()
def relative_size(model, sigma: float) -> dict[str, float]:
    """sigma / RMS of all targets pooled, and the median over elements of sigma / |w_i|."""
    from qerl_lib.aqn import aqn_norms

    w = torch.cat([m.weight.detach().float().cpu() for _, m in aqn_norms(model)])
    return {"sigma_over_rms": sigma / float(w.pow(2).mean().sqrt()),
            "median_sigma_over_abs_w": float((sigma / w.abs().clamp_min(1e-12)).median())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "qwen2.5-coder-0.5b"])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/norm_magnitudes.json"))
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from qerl_lib.aqn import norm_magnitudes
    from qerl_lib.model import resolve_source

    result = {"command": "nice -n 10 .venv/bin/python benchmarks/norm_magnitudes.py"
                         + (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else ""),
              "sigmas": list(SIGMAS), "models": {}}
    for name in args.models:
        location, gguf = resolve_source(name)
        t0 = time.perf_counter()
        kwargs = {"gguf_file": gguf} if gguf else {}
        model = AutoModelForCausalLM.from_pretrained(location, dtype=torch.float32, **kwargs)
        stats = norm_magnitudes(model)
        entry = {"source": str(Path(location) / gguf) if gguf else location,
                 "hidden_size": model.config.hidden_size, "layers": model.config.num_hidden_layers,
                 "load_seconds": round(time.perf_counter() - t0, 1), "stats": stats,
                 "relative_size": {str(s): relative_size(model, s) for s in SIGMAS}}
        result["models"][name] = entry
        a = stats["all"]
        print(f"{name}: mean|w| {a['mean_abs']:.4f} rms {a['rms']:.4f} min {a['min']:.4f} max {a['max']:.4f} "
              f"median|w| {a['median_abs']:.4f} |w|<0.05: {a['share_abs_below_0.05']:.3f}; "
              + "; ".join(f"sigma {s:g}: {v['sigma_over_rms']:.2%} of rms, median sigma/|w| "
                          f"{v['median_sigma_over_abs_w']:.2%}" for s, v in
                          ((float(k), v) for k, v in entry["relative_size"].items())), flush=True)
        for kind in ("input_layernorm", "post_attention_layernorm"):
            s = stats[kind]
            print(f"  {kind}: mean|w| {s['mean_abs']:.4f} rms {s['rms']:.4f} [{s['min']:.4f}, {s['max']:.4f}] "
                  f"layer rms {s['layer_rms_min']:.4f}..{s['layer_rms_max']:.4f}", flush=True)
        del model
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
