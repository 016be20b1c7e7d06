"""NVFP4 W4A16 decode GEMM for 1..16 rows, hand-written CUDA (`csrc/nvfp4_gemv.cu`): the same function as
`qerl_lib.kernels.nvfp4_gemv.nvfp4_gemv` (signature, semantics, errors), built at first use.

    y [M, N] = x [M, K] @ W.T (+ bias) (+ lora_scale * (x @ A.T) @ B.T, rows masked by lora_index == lora_slot)

W = e2m1 * scale / global_scale in the compressed-tensors layout (`qerl_lib.nvfp4`).

**Kernel.** A warp owns 16 output rows (one MMA m16n8k16 tile; the x rows, padded to 8 or 16, are the
MMA's N side) and a share of K: chunks of 128 k, where each lane loads 16 bytes of codes (32 k, two
scale groups) and 2 bytes of FP8 scales per row, four chunks in flight before the first is used
(`ld.global.nc.L1::no_allocate`: codes bypass L1, which keeps x). A nibble pair becomes a bf16 (fp16)
pair with prmt, two masks and a shift (e2m1 * 2**-126), times the group's scale * 2**119 in one packed
multiply: W'' = e2m1 * fp8 * 2**-7 exactly; the K order inside a lane is permuted identically for W
and x, so x enters the MMA as its own contiguous pairs. About 29 instructions per MMA step (8
weights per lane) in the loop's full round, whatever M up to 8 (counted by benchmarks/nvfp4_gemv_sass.py). A block is WR row tiles x WK warps splitting K; the warps'
float32 accumulators are summed through shared memory in a fixed order (deterministic, no atomics,
no counters), and the epilogue applies 128 / global_scale, bias and LoRA.

**Repacked layout** (`repack_codes`, config `repacked`): at one row the kernel is bound by the SM's
integer pipe (docs/gpu.md, session 13), where the compressed-tensors decode spends four instructions
per pair of weights (PRMT, two LOP3, LEA). `repack_codes` stores each word's magnitudes and signs
apart, so that a pair takes two shifts (on the FMA pipe) and two LOP3; same bits, same MMAs, same
results. Built and checked on the CPU (host emulation; as compiled, 24.7 instructions per MMA step,
11.8 on the integer pipe, against 28.9 and 18.7); not yet timed on the GPU; the vLLM worker uses
it only under QERL_VLLM_GEMV_REPACK=1 (`qerl_lib.rollout.vllm_gemv`).

**LoRA.** Two launches, both graph-capturable: `lora_shrink_kernel` computes t [M, slices * r] =
lora_scale * mask * x @ A_s.T in float32 as partial sums over K slices of at most 4096 (one block per A
row and slice: 48 blocks for q|k|v, 80 for down), then each GEMV block sums the partials in a fixed
order into shared memory and adds B_s[row] . t[m] in its epilogue (an r-element dot per output).

**PDL** (config `pdl`, or env QERL_GEMV_PDL=1, which the vLLM engine sets unless
`rollout.vllm_gemv_pdl` is false; off when called directly): the GEMV is a programmatic dependent
launch of the kernel before it. With LoRA that is the shrink (launched normally, so x is complete):
the GEMV streams weights and x while the shrink runs and waits (`griddepcontrol.wait`) only before
its epilogue. Without LoRA it may be x's producer: each lane prefetches its first chunks into L2,
then waits before reading x. Either way the GEMV lets its own dependents launch early (a dependent
still waits for the whole grid before it reads y). Under CUDA graphs this needs the programmatic
edges of CUDA 12.3+ (tested by `-m gpu`).

**Build.** `torch.utils.cpp_extension.load` on first use (ninja + nvcc, about a minute), into
$QERL_CACHE_DIR/ext (default ~/.cache/qerl/ext) under a name hashed from the sources and flags, for
the current GPU's architecture (override: QERL_CUDA_ARCH=90). `load_extension()` raises a
RuntimeError naming nvcc, the arch and the build folder when that fails.

Tests: tests/test_nvfp4_gemv_cuda.py (CPU: `plan`, argument errors and the kernel's per-lane code
replayed on the CPU by csrc/nvfp4_gemv_host_test.cu; `-m gpu`: the GPU checks); timing: the `cuda`
and `cuda_lora` arms of benchmarks/nvfp4_gemv.py.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from qerl_lib.kernels.gemv_args import check_args, define_op

MAX_ROWS = 16
"""Largest M served (two MMA n-tiles of 8)."""
MAX_SLICES = 3
"""Most LoRA output slices (q|k|v)."""
MAX_WARPS = 16
"""Warps per block (WR x WK), as compiled."""
MAX_WARPS_PIPE2 = 8
"""Warps per block of config loop "pipe2" (its 160-171 registers exceed the 128 that 16 warps allow)."""
MAX_RANK = 64
"""Largest LoRA rank (t [M, slices * rank] is staged in shared memory)."""
MAX_CHUNKS_PER_WARP = 20
"""`plan` splits K over more warps rather than give one warp more chunks of 128 k than this (unless no
split can). Measured on the H200, 7B gate|up at 1 row (28 chunks, equal score): one warp per block
1.110 ms, two 1.002 ms, down's 8 warps x 18.5 chunks its best (0.610: nvfp4_gemv_session10.json's
sweep); with this rule the plan runs gate|up in 1.004 ms (benchmarks/results/nvfp4_gemv.json)."""
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("nvfp4_gemv.cu", "nvfp4_gemv_bind.cpp")
HEADERS = ("nvfp4_gemv.h", "nvfp4_gemv.cuh")
PDL_ENV = "QERL_GEMV_PDL"
LOOPS = ("rounds", "ring", "pipe", "pipe2")
"""The K loops of config `loop` (repacked codes only), in the kernel's numbering (csrc/nvfp4_gemv.h kRounds..):
round by round (the default), the ring, and the pipe with sets of U / 2 or U chunks (nvfp4_gemv.cu)."""

_EXT = None
_SMS: dict[int, int] = {}
_REGS: dict[tuple, int] = {}


def cache_dir() -> Path:
    """$QERL_CACHE_DIR/ext, else ~/.cache/qerl/ext."""
    root = os.environ.get("QERL_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "qerl") / "ext"


def _arch() -> str:
    env = os.environ.get("QERL_CUDA_ARCH", "").strip().replace(".", "")
    if env:
        return env
    major, minor = torch.cuda.get_device_capability()
    return f"{major}{minor}"


def build_flags(arch: str) -> tuple[list[str], list[str]]:
    """(nvcc flags, host compiler flags) for sm_`arch` (machine code, plus PTX for newer GPUs)."""
    cuda = ["-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}",
            f"-gencode=arch=compute_{arch},code=compute_{arch}", "-Xptxas=-warn-spills", "-lineinfo"]
    return cuda, ["-O3"]  # the host compiler keeps torch's own -std


def load_extension(verbose: bool | None = None):
    """The compiled extension (built once per process, cached on disk across processes)."""
    global _EXT
    if _EXT is not None:
        return _EXT
    if not torch.cuda.is_available():
        raise RuntimeError("nvfp4_gemv_cuda needs a CUDA GPU and a CUDA build of torch (nvcc compiles "
                           f"csrc/{SOURCES[0]} at first use); torch {torch.__version__} sees none")
    from torch.utils import cpp_extension

    arch = _arch()
    cuda_flags, cflags = build_flags(arch)
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update((CSRC / name).read_bytes())
    digest.update(" ".join(cuda_flags + cflags + [torch.__version__, str(torch.version.cuda)]).encode())
    name = f"qerl_nvfp4_gemv_{digest.hexdigest()[:12]}"
    build = cache_dir() / name
    build.mkdir(parents=True, exist_ok=True)
    if verbose is None:
        verbose = os.environ.get("QERL_EXT_VERBOSE", "") not in ("", "0")
    try:
        _EXT = cpp_extension.load(name=name, sources=[str(CSRC / s) for s in SOURCES],
                                  extra_include_paths=[str(CSRC)], extra_cuda_cflags=cuda_flags,
                                  extra_cflags=cflags, build_directory=str(build), verbose=verbose)
    except Exception as e:  # noqa: BLE001 - any build failure gets the same explanation
        raise RuntimeError(
            f"nvfp4_gemv_cuda: building the CUDA extension failed (nvcc from CUDA_HOME="
            f"{cpp_extension.CUDA_HOME}, arch sm_{arch}, build folder {build}; needs ninja and nvcc matching "
            f"torch's CUDA {torch.version.cuda}; QERL_CUDA_ARCH overrides the arch, QERL_EXT_VERBOSE=1 shows "
            f"the compiler's output): {type(e).__name__}: {e}") from e
    return _EXT


def available() -> bool:
    """Whether the extension is (or can be) built here; never raises."""
    try:
        load_extension()
        return True
    except Exception:  # noqa: BLE001
        return False


def _num_sms(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def kernel_regs(bf16: bool, mt: int, aligned: bool, repacked: bool = False, loop: str = "rounds") -> int:
    """Registers per thread of a compiled GEMV variant (the occupancy input of `plan`); `loop` one of `LOOPS`."""
    key = (bf16, mt, aligned, repacked, loop)
    if key not in _REGS:
        _REGS[key] = int(load_extension().kernel_regs(bf16, mt, aligned, repacked, LOOPS.index(loop)))
    return _REGS[key]


def loop_max_warps(loop: str) -> int:
    """Warps per block the compiled K loop `loop` allows (its launch bound)."""
    return MAX_WARPS_PIPE2 if loop == "pipe2" else MAX_WARPS


def loop_of(config: dict | None) -> str:
    """The K loop a `config` asks for: its `loop` (one of `LOOPS`), or "ring" for the older `ring: True`."""
    config = config or {}
    loop = config.get("loop", "ring" if config.get("ring") else "rounds")
    if loop not in LOOPS:
        raise ValueError(f"nvfp4_gemv_cuda: config loop must be one of {LOOPS}, got {loop!r}")
    return loop


def _check_code_words(codes: torch.Tensor, who: str) -> None:
    """Both layouts' codes: uint8 [N, K/2] in whole 4-byte words (8 codes)."""
    if codes.dtype != torch.uint8 or codes.dim() != 2 or codes.shape[1] % 4:
        raise ValueError(f"{who}: expected uint8 [N, K/2] with K/2 a multiple of 4 (K % 8 == 0), got "
                         f"{codes.dtype} {tuple(codes.shape)}")


def repack_codes(packed: torch.Tensor, rows_per_step: int = 4096) -> torch.Tensor:
    """The codes of `packed` uint8 [N, K/2] (compressed-tensors: byte p of each 4-byte word holds codes
    2p (low nibble) and 2p + 1) in the repacked layout the kernel decodes with fewer integer
    instructions (`nvfp4_gemv(..., config={"repacked": True})`; csrc/nvfp4_gemv.cuh `repack_word`):
    per word, magnitudes of the even codes at bits 3p..3p+2, their signs at 12 + p, magnitudes of the
    odd codes at 16 + 3p.., their signs at 28 + p. Same shape, dtype and device; a bijection, done on
    the tensor's device `rows_per_step` rows at a time (int64 temporaries: 16 bytes per code byte)."""
    _check_code_words(packed, "repack_codes")
    out = torch.empty_like(packed, memory_format=torch.contiguous_format)
    p = torch.arange(4, device=packed.device, dtype=torch.int64)
    for r0 in range(0, packed.shape[0], rows_per_step):
        b = packed[r0:r0 + rows_per_step].reshape(-1, packed.shape[1] // 4, 4).to(torch.int64)
        lo, hi = b & 15, b >> 4
        word = (((lo & 7) << (3 * p)) | ((lo >> 3) << (12 + p)) | ((hi & 7) << (16 + 3 * p))
                | ((hi >> 3) << (28 + p))).sum(-1)  # the fields are disjoint: sum == or
        parts = torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], -1).to(torch.uint8)
        out[r0:r0 + rows_per_step] = parts.reshape(-1, packed.shape[1])
    return out


def unrepack_codes(repacked: torch.Tensor, rows_per_step: int = 4096) -> torch.Tensor:
    """The inverse of `repack_codes`: codes in compressed-tensors' layout again (same shape and device)."""
    _check_code_words(repacked, "unrepack_codes")
    out = torch.empty_like(repacked, memory_format=torch.contiguous_format)
    p = torch.arange(4, device=repacked.device, dtype=torch.int64)
    shifts = 8 * torch.arange(4, device=repacked.device, dtype=torch.int64)
    for r0 in range(0, repacked.shape[0], rows_per_step):
        b = repacked[r0:r0 + rows_per_step].reshape(-1, repacked.shape[1] // 4, 4).to(torch.int64)
        word = (b << shifts).sum(-1, keepdim=True)  # [rows, K/8, 1], bytes little-endian
        lo = ((word >> (3 * p)) & 7) | (((word >> (12 + p)) & 1) << 3)
        hi = ((word >> (16 + 3 * p)) & 7) | (((word >> (28 + p)) & 1) << 3)
        out[r0:r0 + rows_per_step] = (lo | (hi << 4)).to(torch.uint8).reshape(-1, repacked.shape[1])
    return out


def plan(m: int, n: int, k: int, num_sms: int = 132, regs: int = 112, max_warps: int = MAX_WARPS) -> dict:
    """Launch configuration of an M x N x K call (memoised); `config` of `nvfp4_gemv` overrides it.

    WR = 1 row tile (16 rows) per block; WK warps split K (chunks of 128 k, dealt round-robin). The
    choice of WK in (16, 8, 4, 2, 1), at most the chunk count: blocks of 32 WK threads at `regs`
    registers fit `per_sm` = min(2048 / threads, 65536 / (threads * regs)) to an SM; score =
    balance * saturation, where balance is (blocks per SM) / ceil(blocks per SM) (of the slots when
    there are several waves: their fill), and saturation min(1, resident warps per SM / 8) (8 warps
    keep about 32 KB of codes in flight per SM, the latency-bandwidth product); ties go to fewer
    waves, then more warps per block (fewer chunks per warp: all its loads in one round). A WK that
    leaves a warp more than `MAX_CHUNKS_PER_WARP` chunks is taken only when no WK passes. On the 7B
    shapes at M <= 8 and 112 registers: q|k|v 4, o 8, gate|up 2 (two waves of 9 two-warp blocks per
    SM; one warp would loop over all 28 chunks), down 8. MT = n-tiles of 8 x rows; U = chunks in flight.
    WK is at most `max_warps` (the compiled block limit of the variant).
    """
    return dict(_plan(m, n, k, num_sms, regs, max_warps))


@functools.lru_cache(maxsize=4096)
def _plan(m: int, n: int, k: int, num_sms: int, regs: int, max_warps: int = MAX_WARPS) -> tuple:
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"nvfp4_gemv_cuda serves 1 to {MAX_ROWS} rows, got {m}")
    tiles = math.ceil(n / 16)
    chunks = math.ceil(k / 128)
    regs_alloc = max(8, math.ceil(regs / 8) * 8)
    best = None
    for wk in (16, 8, 4, 2, 1):
        if wk > max(1, chunks) or wk > max_warps:
            continue
        threads = 32 * wk
        per_sm = min(2048 // threads, 65536 // (threads * regs_alloc), 32)
        if per_sm < 1:
            continue
        slots = per_sm * num_sms
        waves = math.ceil(tiles / slots)
        if waves > 1:
            balance = tiles / (waves * slots)
        else:
            balance = (tiles / num_sms) / math.ceil(tiles / num_sms)
        resident = min(per_sm, math.ceil(tiles / num_sms)) * wk
        score = round(balance * min(1.0, resident / 8), 3)
        key = (math.ceil(chunks / wk) <= MAX_CHUNKS_PER_WARP, score, -waves, wk)
        if best is None or key > best[0]:
            best = (key, dict(WR=1, WK=wk, threads=threads, blocks=tiles, waves=waves, score=score))
    cfg = best[1]
    cfg["MT"] = 1 if m <= 8 else 2
    cfg["U"] = 4 if m <= 8 else 2
    return tuple(sorted(cfg.items()))


def _aligned16(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0


def nvfp4_gemv(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    lora_a: torch.Tensor | Sequence[torch.Tensor] | None = None,
    lora_b: torch.Tensor | Sequence[torch.Tensor] | None = None,
    lora_scale: float = 1.0,
    lora_index: torch.Tensor | None = None,
    lora_slot: int = 0,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W.T (+ bias) (+ lora_scale * (x @ A.T) @ B.T) in x.dtype (CUDA kernel).

    Arguments as `qerl_lib.kernels.nvfp4_gemv.nvfp4_gemv`, with at most `MAX_ROWS` rows:
    - x: bf16 or fp16 [..., K]; packed: uint8 [N, K/2] (low nibble = even k); scale: float8_e4m3fn (or its
      uint8 view) [N, K/16]; global_scale: float32 [1] or [N]; K % 16 == 0;
    - bias: [N] (float32, bf16 or fp16; other dtypes are cast to float32) or None, added in float32;
    - lora_a: [r, K] or up to 3 slices; lora_b: [N, r] or one [n_i, r] per slice, sum(n_i) = N; x.dtype;
    - lora_index: integer [>= M]: row m gets the LoRA term only if lora_index[m] == lora_slot.
    `config` overrides `plan`: WR (row tiles per block), WK (warps splitting K), pdl (bool); and
    `repacked` (bool, default false) says that `packed` holds `repack_codes(packed)` (same results bit for
    bit, fewer decode instructions: docs/kernels.md). `loop` (repacked only; one of `LOOPS`, default "rounds")
    picks the K loop: "ring" keeps U chunks' loads in flight all the time (`ring: True` says the same; measured
    slower, docs/gpu.md), "pipe" / "pipe2" compute one set of U / 2 (U) chunks while the next set loads
    (csrc/nvfp4_gemv.cu `pipe_loop`; measured slower too). Every loop gives the same results bit for bit at the
    same WK; pipe2 runs blocks of at most `MAX_WARPS_PIPE2` warps.
    """
    args = check_args("nvfp4_gemv_cuda", x, packed, scale, global_scale, bias, lora_a, lora_b, lora_index,
                      max_rows=MAX_ROWS, max_slices=MAX_SLICES, max_rank=MAX_RANK)
    lead, k, x2, m, n, scale = args.lead, args.k, args.x2, args.m, args.n, args.scale
    a_list, b_list = args.a_list, args.b_list
    if not x.is_cuda:
        raise RuntimeError("nvfp4_gemv_cuda runs on CUDA tensors only (qerl_lib.kernels.nvfp4_gemv has the "
                           "Triton kernel, whose interpreter runs on the CPU)")
    if m == 0 or n == 0:
        return torch.empty((*lead, n), dtype=x.dtype, device=x.device)

    # layouts the kernel reads with vector loads: copies only for unusual strides or offsets
    if x2.stride(-1) != 1 or not _aligned16(x2):
        x2 = x2.contiguous() if _aligned16(x2.contiguous()) else x2.clone(memory_format=torch.contiguous_format)
    if packed.stride(-1) != 1 or packed.data_ptr() % 8 or packed.stride(0) % 8:
        packed = packed.clone(memory_format=torch.contiguous_format)
    if scale.stride(-1) != 1:
        scale = scale.contiguous()
    aligned = (_aligned16(packed) and scale.data_ptr() % 2 == 0 and scale.stride(0) % 2 == 0)
    gs = global_scale.reshape(-1).to(device=x.device, dtype=torch.float32).contiguous()
    if bias is not None:
        bias = bias.reshape(-1)
        if bias.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            bias = bias.float()
        bias = bias.contiguous()
    a_list = [a if _aligned16(a) else a.clone(memory_format=torch.contiguous_format) for a in a_list]
    idx = None
    if a_list and lora_index is not None:
        idx = lora_index.reshape(-1)
        if idx.dtype not in (torch.int32, torch.int64) or not idx.is_contiguous():
            idx = idx.to(torch.int64).contiguous()
        if idx.device != x.device:
            raise ValueError("lora_index must be on x's device")

    with torch.cuda.device(x.device):
        ext = load_extension()
        repacked = bool((config or {}).get("repacked", False))
        loop = loop_of(config) if repacked else "rounds"
        warps = loop_max_warps(loop)
        if config is None or "WK" not in config:
            cfg = plan(m, n, k, _num_sms(x.device),
                       kernel_regs(x.dtype == torch.bfloat16, 1 if m <= 8 else 2, aligned, repacked, loop), warps)
        else:
            cfg = {}
        cfg.update(config or {})
        wr, wk = int(cfg.get("WR", 1)), int(cfg["WK"])
        if wr < 1 or wk < 1 or wr * wk > warps:
            raise ValueError(f"config WR={wr} x WK={wk} must be 1..{warps} warps (loop {loop})")
        pdl = bool(cfg.get("pdl", os.environ.get(PDL_ENV, "") not in ("", "0")))
        y = ext.gemv(x2, packed, scale, gs, bias, a_list, b_list, float(lora_scale), idx, int(lora_slot),
                     wr, wk, aligned, pdl, repacked, LOOPS.index(loop))
    return y.reshape(*lead, n)


def register_op():
    """`torch.ops.qerl.nvfp4_gemv_cuda` (defined once; `gemv_args.define_op`)."""
    return _op()


@functools.cache
def _op():
    return define_op("nvfp4_gemv_cuda", nvfp4_gemv)
