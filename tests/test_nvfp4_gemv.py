"""NVFP4 decode GEMM (qerl_lib.kernels.nvfp4_gemv) against the float32 dequantized reference.

The criterion, everywhere: |y - ref| <= 1 ulp of ref in the output dtype + float32 accumulation slack
(2**-20 of sum |x| |W|, 2**-16 of the LoRA term's absolute sum), where ref is x @ W.T (+ bias) (+ LoRA)
in float64 from `dequantize_nvfp4(..., float32)`. One wrong weight, group scale, nibble order or K
permutation moves an output by far more (mutations of the K order, a scale constant, the split-K sum
and a LoRA slice bound each failed 14 to 125 of the CPU checks; docs/kernels.md).

- CPU, Triton's interpreter (`TRITON_INTERPRET=1`, one subprocess reports JSON; each check is a test):
  every row count 1..48 with and without LoRA, random and adversarial codes (all-max, all-zero and
  negative zero, subnormal FP8 scales), split K, K not a multiple of 64, N not a multiple of the
  column tile, per-row global scales, LoRA over 1-3 output slices with per-row slots, counters back
  to zero after every call, `torch.library.opcheck` of `qerl::nvfp4_gemv`. The interpreter runs no
  PTX: the GPU decode (`_DECODE_BF16`/`_DECODE_F16`) is checked by emulating its instructions here.
- GPU (`-m gpu`): the Qwen2.5-7B shapes at every row count 1..48, with and without LoRA (3, 1 and
  2 slices), adversarial codes, NaN-poisoned outputs, bit-identical repeats, counters back to zero,
  CUDA-graph capture and replay, fp16 activations.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP8_NAN = (0x7F, 0xFF)


# ---------------------------------------------------------------------------------------
# Weights and the reference
# ---------------------------------------------------------------------------------------


def make_weight(n: int, k: int, kind: str, gen: torch.Generator, per_row_gs: bool = False):
    """(packed uint8 [N, K/2], scale float8_e4m3fn [N, K/16], global_scale float32 [1] or [N]) of a `kind`:
    random (the project's quantizer on random W), codes (uniform codes and FP8 scales, no NaN), max
    (every code +6 or -6 by row, scale 448), zero (codes 0 and 8 = -0.0), subnormal (FP8 scales 1..7)."""
    from qerl_lib.nvfp4 import quantize_nvfp4

    if kind == "random":
        w = torch.randn(n, k, generator=gen) * 0.05
        w[0, :16] = 0.0
        p, s, gs = quantize_nvfp4(w)
    else:
        if kind == "max":
            p = torch.where(torch.arange(n)[:, None] % 2 == 0, 0x77, 0xFF).to(torch.uint8).expand(n, k // 2).clone()
            sb = torch.full((n, k // 16), 0x7E, dtype=torch.uint8)  # 448
        elif kind == "zero":
            p = torch.where(torch.rand(n, k // 2, generator=gen) < 0.5, 0x00, 0x88).to(torch.uint8)
            sb = torch.randint(0x08, 0x7E, (n, k // 16), generator=gen).to(torch.uint8)
        elif kind == "subnormal":
            p = torch.randint(0, 256, (n, k // 2), generator=gen).to(torch.uint8)
            sb = torch.randint(1, 8, (n, k // 16), generator=gen).to(torch.uint8)
        elif kind == "codes":
            p = torch.randint(0, 256, (n, k // 2), generator=gen).to(torch.uint8)
            sb = torch.randint(0, 0x7F, (n, k // 16), generator=gen).to(torch.uint8)
        else:
            raise ValueError(kind)
        s = sb.view(torch.float8_e4m3fn)
        gs = torch.tensor([3.0 if kind != "subnormal" else 1 / 256], dtype=torch.float32)
    if per_row_gs:
        gs = gs * (1.0 + torch.arange(n, dtype=torch.float32) % 3)  # three "partitions"
    return p, s, gs


def reference(x, p, s, gs, bias=None, lora=None):
    """(ref, absolute bound) in float64: x @ W.T + bias + scale * (x @ A.T) @ B.T (slices), W the float32
    dequantization (per-row global scales applied row by row); lora = (A list, B list, scale, row mask)."""
    from qerl_lib.nvfp4 import dequantize_nvfp4

    g = gs.reshape(-1).float()
    if g.numel() == 1:
        w = dequantize_nvfp4(p, s, g, torch.float32)
    else:
        w = torch.cat([dequantize_nvfp4(p[i:i + 1], s[i:i + 1], g[i:i + 1], torch.float32) for i in range(p.shape[0])])
    xd, wd = x.double(), w.double()
    ref, bound = xd @ wd.T, xd.abs() @ wd.abs().T
    if bias is not None:
        ref, bound = ref + bias.double(), bound + bias.double().abs()
    lora_bound = torch.zeros_like(ref)
    if lora is not None:
        a_list, b_list, scale, rows = lora
        outs, absl = [], []
        for a, b in zip(a_list, b_list):
            t = xd @ a.double().T
            outs.append(t @ b.double().T * scale)
            absl.append((xd.abs() @ a.double().abs().T) @ b.double().abs().T * abs(scale))
        mask = rows.double()[:, None] if rows is not None else 1.0
        ref = ref + torch.cat(outs, 1) * mask
        lora_bound = torch.cat(absl, 1)
    return ref, bound, lora_bound


def within(y: torch.Tensor, ref, bound, lora_bound) -> tuple[bool, str]:
    """|y - ref| <= 1 ulp(ref) in y's dtype + 2**-20 * bound + 2**-16 * lora_bound, elementwise."""
    mant = 7 if y.dtype == torch.bfloat16 else 10  # spacing 2**(e - mant) of the output dtype
    y = y.double().cpu()
    ref, bound, lora_bound = ref.cpu(), bound.cpu(), lora_bound.cpu()
    mag = ref.abs().clamp_min(2.0 ** -120)
    ulp = torch.exp2(torch.floor(torch.log2(mag)) - mant)
    tol = ulp + 2.0 ** -20 * bound + 2.0 ** -16 * lora_bound + 1e-30
    err = (y - ref).abs()
    bad = ~(err <= tol)
    if bool(bad.any()):
        i = int(torch.nonzero(bad.flatten())[0])
        return False, (f"{int(bad.sum())} of {bad.numel()} outside; first flat {i}: got {y.flatten()[i]:.6g} "
                       f"ref {ref.flatten()[i]:.6g} tol {tol.flatten()[i]:.3g}")
    return True, f"max err/tol {float((err / tol).max()):.3f}"


# ---------------------------------------------------------------------------------------
# The GPU decode, emulated (the interpreter cannot run PTX)
# ---------------------------------------------------------------------------------------


def _f16_bits(v: np.ndarray, dtype) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(v, dtype=np.float64)).to(dtype)
    return t.view(torch.int16).numpy().astype(np.uint32) & 0xFFFF


def _bits_f(v: np.ndarray, dtype) -> np.ndarray:
    return torch.from_numpy((v & 0xFFFF).astype(np.int32).astype(np.int16)).view(dtype).double().numpy()


def emulate_decode(asm: str, q: np.ndarray, sb: np.ndarray) -> list[np.ndarray]:
    """Run the PTX block of `_decode_asm` (shl, mov, prmt, and, shr, lop3, fma.rn.{bf16,f16}x2) on uint32
    arrays: $4 = q, $5 = sb; returns $0..$3."""
    regs: dict[str, np.ndarray] = {"$4": q.astype(np.uint32), "$5": sb.astype(np.uint32)}

    def val(tok):
        tok = tok.strip()
        return regs[tok] if tok in regs else np.uint32(int(tok, 0))

    for stmt in asm.strip("{} ").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        a = [t.strip() for t in args.split(",")]
        if op == "shl.b32":
            regs[a[0]] = (val(a[1]) << np.uint32(int(a[2]))) & np.uint32(0xFFFFFFFF)
        elif op == "shr.b32":
            regs[a[0]] = val(a[1]) >> np.uint32(int(a[2]))
        elif op == "mov.b32":
            regs[a[0]] = np.broadcast_to(val(a[1]), q.shape).astype(np.uint32)
        elif op == "and.b32":
            regs[a[0]] = val(a[1]) & val(a[2])
        elif op == "prmt.b32":
            src = np.stack([(val(a[1]) >> np.uint32(8 * i)) & 0xFF for i in range(4)]
                           + [(val(a[2]) >> np.uint32(8 * i)) & 0xFF for i in range(4)])
            sel = int(a[3], 0)
            out = np.zeros(q.shape, dtype=np.uint32)
            for i in range(4):
                nib = (sel >> (4 * i)) & 0xF
                assert nib < 8, "sign-replicate mode not emulated"
                out |= src[nib].astype(np.uint32) << np.uint32(8 * i)
            regs[a[0]] = out
        elif op == "lop3.b32":
            x, y, z, lut = val(a[1]), val(a[2]), val(a[3]), int(a[4], 0)
            out = np.zeros(q.shape, dtype=np.uint32)
            for idx in range(8):
                if (lut >> idx) & 1:
                    fx = x if idx & 4 else ~x
                    fy = y if idx & 2 else ~y
                    fz = z if idx & 1 else ~z
                    out |= fx & fy & fz
            regs[a[0]] = out & np.uint32(0xFFFFFFFF)
        elif op in ("fma.rn.bf16x2", "fma.rn.f16x2"):
            dt = torch.bfloat16 if "bf16" in op else torch.float16
            res = np.zeros(q.shape, dtype=np.uint32)
            for half in (0, 16):
                h = [(np.broadcast_to(val(t), q.shape) >> np.uint32(half)) & 0xFFFF for t in a[1:4]]
                prod = _bits_f(h[0], dt) * _bits_f(h[1], dt) + _bits_f(h[2], dt)
                # exact product (at most 6 significant bits): rounding cannot hide an error here
                res |= _f16_bits(prod, dt) << np.uint32(half)
            regs[a[0]] = res
        else:
            raise AssertionError(f"unknown PTX {op}")
    return [regs[f"${i}"] for i in range(4)]


def check_decode_emulated() -> dict[str, dict]:
    """The PTX decode gives e2m1(n) * fp8 * 2**-7 (bf16 and fp16, every nibble at every position, signed
    zeros kept) for scale bytes 0 (zero), 1..7 (subnormal), normal ones and 448."""
    from qerl_lib.kernels import nvfp4_gemv as G

    out = {}
    rng = np.random.default_rng(0)
    words = np.concatenate([rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32),
                            np.array([0x76543210 * 1, 0xFEDCBA98, 0x88888888, 0x77777777, 0, 0xFFFFFFFF],
                                     dtype=np.uint32)])
    for name, asm, dt, factor in (("bf16", G._DECODE_BF16.value, torch.bfloat16, 2.0 ** 119),
                                  ("f16", G._DECODE_F16.value, torch.float16, 2.0 ** 7)):
        ok, detail = True, ""
        for sbyte in (0, 1, 5, 7, 8, 0x38, 0x55, 0x7E):
            fp8 = float(torch.tensor([sbyte], dtype=torch.uint8).view(torch.float8_e4m3fn).float())
            sc = _f16_bits(np.array([fp8 * factor]), dt)[0]
            o = emulate_decode(asm, words, np.full(words.shape, sc | (sc << 16), dtype=np.uint32))
            for i in range(4):
                for half, nib_shift in ((0, 8 * i), (16, 8 * i + 4)):
                    nib = (words >> np.uint32(nib_shift)) & 0xF
                    want = np.array([(-1.0 if v & 8 else 1.0) * E2M1[v & 7] for v in nib]) * fp8 * 2.0 ** -7
                    got_bits = (o[i] >> np.uint32(half)) & 0xFFFF
                    want_bits = _f16_bits(want, dt)
                    # -0.0 codes must stay -0.0 (sign bit), like the reference's unpacking
                    if not np.array_equal(got_bits, want_bits):
                        ok, detail = False, f"scale byte {sbyte:#x}, byte {i}, half {half}"
        out[f"decode_ptx_emulated[{name}]"] = {"ok": ok, "detail": detail}
    return out


# ---------------------------------------------------------------------------------------
# Interpreter checks (run in a subprocess)
# ---------------------------------------------------------------------------------------

ROWS = list(range(1, 49))
INTERP_CASES = [  # (name, n, k, kind, config or None, lora (rank, widths) or None, per_row_gs, index)
    ("plan", 96, 256, "random", None, None, False, False),
    ("plan_lora3", 96, 256, "random", None, (16, [64, 16, 16]), False, True),
    ("split3_n130_k320", 130, 320, "codes", {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "split": 3}, None, True,
     False),
    ("k80_masked", 72, 80, "codes", None, (8, [72]), False, False),
    ("max", 64, 128, "max", None, (4, [32, 32]), False, True),
    ("zero", 64, 128, "zero", None, (4, [64]), False, False),
    ("subnormal", 64, 192, "subnormal", {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 128, "split": 2}, None, False,
     False),
]
INTERP_ROWS = {"plan": ROWS, "plan_lora3": ROWS}  # the others: a few row counts each
FEW_ROWS = [1, 2, 7, 16, 17, 33, 48]


def _interp_names() -> list[str]:
    names = ["decode_ptx_emulated[bf16]", "decode_ptx_emulated[f16]", "counters_zero", "opcheck", "fp16_x",
             "lora_scale_zero_rows", "bad_inputs", "worker_path"]
    for case in INTERP_CASES:
        names += [f"{case[0]}[m={m}]" for m in INTERP_ROWS.get(case[0], FEW_ROWS)]
    return names


def run_case(m, n, k, kind, config, lora, per_row_gs, index, gen, device="cpu", dtype=torch.bfloat16):
    """One call of `nvfp4_gemv` and its reference check; returns (ok, detail, y)."""
    from qerl_lib.kernels import nvfp4_gemv as G

    p, s, gs = make_weight(n, k, kind, gen, per_row_gs)
    x = (torch.randn(m, k, generator=gen) * (4.0 if kind == "subnormal" else 1.0)).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    a_list = b_list = idx = rows = None
    scale = 0.75
    if lora is not None:
        rank, widths = lora
        a_list = [(torch.randn(rank, k, generator=gen) * 0.1).to(dtype) for _ in widths]
        b_list = [(torch.randn(wd, rank, generator=gen) * 0.1).to(dtype) for wd in widths]
        if index:
            idx = torch.randint(-1, 2, (m + 5,), generator=gen)
            rows = idx[:m] == 0
    ref = reference(x, p, s, gs, bias, None if lora is None else (a_list, b_list, scale, rows))
    mv = lambda t: None if t is None else t.to(device)  # noqa: E731
    y = G.nvfp4_gemv(mv(x), mv(p), mv(s), mv(gs), mv(bias), None if a_list is None else [mv(a) for a in a_list],
                     None if b_list is None else [mv(b) for b in b_list], scale, mv(idx), 0, config=config)
    ok, detail = within(y, *ref)
    ok = ok and y.shape == (m, n) and y.dtype == dtype
    return ok, detail, y


def _interpreter_checks() -> dict[str, dict]:
    """Every CPU check; {name: {"ok", "detail"}}. Needs TRITON_INTERPRET=1."""
    from qerl_lib.kernels import nvfp4_gemv as G
    from qerl_lib.kernels.nvfp4_triton import interpreter_mode

    assert interpreter_mode()
    results = dict(check_decode_emulated())

    def record(name, ok, detail=""):
        results[name] = {"ok": bool(ok), "detail": str(detail)}

    gen = torch.Generator().manual_seed(0)
    for name, n, k, kind, config, lora, per_row_gs, index in INTERP_CASES:
        for m in INTERP_ROWS.get(name, FEW_ROWS):
            cfg = config
            if cfg is not None and m > cfg["BLOCK_M"]:
                cfg = dict(cfg, BLOCK_M=64)
            try:
                ok, detail, _ = run_case(m, n, k, kind, cfg, lora, per_row_gs, index, gen)
            except Exception as e:  # a crash is a failed check, not a crashed run
                ok, detail = False, repr(e)
            record(f"{name}[m={m}]", ok, detail)
    ok, detail, _ = run_case(5, 48, 128, "random", None, (8, [48]), False, False, gen, dtype=torch.float16)
    record("fp16_x", ok, detail)

    # rows whose slot is not lora_slot get exactly the base output
    p, s, gs = make_weight(64, 128, "random", gen)
    x = torch.randn(6, 128, generator=gen).to(torch.bfloat16)
    a = (torch.randn(8, 128, generator=gen)).to(torch.bfloat16)
    b = (torch.randn(64, 8, generator=gen)).to(torch.bfloat16)
    idx = torch.tensor([0, -1, 1, 0, -1, 2])
    base = G.nvfp4_gemv(x, p, s, gs)
    with_lora = G.nvfp4_gemv(x, p, s, gs, None, a, b, 1.0, idx, 0)
    keep = idx != 0
    record("lora_scale_zero_rows",
           torch.equal(base[keep], with_lora[keep]) and not torch.equal(base[~keep], with_lora[~keep]))

    # the worker extension's call: a fused q|k|v layer (own global scale per partition, as vLLM loads
    # them), bias, slot-0 views of vLLM-shaped stacked LoRA buffers, per-token slots; against
    # `dequantize_partitions` (the dense regime's weight) in float32 and the LoRA per slice
    from types import SimpleNamespace

    from qerl_lib.rollout.vllm_gemv import _gemv_lora, partition_scales
    from qerl_lib.rollout.vllm_weights import dequantize_partitions

    widths, kk, r = [64, 16, 16], 128, 16
    parts = [make_weight(wd, kk, "random", gen) for wd in widths]
    pk, sk = torch.cat([q[0] for q in parts]), torch.cat([q[1] for q in parts])
    gparts = torch.cat([q[2] for q in parts])
    stacked_a = tuple((torch.randn(1, 1, r, kk, generator=gen) * 0.1).to(torch.bfloat16) for _ in widths)
    stacked_b = tuple((torch.randn(1, 1, wd, r, generator=gen) * 0.1).to(torch.bfloat16) for wd in widths)
    slots_buf = torch.tensor([0, -1, 0, 0, -1, 0, 0, 0] + [5] * 8)
    wrap = SimpleNamespace(lora_a_stacked=stacked_a, lora_b_stacked=stacked_b,
                           base_layer=SimpleNamespace(output_size_per_partition=96, params_dtype=torch.bfloat16),
                           punica_wrapper=SimpleNamespace(_token_lora_indices=slots_buf))
    la, lb, slots = _gemv_lora(wrap)
    xw = torch.randn(7, kk, generator=gen).to(torch.bfloat16)
    bw = torch.randn(96, generator=gen).to(torch.bfloat16)
    yw = G.nvfp4_gemv(xw, pk, sk, partition_scales(gparts, widths), bw, la, lb, 1.0, slots, 0)
    wd32 = dequantize_partitions(pk, sk, gparts, widths, torch.float32).double()
    xd = xw.double()
    refw = xd @ wd32.T + bw.double() + torch.cat(
        [(xd @ a.double().T) @ b.double().T for a, b in zip(la, lb)], 1) * (slots[:7] == 0).double()[:, None]
    boundw = xd.abs() @ wd32.abs().T + bw.double().abs()
    lbw = torch.cat([(xd.abs() @ a.double().abs().T) @ b.double().abs().T for a, b in zip(la, lb)], 1)
    record("worker_path", *within(yw, refw, boundw, lbw))

    # the custom op: schema, fake implementation, no aliasing
    op = G.register_op()
    args = (x, p, s.view(torch.uint8), gs, None, [a], [b], 0.5, idx, 0)
    try:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
        same = torch.equal(torch.ops.qerl.nvfp4_gemv(*args), G.nvfp4_gemv(*args[:5], a, b, 0.5, idx, 0))
        record("opcheck", same, "" if same else "op output differs from the function")
    except Exception as e:
        record("opcheck", False, repr(e)[:500])

    bad = 0
    for fn in (lambda: G.nvfp4_gemv(torch.randn(65, 128).to(torch.bfloat16), p, s, gs),  # too many rows
               lambda: G.nvfp4_gemv(x.float(), p, s, gs),  # float32 activations
               lambda: G.nvfp4_gemv(x, p, s, gs, None, a, b[:60]),  # B rows != N
               lambda: G.nvfp4_gemv(x, p, s[:, :4], gs)):  # scale shape
        try:
            fn()
        except ValueError:
            bad += 1
    record("bad_inputs", bad == 4, f"{bad} of 4 refused")
    cnt = G.counters(torch.device("cpu"))  # after every call above, LoRA and split K included
    record("counters_zero", int(cnt.abs().sum()) == 0, f"nonzero: {torch.nonzero(cnt).flatten()[:8].tolist()}")
    return results


@pytest.fixture(scope="module")
def interpreter_results():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--interpreter"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        pytest.fail(f"interpreter checks crashed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("check", _interp_names())
def test_interpreter(interpreter_results, check):
    assert check in interpreter_results, f"check {check} did not run"
    r = interpreter_results[check]
    assert r["ok"], r["detail"]


def test_emulator_catches_a_wrong_decode():
    """The PTX emulation is not vacuous: a wrong shift (5 instead of 6) or prmt selector is caught."""
    pytest.importorskip("triton")
    from qerl_lib.kernels import nvfp4_gemv as G

    words = np.random.default_rng(1).integers(0, 2**32, 512, dtype=np.uint64).astype(np.uint32)
    sc = 0x3F80  # bf16 1.0
    sb = np.full(words.shape, sc | (sc << 16), dtype=np.uint32)
    good = emulate_decode(G._DECODE_BF16.value, words, sb)
    for wrong in (G._DECODE_BF16.value.replace("shr.b32 t, t, 6", "shr.b32 t, t, 5"),
                  G._DECODE_BF16.value.replace("0x5010", "0x5000")):
        assert any(not np.array_equal(g, w) for g, w in zip(good, emulate_decode(wrong, words, sb)))


def test_plan_shapes():
    """The heuristic: 64-column tiles and a 256-wide K step up to 16 rows, splits only while the float32
    partials stay below the codes' bytes, BLOCK_K a multiple of 64."""
    pytest.importorskip("triton")
    from qerl_lib.kernels.nvfp4_gemv import plan

    for m in (1, 16, 17, 48, 64):
        for n, k in ((4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (40, 80)):
            cfg = plan(m, n, k, 132)
            assert cfg["BLOCK_M"] >= m and cfg["BLOCK_K"] % 64 == 0
            assert cfg["split"] * m * n * 8 <= max(n * k * 0.5625, m * n * 8)
    assert plan(1, 3584, 18944, 132)["split"] > 1 and plan(48, 3584, 3584, 132)["split"] <= 5


# ---------------------------------------------------------------------------------------
# GPU tests
# ---------------------------------------------------------------------------------------

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Qwen2.5-7B's fused projections: q|k|v, o, gate|up, down, with vLLM's LoRA output slices
QWEN = {"qkv": (4608, 3584, [3584, 512, 512]), "o": (3584, 3584, [3584]),
        "gate_up": (37888, 3584, [18944, 18944]), "down": (3584, 18944, [3584])}


def _poison():
    free = torch.cuda.mem_get_info()[0]
    big = torch.full((min(free // 4, 2 << 30) // 2,), float("nan"), dtype=torch.float16, device="cuda")
    del big


@gpu
@needs_cuda
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("shape", list(QWEN))
def test_gpu_every_row_count(shape, lora):
    """Every M in 1..48 on the 7B shape: within bf16 rounding of the float32 reference, outputs written
    (NaN-poisoned first), a repeat bit-identical, the counters zero after."""
    from qerl_lib.kernels import nvfp4_gemv as G

    pytest.importorskip("triton")
    n, k, widths = QWEN[shape]
    gen = torch.Generator().manual_seed(n + k + lora)
    p, s, gs = make_weight(n, k, "codes", gen)
    gs = torch.tensor([150.0])
    dev = lambda t: t.to("cuda")  # noqa: E731
    P, S, GS = dev(p), dev(s), dev(gs)
    rank = 16
    A = [(torch.randn(rank, k, generator=gen) * 0.05).to(torch.bfloat16) for _ in widths] if lora else None
    B = [(torch.randn(w, rank, generator=gen) * 0.05).to(torch.bfloat16) for w in widths] if lora else None
    from qerl_lib.nvfp4 import dequantize_nvfp4

    Wd = dequantize_nvfp4(P, S, GS, torch.float32).double()
    Wabs = Wd.abs()
    failures = []
    for m in ROWS:
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        idx = torch.randint(-1, 1, (m,), generator=gen) if lora else None
        _poison()
        y = G.nvfp4_gemv(dev(x), P, S, GS, None, None if A is None else [dev(a) for a in A],
                         None if B is None else [dev(b) for b in B], 1.0, None if idx is None else dev(idx), 0)
        y2 = G.nvfp4_gemv(dev(x), P, S, GS, None, None if A is None else [dev(a) for a in A],
                          None if B is None else [dev(b) for b in B], 1.0, None if idx is None else dev(idx), 0)
        torch.cuda.synchronize()
        xd = dev(x).double()
        ref = xd @ Wd.T
        bound = xd.abs() @ Wabs.T
        lb = torch.zeros_like(ref)
        if lora:
            lo = torch.cat([(xd @ dev(a).double().T) @ dev(b).double().T for a, b in zip(A, B)], 1)
            ref = ref + lo * (dev(idx) == 0).double()[:, None]
            lb = torch.cat([(xd.abs() @ dev(a).double().abs().T) @ dev(b).double().abs().T for a, b in zip(A, B)], 1)
        ok, detail = within(y, ref, bound, lb)
        if not ok or not torch.isfinite(y).all() or not torch.equal(y, y2):
            failures.append(f"m={m}: {detail} finite={bool(torch.isfinite(y).all())} repeat={torch.equal(y, y2)}")
    assert int(G.counters(torch.device("cuda")).abs().sum()) == 0, "counters not back to zero"
    assert not failures, "\n".join(failures[:10])


@gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["max", "zero", "subnormal", "random"])
def test_gpu_adversarial(kind):
    gen = torch.Generator().manual_seed(7)
    for m, n, k, lora, cfg in ((1, 512, 3584, None, None), (13, 1000, 400, (8, [600, 400]), None),
                               (48, 384, 1024, (16, [128, 128, 128]), None),
                               (5, 256, 512, None, {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8,
                                                    "num_stages": 3, "split": 4})):
        ok, detail, _ = run_case(m, n, k, kind, cfg, lora, kind == "random", lora is not None, gen, device="cuda")
        assert ok, f"{kind} m={m} n={n} k={k}: {detail}"


@gpu
@needs_cuda
def test_gpu_fp16():
    gen = torch.Generator().manual_seed(8)
    for m in (1, 16, 40):
        ok, detail, _ = run_case(m, 4608, 3584, "random", None, (16, [3584, 512, 512]), False, True, gen,
                                 device="cuda", dtype=torch.float16)
        assert ok, f"m={m}: {detail}"


@gpu
@needs_cuda
def test_gpu_cuda_graph_replay():
    """The custom op captured in a CUDA graph (after one eager call) replays correctly with new inputs,
    LoRA and split K included, and leaves the counters at zero."""
    from qerl_lib.kernels import nvfp4_gemv as G

    op = G.register_op()
    gen = torch.Generator().manual_seed(9)
    p, s, gs = make_weight(3584, 18944, "random", gen)
    P, S, GS = p.cuda(), s.cuda(), gs.cuda()
    a = (torch.randn(16, 18944, generator=gen) * 0.05).to("cuda", torch.bfloat16)
    b = (torch.randn(3584, 16, generator=gen) * 0.05).to("cuda", torch.bfloat16)
    idx = torch.zeros(8, dtype=torch.long, device="cuda")
    x = torch.randn(8, 18944, generator=gen).to("cuda", torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        op(x, P, S, GS, None, [a], [b], 1.0, idx, 0)  # eager first: allocates the device's counters
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            y = op(x, P, S, GS, None, [a], [b], 1.0, idx, 0)
    torch.cuda.current_stream().wait_stream(stream)
    for trial in range(3):
        x.copy_(torch.randn(8, 18944, generator=gen).to("cuda", torch.bfloat16))
        idx.copy_(torch.tensor([0, -1] * 4))
        graph.replay()
        torch.cuda.synchronize()
        want = G.nvfp4_gemv(x, P, S, GS, None, a, b, 1.0, idx, 0)
        assert torch.equal(y, want), f"replay {trial} differs from an eager call"
    for c in G._COUNTERS.values():
        assert int(c.abs().sum()) == 0


if __name__ == "__main__":
    if "--interpreter" in sys.argv:
        print(json.dumps(_interpreter_checks()))
