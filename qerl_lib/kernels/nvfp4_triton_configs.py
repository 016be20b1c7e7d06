"""The tile configurations the NVFP4 Triton GEMMs (`qerl_lib.kernels.nvfp4_triton`) autotune over,
and how they are pruned: by an M bucket (the token count rounded up to a power of two, at least 16),
into decode-like, middle and prefill sets. Measurements behind the lists: docs/kernels.md."""

from __future__ import annotations

import triton


def _cfg(bm, bn, bk, warps, stages, group_m=8):
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m}, num_warps=warps, num_stages=stages
    )


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages). BLOCK_M tiles tokens (the MMA's N side, at
# most 256); in the forward BLOCK_N tiles output features and BLOCK_K the reduction, in the
# input-gradient kernel BLOCK_N tiles the reduction (W's rows) and BLOCK_K the output
# (W's columns). The dequantized W tile is the MMA's M side: 64 rows per warpgroup.
FWD_CONFIGS = [
    # decode-like (M <= 32): memory-bound on W
    _cfg(16, 64, 256, 4, 4), _cfg(16, 128, 128, 4, 4), _cfg(32, 64, 256, 4, 4), _cfg(32, 128, 128, 4, 3),
    # middle (32 < M <= 256)
    _cfg(64, 128, 128, 4, 3), _cfg(128, 128, 64, 8, 3), _cfg(128, 64, 128, 4, 3), _cfg(256, 64, 64, 4, 3),
    # prefill / training (M > 256): 256 tokens per tile so that each dequantized W element
    # feeds 256 MMA columns. The one-warpgroup configurations fit two CTAs per SM (registers
    # and shared memory), so one CTA's dequantization can overlap the other's MMAs.
    _cfg(256, 128, 64, 8, 3), _cfg(256, 128, 64, 8, 4), _cfg(256, 64, 64, 4, 2), _cfg(256, 64, 32, 4, 3),
    _cfg(256, 64, 32, 4, 4),
]
GRAD_CONFIGS = [
    _cfg(16, 64, 256, 4, 4), _cfg(16, 128, 128, 4, 4), _cfg(32, 64, 256, 4, 4), _cfg(32, 128, 128, 4, 3),
    _cfg(64, 128, 128, 4, 3), _cfg(128, 64, 128, 8, 3), _cfg(128, 128, 64, 4, 3), _cfg(256, 64, 64, 4, 3),
    _cfg(256, 64, 128, 8, 3), _cfg(256, 64, 128, 8, 4), _cfg(256, 64, 64, 4, 2), _cfg(256, 32, 64, 4, 3),
    _cfg(256, 32, 64, 4, 4),
]
_REGIMES = ((32, 0, 4), (256, 4, 8), (None, 8, 13))  # (max M bucket, first, end) into the lists


def _prune(configs, named_args, **kwargs):
    m = named_args["M_BUCKET"]
    for limit, lo, hi in _REGIMES:
        if limit is None or m <= limit:
            return configs[lo:hi]
    return configs


def _bench(fn, quantiles=None):
    # shorter than Triton's default (25 ms warm-up, 100 ms): tuning happens inside training steps
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


# The dequantization kernel is a copy with arithmetic: bigger tiles mean longer contiguous rows of
# packed bytes and of bf16 output per program.
DQ_CONFIGS = [triton.Config({"BLOCK_R": r, "BLOCK_K": k}, num_warps=w)
              for r, k, w in ((16, 64, 4), (32, 128, 4), (64, 128, 4), (32, 256, 4), (64, 256, 8), (128, 128, 8))]

# what runs when the autotuner is bypassed (interpreter, or an explicit `config`)
INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}
