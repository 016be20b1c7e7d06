"""What the rollout benchmark's engines read and hold, and when a cell still fits: pure functions, no GPU
and no vLLM (`benchmarks/rollout_throughput.py`'s docstring says what is measured and how).

- engine specs (`parse_spec`: `FMT-rR[-ds][-pdl][-rp]`);
- bytes: the Qwen2.5-7B shape's linears in each format, the LoRA slots, what one decode step reads
  (`weight_bytes_per_step`, `kv_bytes_per_step`: the weight-read bound's denominators), the fixed KV cache;
- time: how long a cell is expected to take and whether it may start (`cell_need`, `cell_deadline`, `cell_fits`);
- memory: whether engines started together (`--overlap-starts`) fit one GPU (`check_overlap_memory`).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_gemm_profile import SHAPE, kv_bytes_per_token  # noqa: E402
from benchmarks.rollout_checkpoints import linear_shapes  # noqa: E402

# ----------------------------------------------------------------------------- engine specs


def parse_spec(spec: str) -> tuple[str, int, bool, bool, bool]:
    """`FMT-rR[-ds][-pdl][-rp]` -> (format, max LoRA rank, LoRA kernels on a second CUDA stream, PDL decode
    GEMM, the decode GEMM on repacked codes)."""
    repack = spec.endswith("-rp")
    spec = spec.removesuffix("-rp")
    pdl = spec.endswith("-pdl")
    spec = spec.removesuffix("-pdl")
    dual = spec.endswith("-ds")
    fmt, rank = spec.removesuffix("-ds").split("-r")
    assert fmt in ("bf16", "nvfp4", "nvfp4h", "nvfp4g", "nf4"), spec
    assert not (pdl or repack) or fmt == "nvfp4g", f"-pdl and -rp apply to nvfp4g engines only: {spec}"
    return fmt, int(rank), dual, pdl, repack


GUESS_TOK_S = {1: 150, 8: 1150, 64: 7500, 256: 13000}
"""Decode tokens/s per batch, conservative, used only to decide whether a cell fits the time left."""


def cell_need(batch: int, trials: int, decode: int) -> float:
    """Seconds a cell is expected to take (its trials, a warm-up, 10 % margin) at `GUESS_TOK_S`."""
    return 1.1 * (trials + 0.5) * (batch * decode / GUESS_TOK_S.get(batch, 10000) + 0.5)


def cell_deadline(now: float, deadline: float, engines_after: int, startup_s: float, first_cell_s: float) -> float:
    """When an engine that is up at `now` must stop starting cells.

    Its fair share of what is left once the `engines_after` engines still to run have started (each
    taking about this engine's own `startup_s`), but at least its first cell (`first_cell_s`), and
    never past the run's `deadline`. Shares are taken when the engine is up, not when it is spawned,
    because start-up varies (49-115 s for the 7B shape) and can eat a share made before it: session
    11's three engines each got about 100 s that way and measured no cell at all.
    """
    share = (deadline - now - engines_after * startup_s) / (engines_after + 1)
    return min(deadline, now + max(share, first_cell_s))


def cell_fits(now: float, need_s: float, cell_deadline_s: float, run_deadline_s: float, first: bool) -> bool:
    """Whether a cell of `need_s` seconds starts now. An engine's first cell is held only to the run's
    deadline: its share (`cell_deadline`) promised it that cell, but the adapter load between the share and
    the cell can spend the margin (session 25: two engines up, about 190 and 50 s left, no cell measured)."""
    return now + need_s <= (run_deadline_s if first else cell_deadline_s)


# ----------------------------------------------------------------------------- byte counts


def linear_params() -> int:
    return SHAPE["layers"] * sum(n * k for n, k in linear_shapes().values())


def lora_bytes(rank: int) -> int:
    """bf16 LoRA A and B of the 7 targets in every layer at `rank` (vLLM's slots are padded to max_lora_rank)."""
    return SHAPE["layers"] * sum(rank * (n + k) * 2 for n, k in linear_shapes().values())


DENSE_BYTES_PER_WEIGHT = 2.0
NVFP4_BYTES_PER_WEIGHT = 0.5 + 1 / 16
"""Packed FP4 + one FP8 scale per 16."""
NF4_BYTES_PER_WEIGHT = 0.5 + 4 / 64
"""4-bit codes + one float32 absmax per 64 (vLLM's in-flight NF4, no double quant)."""


def linear_bytes(fmt: str) -> int:
    """Bytes of every linear weight of the model in `fmt`'s own storage (nvfp4* engines: the packed codes)."""
    per = {"bf16": DENSE_BYTES_PER_WEIGHT, "nf4": NF4_BYTES_PER_WEIGHT}.get(fmt, NVFP4_BYTES_PER_WEIGHT)
    return int(linear_params() * per)


DENSE_COPY_FORMATS = ("nvfp4h", "nvfp4g")
"""The engines that keep dense BF16 copies of their linears for steps above `--dense-above` rows."""


def reads_dense(fmt: str, batch: int, dense_above: int | None) -> bool:
    """Whether a decode step of `batch` rows reads the dense BF16 copies (adapter merged in, no LoRA slots)."""
    return fmt in DENSE_COPY_FORMATS and dense_above is not None and batch > dense_above


def weight_bytes_per_step(fmt: str, batch: int, slot_rank: int, dense_above: int | None) -> int:
    """Bytes of weights one decode step reads: linears in their format, the bf16 lm_head, LoRA slots."""
    lm_head = 2 * SHAPE["vocab"] * SHAPE["hidden"]
    return linear_bytes("bf16" if reads_dense(fmt, batch, dense_above) else fmt) + lm_head + lora_bytes(slot_rank)


def kv_bytes_per_step(batch: int, prompt: int, decode: int) -> int:
    """K and V read per decode step, at the mean context length prompt + decode / 2 (bf16)."""
    return int(batch * (prompt + decode / 2) * kv_bytes_per_token(SHAPE))


def kv_cache_bytes(max_seqs: int, max_model_len: int) -> int:
    """A fixed KV cache (vLLM's `kv_cache_memory_bytes`) for `max_seqs` sequences of `max_model_len` tokens,
    plus 10 %, at least 1 GiB. Engines started together (`--overlap-starts`) need it: vLLM sizes its cache by
    profiling the device's memory, and counts a neighbour's allocations during that window as its own
    (`rollout.vllm_kv_cache_gib`'s reason). The cache's size does not change decode speed, only room."""
    return max(2**30, int(1.1 * max_seqs * max_model_len * kv_bytes_per_token(SHAPE)))


# ----------------------------------------------------------------------------- memory of engines started together


ENGINE_OVERHEAD_BYTES = int(3.6 * 2**30)
"""What an engine holds besides weights and KV cache (CUDA context, LoRA slots, CUDA graphs, activations):
awake memory minus both in `benchmarks/results/rl_step_h100_session28.json`'s BF16 engine, 36.44 - 14.19 - 18.67 GiB."""


def engine_resident_bytes(spec: str, max_batch: int, max_model_len: int, dense_above: int | None,
                          gemv_rows: int) -> int:
    """Estimated GPU memory an engine of `spec` holds while up: its weights (linears in their format, the bf16
    embedding and lm_head), the NVFP4 engines' extra copies (dense BF16 for `nvfp4h`/`nvfp4g` when
    `dense_above` is set; the decode GEMM's packed codes for `nvfp4g` with `gemv_rows`), the fixed KV cache
    `--overlap-starts` gives it (`kv_cache_bytes`) and `ENGINE_OVERHEAD_BYTES`."""
    fmt = parse_spec(spec)[0]
    embed_and_head = 2 * 2 * SHAPE["vocab"] * SHAPE["hidden"]
    linears = linear_bytes(fmt)
    if fmt in DENSE_COPY_FORMATS and dense_above is not None:
        linears += linear_bytes("bf16")
    if fmt == "nvfp4g" and gemv_rows:
        linears += linear_bytes(fmt)
    return linears + embed_and_head + kv_cache_bytes(max_batch, max_model_len) + ENGINE_OVERHEAD_BYTES


def check_overlap_memory(specs: list[str], max_batch: int, max_model_len: int, dense_above: int | None,
                         gemv_rows: int, device_bytes: int, mem: float) -> None:
    """`--overlap-starts` keeps every engine resident at once. Refuse, before anything starts, a set whose
    estimated memory (`engine_resident_bytes`) exceeds the GPU's, or in which an engine would find less free
    memory at its start than vLLM asks of it (`mem` x the GPU, checked against the earlier engines fully
    loaded: the stagger usually gives them time), and say how much each engine holds."""
    need = {spec: engine_resident_bytes(spec, max_batch, max_model_len, dense_above, gemv_rows) for spec in specs}
    each = ", ".join(f"{spec} {b / 2**30:.1f}" for spec, b in need.items())
    why = f"({each} GiB, with a KV cache for {max_batch} rows of {max_model_len} tokens each)"
    if sum(need.values()) > device_bytes:
        raise SystemExit(f"--overlap-starts: the engines need about {sum(need.values()) / 2**30:.1f} GiB together "
                         f"{why}, the GPU has {device_bytes / 2**30:.1f}: measure the largest batches in a call of "
                         "fewer engines")
    free = device_bytes - sum(list(need.values())[:-1])
    if free < mem * device_bytes:
        raise SystemExit(f"--overlap-starts: the last engine would start with about {free / 2**30:.1f} GiB free {why}, "
                         f"less than --mem {mem} asks ({mem * device_bytes / 2**30:.1f} GiB): pass a smaller --mem")


def check_overlap(n_engines: int, mem: float) -> None:
    """`--overlap-starts` keeps every engine resident at once: their `--mem` shares must fit one GPU."""
    if n_engines * mem > 0.95:
        raise SystemExit(f"--overlap-starts: {n_engines} engines x --mem {mem} = {n_engines * mem:.2f} of the GPU; "
                         f"pass --mem {0.95 / n_engines:.2f} or less")
