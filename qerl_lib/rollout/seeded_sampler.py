"""Per-row seeded sampling in one launch: vLLM's `random_sample` without its loop over seeded requests.

vLLM samples each row as argmax_v(probs[v] / q[v]) with q[v] ~ Exp(1) (the exponential race: an exact
draw from the categorical distribution `probs`). qerl gives every rollout row its own seed
(`rollout.sampling`), so every request carries its own `torch.Generator`, and vLLM 0.26 fills q one
seeded row at a time, `q[i].exponential_(generator=g)` in a Python loop (its own TODO: "This can be slow
because we handle each request one by one"): one launch and a full-vocabulary write per row per
decode step, 256 launches per step at batch 256.

`seeded_race(probs, seeds, counters)` runs the race for every row in one kernel: q[i, v] = -log(u) with
u from Philox keyed by the row's seed at counter (v, counters[i]), uniform on [2**-24, 1 - 2**-24] (so q
is never 0, which would let a token of probability 0 win); each program takes the argmax of its slice
of the vocabulary, and a [B, chunks] argmax picks the row's token (ties: the smallest token id), so q
is never written to memory.

`random_sample` is the drop-in for vLLM's function (`patch_vllm`; `rollout.vllm_seeded_sampler`): a
row's seed is its generator's `initial_seed()` and its counter the generator's Philox offset / 4; the
offset then advances by 4, as `exponential_` advances it, so vLLM's rewind of a discarded token
(`set_offset(get_offset() - 4)`) still restores the state. Rows without a generator draw a fresh seed
from the device's default generator. Same distribution as stock vLLM and reproducible per (seed, step)
whatever the batch, but not the same numbers as vLLM's own generator stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl_lib.kernels.nvfp4_triton import interpreter_mode

OFFSET_STEP = 4
"""How far one `exponential_` call moves a CUDA generator's Philox offset (vLLM rewinds by this much)."""

MIN_ROWS = 16
"""Rows per step from which `random_sample` runs the one-launch race; fewer go to vLLM's loop, which is
faster there (H100, one step, host time through the result: loop 0.074 / 0.140 / 0.215 ms at 1 / 8 / 16 rows,
race 0.170 / 0.182 / 0.183 ms; `benchmarks/results/seeded_sampling_h100_2.json`)."""


@triton.jit
def _race_kernel(probs_ptr, seed_ptr, counter_ptr, val_ptr, idx_ptr, V, stride_p, CHUNK, n_chunks,
                 BLOCK: tl.constexpr):
    """Program (row, chunk): best probs / q over the row's vocabulary slice [chunk * CHUNK, +CHUNK) ->
    val [B, n_chunks] (float32), idx [B, n_chunks] (int32, the smallest id among equal scores)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    seed = tl.load(seed_ptr + row)
    counter = tl.load(counter_ptr + row).to(tl.uint32)
    lo = chunk * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    best = tl.full([BLOCK], -1.0, tl.float32)
    best_idx = tl.full([BLOCK], 0, tl.int32)
    for v0 in range(lo, hi, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        mask = cols < hi
        p = tl.load(probs_ptr + row.to(tl.int64) * stride_p + cols, mask=mask, other=0.0).to(tl.float32)
        zero = tl.zeros([BLOCK], tl.uint32)
        r, _, _, _ = tl.philox(seed, cols.to(tl.uint32), zero + counter, zero, zero)
        # 23 random bits + 1/2: u in [2**-24, 1 - 2**-24], both ends exact in float32, so q > 0
        u = ((r >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
        score = tl.where(mask, p / -tl.log(u), -1.0)
        better = score > best
        best = tl.where(better, score, best)
        best_idx = tl.where(better, cols, best_idx)
    top = tl.max(best, axis=0)
    top_idx = tl.min(tl.where(best == top, best_idx, V), axis=0)
    tl.store(val_ptr + row * n_chunks + chunk, top)
    tl.store(idx_ptr + row * n_chunks + chunk, top_idx)


def chunk_plan(rows: int, vocab: int, block: int, min_programs: int = 264) -> tuple[int, int]:
    """(chunks per row, vocabulary entries per chunk, a multiple of `block`): enough programs to fill the GPU
    (`min_programs`, two waves of 132 SMs) at small batch, one chunk of at least 8 blocks per program else."""
    chunks = max(1, min(triton.cdiv(min_programs, max(rows, 1)), triton.cdiv(vocab, 8 * block)))
    per = triton.cdiv(triton.cdiv(vocab, chunks), block) * block
    return triton.cdiv(vocab, per), per


def seeded_race(probs: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor, block: int = 1024,
                min_programs: int = 264) -> torch.Tensor:
    """Token ids int64 [B]: one exponential-race draw per row of `probs` float32 [B, V] (rows sum to 1;
    entries >= 0), noise from Philox(key = seeds[i] int64 [B], counter = (v, counters[i] int64 [B])).
    `block` and `min_programs` change how the vocabulary is cut (`chunk_plan`), never the result."""
    if probs.ndim != 2:
        raise ValueError(f"probs must be [B, V], got {tuple(probs.shape)}")
    b, v = probs.shape
    if seeds.shape != (b,) or counters.shape != (b,):
        raise ValueError(f"seeds {tuple(seeds.shape)} and counters {tuple(counters.shape)} must both be [{b}]")
    if b == 0:
        return torch.empty(0, dtype=torch.int64, device=probs.device)
    if probs.stride(-1) != 1:
        probs = probs.contiguous()
    if interpreter_mode():
        block = min(block, 64)
    n_chunks, per = chunk_plan(b, v, block, min_programs)
    val = torch.empty((b, n_chunks), dtype=torch.float32, device=probs.device)
    idx = torch.empty((b, n_chunks), dtype=torch.int32, device=probs.device)
    _race_kernel[(b, n_chunks)](probs, seeds.to(torch.int64), counters.to(torch.int64), val, idx, v, probs.stride(0),
                                per, n_chunks, BLOCK=block)
    return idx.gather(1, val.argmax(dim=1, keepdim=True)).view(-1).to(torch.int64)


def row_seeds(batch: int, generators: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(seeds int64 [batch], counters int64 [batch]) for `random_sample`, advancing every generator by one draw.

    A row with a generator: its `initial_seed()` and Philox offset / OFFSET_STEP, then offset += OFFSET_STEP.
    A row without: a seed drawn on `device` from its default generator (counter 0), so unseeded rows stay
    as random as vLLM's shared `exponential_` makes them."""
    seeds = [0] * batch
    counters = [0] * batch
    for i, g in generators.items():
        off = g.get_offset()
        seeds[i] = g.initial_seed() & 0x7FFFFFFFFFFFFFFF  # Philox keys on the 64 bits; int64 keeps them
        counters[i] = off // OFFSET_STEP
        g.set_offset(off + OFFSET_STEP)
    host = torch.tensor([seeds, counters], dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    both = host.to(device, non_blocking=True)
    if len(generators) != batch:
        free = torch.ones(batch, dtype=torch.bool)
        free[list(generators)] = False
        fresh = torch.randint(0, 2**62, (batch,), dtype=torch.int64, device=device)
        both[0] = torch.where(free.to(device, non_blocking=True), fresh, both[0])
    return both[0], both[1]


def random_sample(probs: torch.Tensor, generators: dict, use_fp64_gumbel: bool = False,
                  _stock=None) -> torch.Tensor:
    """vLLM's `random_sample(probs [B, V] float32, generators {row: torch.Generator}) -> token ids [B]`:
    one launch for every seeded row instead of one per row. Without generators (vLLM's one shared
    `exponential_` is already batched), below `MIN_ROWS` rows, with fp64 noise or off the GPU it hands
    over to vLLM's own (`_stock`, when given)."""
    if _stock is not None and (not generators or use_fp64_gumbel or not probs.is_cuda
                               or probs.shape[0] < MIN_ROWS):
        return _stock(probs, generators, use_fp64_gumbel)
    seeds, counters = row_seeds(probs.shape[0], generators, probs.device)
    return seeded_race(probs, seeds, counters)


def patch_vllm() -> bool:
    """Route vLLM's sampler (`topk_topp_sampler.random_sample`, which `forward_native` looks up at each
    call) through `random_sample`. Idempotent; False when that vLLM layout is absent (nothing patched)."""
    try:
        from vllm.v1.sample.ops import topk_topp_sampler as tts
    except ImportError:
        return False
    stock = getattr(tts, "random_sample", None)
    if stock is None:
        return False
    if getattr(stock, "_qerl_seeded", False):
        return True

    def patched(probs, generators, use_fp64_gumbel=False):
        return random_sample(probs, generators, use_fp64_gumbel, _stock=stock)

    patched._qerl_seeded = True
    tts.random_sample = patched
    return True
