#!/usr/bin/env python3
"""Per-row seeded sampling, one decode step: vLLM's loop against `qerl_lib.rollout.seeded_sampler`.

Every qerl rollout row has its own seed, so vLLM 0.26 samples each step as `random_sample(probs,
generators)` with one generator per row: a Python loop of `q[i].exponential_(generator=g)`, then
`probs / q` and an argmax. The project's replacement draws every row's noise in one kernel
(`seeded_race`). This times one step of each for B rows of a Qwen2.5 vocabulary (152,064), float32 probs:

- `wall_ms`: host time of the call through `torch.cuda.synchronize()`, on an idle GPU, median of `--reps`;
- `gpu_ms`: CUDA-event time of the same call. On an idle GPU the kernels wait for the host's launches, so
  this is close to `wall_ms` when the launches are the bottleneck;
- `behind_gpu_ms`: CUDA-event time of the call queued behind `--behind-ms` of GPU work
  (`torch.cuda._sleep`), as a decode step's sampler is queued behind its forward pass. The host's launches
  then run ahead and the events time only the GPU's own execution: the part of the call a step cannot
  hide when its host runs ahead;
- `host_ms`: how long the call held the host in that run (returned before the GPU ran it).

It also checks the replacement's draws against the distribution: `--draws` draws of one row whose
probabilities are spread over 64 tokens, compared with the expected counts (chi-square statistic, 63
degrees of freedom: about 63 +- 11 when right), and that a row's token depends only on (seed, offset),
not on its place in the batch. vLLM is used when it imports; without it the loop is the same code
written here (`stock_random_sample`).

    python benchmarks/seeded_sampling.py --out $OUT/seeded_sampling.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qerl_lib.io import atomic_write_json  # noqa: E402

VOCAB = 152064


def stock_random_sample(probs, generators, use_fp64_gumbel=False):
    """vLLM 0.26's `topk_topp_sampler.random_sample`, for machines without vLLM."""
    import torch

    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.exponential_()
    for i, g in generators.items():
        q[i].exponential_(generator=g)
    return probs.div_(q).argmax(dim=-1).view(-1)


def main() -> None:
    import torch

    from qerl_lib.rollout.seeded_sampler import random_sample

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--draws", type=int, default=20000)
    p.add_argument("--behind-ms", type=float, default=20.0, help="GPU work queued before each `behind` call")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/seeded_sampling.json"))
    args = p.parse_args()
    try:
        from vllm.v1.sample.ops.topk_topp_sampler import random_sample as stock
        stock_name = "vllm.v1.sample.ops.topk_topp_sampler.random_sample"
    except ImportError:
        stock, stock_name = stock_random_sample, "stock_random_sample (vLLM not importable)"
    dev = torch.device("cuda")
    res = {"command": "python " + " ".join([sys.argv[0]] + sys.argv[1:]), "device": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "stock": stock_name, "vocab": VOCAB, "behind_ms": args.behind_ms, "table": []}

    def gens(b, seed0):
        return {i: torch.Generator(device=dev).manual_seed(seed0 + i) for i in range(b)}

    def sleep_cycles(ms: float) -> int:  # torch.cuda._sleep spins for clock cycles: calibrate once
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        torch.cuda._sleep(10**7)
        e1.record()
        torch.cuda.synchronize()
        return int(10**7 * ms / e0.elapsed_time(e1))

    cycles = sleep_cycles(args.behind_ms)

    def timed(fn, b):
        logits = torch.randn(b, VOCAB, device=dev)
        out = {"wall_ms": [], "gpu_ms": [], "behind_gpu_ms": [], "host_ms": []}
        for rep in range(args.reps + 3):
            for behind in (False, True):
                probs = logits.softmax(dim=-1)  # both functions may write probs in place
                g = gens(b, 1000 * rep)
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if behind:
                    torch.cuda._sleep(cycles)
                t0 = time.perf_counter()
                e0.record()
                fn(probs, g)
                e1.record()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                if rep < 3:
                    continue
                if behind:
                    out["behind_gpu_ms"].append(e0.elapsed_time(e1))
                    out["host_ms"].append((t1 - t0) * 1e3)
                else:
                    out["wall_ms"].append((time.perf_counter() - t0) * 1e3)
                    out["gpu_ms"].append(e0.elapsed_time(e1))
        return {k: round(statistics.median(v), 4) for k, v in out.items()}

    for b in [int(x) for x in args.batches.split(",")]:
        row = {"batch": b, "stock": timed(stock, b), "qerl": timed(random_sample, b)}
        row["wall_ratio"] = round(row["stock"]["wall_ms"] / row["qerl"]["wall_ms"], 2)
        row["behind_ratio"] = round(row["stock"]["behind_gpu_ms"] / row["qerl"]["behind_gpu_ms"], 2)
        res["table"].append(row)
        print(row, flush=True)

    # distribution: one row, 64 tokens of probabilities 1..64 (normalized), the rest 0
    probs = torch.zeros(1, VOCAB, device=dev)
    probs[0, :64] = torch.arange(1, 65, device=dev, dtype=torch.float32)
    probs /= probs.sum()
    g = torch.Generator(device=dev).manual_seed(7)
    counts = torch.zeros(VOCAB, device=dev)
    for _ in range(args.draws):
        counts[random_sample(probs.clone(), {0: g})] += 1
    expected = probs[0, :64] * args.draws
    res["chi_square_64"] = round(float(((counts[:64] - expected) ** 2 / expected).sum()), 2)
    res["draws_outside_support"] = int(counts[64:].sum())
    res["generator_offset_after"] = g.get_offset()
    # a row's draw depends on (seed, offset), not on its batch position
    logits = torch.randn(4, VOCAB, device=dev).softmax(dim=-1)
    a = random_sample(logits.clone(), gens(4, 11))
    perm = [3, 1, 0, 2]
    gp = gens(4, 11)
    b_ = random_sample(logits[perm].clone(), {j: gp[i] for j, i in enumerate(perm)})
    res["batch_position_independent"] = bool(torch.equal(a[perm], b_))
    print({k: res[k] for k in ("chi_square_64", "draws_outside_support", "batch_position_independent")}, flush=True)
    atomic_write_json(Path(args.out), res)


if __name__ == "__main__":
    main()
