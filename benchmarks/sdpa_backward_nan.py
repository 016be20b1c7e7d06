"""Why the trainer keeps SDPA off cuDNN on CUDA (`qerl_lib.trainer.training_attention`).

Runs the attention of one SmolLM2-135M layer shape (9 query heads, head dim 64, bf16) forward and
backward on left-padded batches, the layout the trainer builds (prompt left-padded to P, completion
right-padded to Tc, so the first pad positions of a short prompt attend to nothing), at widths
L = P + Tc around multiples of 64, under two backend choices:

- `default`:  whatever SDPA picks with a boolean mask (cuDNN on H100/H200 with torch 2.11);
- `training`: the trainer's context (flash / memory-efficient / math, no cuDNN).

Prints and writes JSON: per (choice, L), the count of non-finite entries in dq, dk, dv, and the
backend choice's time per forward+backward (median of 20). pytorch/pytorch#196678 predicts NaN dq
under `default` exactly at L % 128 == 64.

    python benchmarks/sdpa_backward_nan.py --out benchmarks/results/sdpa_backward_nan.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys


def run(widths: list[int], batch: int = 16, heads: int = 9, head_dim: int = 64, pad: int = 5) -> dict:
    import torch
    import torch.nn.functional as F

    from qerl_lib.trainer import training_attention

    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "batch": batch, "heads": heads, "head_dim": head_dim,
           "left_pad_of_short_rows": pad, "cells": []}
    for L in widths:
        g = torch.Generator(device="cuda").manual_seed(L)
        base = [torch.randn(batch, heads, L, head_dim, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3)]
        grad_out = torch.randn(batch, heads, L, head_dim, device=dev, dtype=torch.bfloat16, generator=g)
        mask = torch.ones(L, L, dtype=torch.bool, device=dev).tril().expand(batch, 1, L, L).clone()
        mask[batch // 2:, :, :, :pad] = False  # half the rows are left-padded
        for choice, ctx in (("default", contextlib.nullcontext), ("training", lambda: training_attention(dev))):
            def step():
                q, k, v = (t.clone().requires_grad_() for t in base)
                with ctx():
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                    o.backward(grad_out)
                return q, k, v
            q, k, v = step()
            bad = {n: int((~torch.isfinite(t.grad)).sum()) for n, t in zip("qkv", (q, k, v))}
            times = []
            for _ in range(20):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                step()
                e.record()
                torch.cuda.synchronize()
                times.append(s.elapsed_time(e))
            cell = {"choice": choice, "L": L, "nonfinite_dq": bad["q"], "nonfinite_dk": bad["k"],
                    "nonfinite_dv": bad["v"], "ms_fwd_bwd_median": round(statistics.median(times), 4)}
            out["cells"].append(cell)
            print(json.dumps(cell), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[63, 64, 65, 96, 128, 192, 256, 320])
    ap.add_argument("--out", default=None, help="JSON results file")
    args = ap.parse_args()
    res = {"command": "python " + " ".join(sys.argv), **run(args.widths)}
    if args.out:
        from qerl_lib.io import atomic_write_json

        atomic_write_json(args.out, res)


if __name__ == "__main__":
    main()
