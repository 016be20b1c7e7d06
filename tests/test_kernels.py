"""Fused NVFP4 Triton kernels (qerl_lib.kernels.nvfp4_triton) against dequantize-then-matmul.

Two kinds of tests:

- CPU, in Triton's interpreter (`TRITON_INTERPRET=1`): the environment variable must be set
  before Triton decorates the kernels, so one subprocess runs every interpreter check
  (`python tests/test_kernels.py --interpreter`) and reports JSON; each check is its own
  test here. Skipped when Triton is not installed. The interpreter stores bfloat16 as
  uint16 and casts float32 -> bfloat16 by truncation, so there the kernels' bf16 dequant
  is checked to 1 ulp and the GEMMs in fp16 (exactly rounded) and bf16 (looser); the GPU
  tests check bf16 bit-exactly.
- GPU (`-m gpu`, CUDA + Triton): bit-exact tile dequantization, forward and input gradient
  across shapes (odd M, Qwen2.5-7B's K and N, 1 to 4097 tokens) within bf16-accumulation
  tolerance of cuBLAS on the same dequantized weight, outputs poisoned first, and
  NVFP4Linear's automatic backend choice with autograd.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# (M, N, K): odd M, N not a multiple of any block, K a multiple of 16 but not of BLOCK_K
INTERP_SHAPES = [(1, 48, 64), (7, 40, 96), (33, 64, 160), (5, 17, 48), (19, 80, 32)]
INTERP_CONFIGS = [
    None,  # the interpreter default (16, 32, 32)
    {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64, "GROUP_M": 2},
    {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 16, "GROUP_M": 1},
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units of the last place between two same-dtype 16-bit tensors."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    # map sign-magnitude to a monotone integer line
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


def _random_nvfp4(n: int, k: int, gen: torch.Generator, device="cpu"):
    """A random NVFP4 weight made by the project's quantizer (bit-identical to llm-compressor)."""
    from qerl_lib.nvfp4 import quantize_nvfp4

    w = torch.randn(n, k, generator=gen) * 0.05
    w[0, :16] = 0.0  # an all-zero block (scale 0.125)
    return tuple(t.to(device) for t in quantize_nvfp4(w))


# ---------------------------------------------------------------------------------------
# Interpreter checks (run in a subprocess)
# ---------------------------------------------------------------------------------------


def _interpreter_checks() -> dict[str, dict]:
    """Every CPU check; returns {name: {"ok": bool, "detail": str}}. Needs TRITON_INTERPRET=1."""
    from qerl_lib.kernels import nvfp4_backends as kb
    from qerl_lib.kernels import nvfp4_triton as kt
    from qerl_lib.nvfp4 import dequantize_nvfp4
    from qerl_lib.nvfp4_linear import NVFP4Linear, TORCH_BACKEND, MatmulBackend, register_matmul_backend

    assert kt.interpreter_mode()
    results: dict[str, dict] = {}

    def record(name, ok, detail=""):
        results[name] = {"ok": bool(ok), "detail": str(detail)}

    gen = torch.Generator().manual_seed(0)
    for n, k in [(48, 64), (17, 48), (40, 96), (3, 16)]:
        p, s, gs = _random_nvfp4(n, k, gen)
        eff = kt.effective_scales(s.view(torch.uint8), gs)
        ref_eff = s.to(torch.float32) / gs * 16384
        record(f"effective_scales[{n}x{k}]", torch.equal(eff.view(torch.int32), ref_eff.view(torch.int32)))
        for dtype in (torch.float32, torch.float16):
            ref = dequantize_nvfp4(p, s, gs, dtype)
            got = kt.nvfp4_dequantize_triton(p, s, gs, dtype)
            bits = torch.int32 if dtype == torch.float32 else torch.int16
            record(f"dequant_bitexact[{n}x{k},{dtype}]", torch.equal(ref.view(bits), got.view(bits)))
        ref = dequantize_nvfp4(p, s, gs, torch.bfloat16)
        got = kt.nvfp4_dequantize_triton(p, s, gs, torch.bfloat16)
        u = _ulps(ref, got)
        record(f"dequant_bf16_within_1ulp[{n}x{k}]", u <= 1, f"max ulps {u}")

    for m, n, k in INTERP_SHAPES:
        p, s, gs = _random_nvfp4(n, k, gen)
        for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 2e-2)):
            w = dequantize_nvfp4(p, s, gs, dtype).double()
            x = torch.randn(m, k, generator=gen).to(dtype)
            dy = torch.randn(m, n, generator=gen).to(dtype)
            bias = torch.randn(n, generator=gen)
            for ci, cfg in enumerate(INTERP_CONFIGS):
                y = kt.nvfp4_matmul(x, p, s, gs, None, config=cfg)
                yb = kt.nvfp4_matmul(x, p, s, gs, bias, config=cfg)
                dx = kt.nvfp4_grad_input(dy, p, s, gs, config=cfg)
                tag = f"[{m}x{n}x{k},{str(dtype)[6:]},cfg{ci}]"
                e1, e2 = _rel(y, x.double() @ w.T), _rel(yb, x.double() @ w.T + bias.to(dtype).double())
                e3 = _rel(dx, dy.double() @ w)
                record(f"forward{tag}", y.shape == (m, n) and y.dtype == dtype and e1 < tol, f"rel {e1:.2e}")
                record(f"forward_bias{tag}", e2 < tol, f"rel {e2:.2e}")
                record(f"grad_input{tag}", dx.shape == (m, k) and dx.dtype == dtype and e3 < tol, f"rel {e3:.2e}")

    # NVFP4Linear with the Triton backend registered for the CPU: forward and backward
    # through autograd agree with the pure-PyTorch backend (fp16, where the interpreter rounds exactly)
    p, s, gs = _random_nvfp4(40, 96, gen)
    layer = NVFP4Linear.from_tensors(p, s, gs, bias=torch.randn(40, generator=gen))
    x = torch.randn(2, 5, 96, generator=gen).to(torch.float16)
    outs = {}
    for name, backend in (("torch", TORCH_BACKEND), ("triton", kb.make_backend())):
        register_matmul_backend("cpu", backend)
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.float().square().sum().backward()
        outs[name] = (y.detach(), xi.grad.detach())
    register_matmul_backend("cpu", None)
    ef, eb = _rel(outs["triton"][0], outs["torch"][0]), _rel(outs["triton"][1], outs["torch"][1])
    record("nvfp4linear_autograd_fp16", ef < 2e-3 and eb < 2e-3, f"fwd {ef:.2e} bwd {eb:.2e}")

    # The dequantize-once backend multiplies by the very W the torch backend builds (fp16: the
    # interpreter's dequantization is bit-exact there), so its outputs are identical.
    dq = kb.make_dequant_backend()
    for m, n, k in INTERP_SHAPES[:3]:
        p, s, gs = _random_nvfp4(n, k, gen)
        x = torch.randn(m, k, generator=gen).to(torch.float16)
        dy = torch.randn(m, n, generator=gen).to(torch.float16)
        bias = torch.randn(n, generator=gen)
        same = (torch.equal(dq.forward(x, p, s, gs, bias), TORCH_BACKEND.forward(x, p, s, gs, bias))
                and torch.equal(dq.grad_input(dy, p, s, gs), TORCH_BACKEND.grad_input(dy, p, s, gs)))
        record(f"dequant_backend_equals_torch[{m}x{n}x{k}]", same and dq.name == "triton-dq")
    assert isinstance(kb.make_backend(), MatmulBackend)
    return results


@pytest.fixture(scope="module")
def interpreter_results():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--interpreter"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    if proc.returncode != 0:
        pytest.fail(f"interpreter checks crashed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _interp_names() -> list[str]:
    names = []
    for n, k in [(48, 64), (17, 48), (40, 96), (3, 16)]:
        names.append(f"effective_scales[{n}x{k}]")
        names += [f"dequant_bitexact[{n}x{k},{d}]" for d in (torch.float32, torch.float16)]
        names.append(f"dequant_bf16_within_1ulp[{n}x{k}]")
    for m, n, k in INTERP_SHAPES:
        for dt in ("float16", "bfloat16"):
            for ci in range(len(INTERP_CONFIGS)):
                tag = f"[{m}x{n}x{k},{dt},cfg{ci}]"
                names += [f"forward{tag}", f"forward_bias{tag}", f"grad_input{tag}"]
    names.append("nvfp4linear_autograd_fp16")
    names += [f"dequant_backend_equals_torch[{m}x{n}x{k}]" for m, n, k in INTERP_SHAPES[:3]]
    return names


@pytest.mark.parametrize("check", _interp_names())
def test_interpreter(interpreter_results, check):
    assert check in interpreter_results, f"check {check} did not run"
    r = interpreter_results[check]
    assert r["ok"], r["detail"]


def test_cpu_keeps_torch_backend():
    """Without CUDA nothing registers the Triton kernels: the CPU stays on pure PyTorch."""
    from qerl_lib.nvfp4_linear import TORCH_BACKEND, get_matmul_backend

    assert get_matmul_backend("cpu") is TORCH_BACKEND


# ---------------------------------------------------------------------------------------
# GPU tests
# ---------------------------------------------------------------------------------------

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Qwen2.5-7B's linears: (N, K) of k/v, gate/up, down (q/o's 3584x3584 in the autograd test);
# plus an odd N and a K that is no multiple of the K tiles
GPU_NK = [(512, 3584), (18944, 3584), (3584, 18944), (1000, 400)]
GPU_M = [1, 33, 255, 4097]  # decode-like, middle and prefill autotune regimes; odd M


def _poison():
    """Fill the caching allocator's free blocks with NaN so unwritten outputs show up."""
    free = torch.cuda.mem_get_info()[0]
    big = torch.full((min(free // 4, 2 << 30) // 2,), float("nan"), dtype=torch.float16, device="cuda")
    del big


@gpu
@needs_cuda
@pytest.mark.parametrize("nk", [(512, 3584), (18944, 3584), (1000, 400), (3, 16)])
def test_gpu_dequant_bitexact(nk):
    from qerl_lib.kernels import nvfp4_triton as kt
    from qerl_lib.nvfp4 import dequantize_nvfp4

    n, k = nk
    gen = torch.Generator().manual_seed(n + k)
    p, s, gs = _random_nvfp4(n, k, gen, "cuda")
    eff = kt.effective_scales(s.view(torch.uint8), gs)
    assert torch.equal(eff.view(torch.int32), (s.float() / gs * 16384).view(torch.int32))
    for dtype, bits in ((torch.bfloat16, torch.int16), (torch.float16, torch.int16), (torch.float32, torch.int32)):
        ref = dequantize_nvfp4(p, s, gs, dtype)
        got = kt.nvfp4_dequantize_triton(p, s, gs, dtype)
        assert torch.equal(ref.view(bits), got.view(bits)), dtype


@gpu
@needs_cuda
@pytest.mark.parametrize("nk", GPU_NK)
@pytest.mark.parametrize("m", GPU_M)
def test_gpu_forward_and_grad_input(m, nk):
    """Kernel vs cuBLAS on the same dequantized bf16 W, both against a float32 reference:
    the kernel's error is within bf16-accumulation tolerance of cuBLAS's own."""
    from qerl_lib.kernels import nvfp4_triton as kt
    from qerl_lib.nvfp4 import dequantize_nvfp4

    n, k = nk
    gen = torch.Generator().manual_seed(m * 7 + n)
    p, s, gs = _random_nvfp4(n, k, gen, "cuda")
    w = dequantize_nvfp4(p, s, gs, torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
    dy = torch.randn(m, n, generator=gen).to("cuda", torch.bfloat16)
    bias = torch.randn(n, generator=gen).to("cuda")
    _poison()
    y = kt.nvfp4_matmul(x, p, s, gs, bias)
    _poison()
    dx = kt.nvfp4_grad_input(dy, p, s, gs)
    torch.cuda.synchronize()
    assert torch.isfinite(y).all() and torch.isfinite(dx).all(), "unwritten (NaN-poisoned) outputs"
    ref_y = x.float() @ w.float().T + bias.to(torch.bfloat16).float()
    ref_dx = dy.float() @ w.float()
    cublas_y = torch.nn.functional.linear(x, w, bias.to(torch.bfloat16))
    cublas_dx = dy @ w
    for got, cub, ref, what in ((y, cublas_y, ref_y, "forward"), (dx, cublas_dx, ref_dx, "grad_input")):
        e_got, e_cub = _rel(got, ref), _rel(cub, ref)
        assert e_got < 1e-2, f"{what}: rel err {e_got:.2e}"
        assert e_got <= 1.5 * e_cub + 1e-3, f"{what}: rel err {e_got:.2e} vs cuBLAS {e_cub:.2e}"


@gpu
@needs_cuda
def test_gpu_nvfp4linear_uses_triton_and_autograd(caplog):
    import logging

    from qerl_lib import nvfp4_linear as nl
    from qerl_lib.nvfp4 import dequantize_nvfp4

    nl._CHOSEN.discard("cuda")
    nl._BACKENDS.pop("cuda", None)
    with caplog.at_level(logging.INFO, logger="qerl_lib.nvfp4_linear"):
        backend = nl.get_matmul_backend("cuda")
        nl.get_matmul_backend("cuda")
    assert backend.name == f"triton<={nl.DENSE_ABOVE_ROWS}<triton-dq"
    assert sum("NVFP4 matmul on cuda" in r.getMessage() for r in caplog.records) == 1  # logged once

    gen = torch.Generator().manual_seed(3)
    p, s, gs = _random_nvfp4(3584, 3584, gen, "cuda")
    layer = nl.NVFP4Linear.from_tensors(p, s, gs, bias=torch.randn(3584, generator=gen).to("cuda", torch.bfloat16))
    x = torch.randn(2, 333, 3584, generator=gen).to("cuda", torch.bfloat16).requires_grad_(True)
    y = layer(x)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    w = dequantize_nvfp4(p, s, gs, torch.float32)
    ref_y = x.detach().float() @ w.T + layer.bias.float()
    ref_gx = g.float() @ w
    assert _rel(y, ref_y) < 1e-2 and _rel(gx, ref_gx) < 1e-2
    # float32 activations keep the exact torch path
    y32 = layer(x.detach().float())
    assert torch.equal(y32, nl.torch_matmul_forward(x.detach().float().reshape(-1, 3584), p, s, gs, layer.bias).reshape(y32.shape))


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 4097])
def test_gpu_dequant_backend_equals_torch_backend(m, monkeypatch):
    """triton-dq multiplies by the same bf16 W as the plain path (one kernel instead of several ops):
    cuBLAS on identical operands gives identical outputs, forward and input gradient."""
    from qerl_lib import nvfp4_linear as nl

    gen = torch.Generator().manual_seed(5)
    p, s, gs = _random_nvfp4(18944, 3584, gen, "cuda")
    x = torch.randn(m, 3584, generator=gen).to("cuda", torch.bfloat16)
    dy = torch.randn(m, 18944, generator=gen).to("cuda", torch.bfloat16)
    monkeypatch.setenv("QERL_NVFP4_BACKEND", "triton-dq")
    nl._CHOSEN.discard("cuda")
    nl._BACKENDS.pop("cuda", None)
    try:
        dq = nl.get_matmul_backend("cuda")
    finally:
        nl._CHOSEN.discard("cuda")
        nl._BACKENDS.pop("cuda", None)
    assert dq.name == "triton-dq"
    assert torch.equal(dq.forward(x, p, s, gs, None), nl.TORCH_BACKEND.forward(x, p, s, gs, None))
    assert torch.equal(dq.grad_input(dy, p, s, gs), nl.TORCH_BACKEND.grad_input(dy, p, s, gs))


if __name__ == "__main__":
    if "--interpreter" in sys.argv:
        print(json.dumps(_interpreter_checks()))
