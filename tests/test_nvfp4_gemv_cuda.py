"""NVFP4 decode GEMM in CUDA C++ (qerl_lib.kernels.nvfp4_gemv_cuda) against the float32 dequantized reference.

The criterion is tests/test_nvfp4_gemv.py's (`within`): |y - ref| <= 1 ulp of ref in the output dtype +
2**-20 of sum |x| |W| + 2**-16 of the LoRA term's absolute sum, ref in float64 from `dequantize_nvfp4`.

- CPU: `plan` on the 7B shapes, argument errors raised before any GPU work, the build error without a
  GPU, and the kernel's per-lane code replayed on the CPU (csrc/nvfp4_gemv_host_test.cu, built with
  nvcc when there is one: every row count 1..16, K tails, misaligned rows, per-row global scales, bias,
  LoRA over 1-3 slices with row slots, all-max / zero / subnormal-scale codes, fp16; mutations of the
  decode's selector, the scale group, the B fragment order or the accumulator slot each fail 32 of its
  35 cases, a wrong group index in the tail loads the 5 K-tail cases).
- GPU (`-m gpu`): the Qwen2.5-7B shapes at every row count 1..16 with and without LoRA (3, 1 and 2
  slices), adversarial codes, K tails and misaligned rows, launch configurations, fp16, int32 slots,
  NaN-poisoned outputs, bit-identical repeats, CUDA-graph capture and replay (with and without PDL),
  agreement with the Triton kernel, `opcheck` of `qerl::nvfp4_gemv_cuda`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from test_nvfp4_gemv import QWEN, _poison, make_weight, reference, within

from qerl_lib.kernels import nvfp4_gemv_cuda as C

ROWS = list(range(1, C.MAX_ROWS + 1))


# ---------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------


def test_plan_on_the_7b_shapes():
    """At M <= 8 (112 registers): q|k|v 4 warps per block (288 tiles would need two waves of 8-warp
    blocks), o and down 8, gate|up 2 (one warp would loop over all 28 chunks of K: more than
    MAX_CHUNKS_PER_WARP; the H200 measured 1.110 ms against 1.002 for two); one row tile per block,
    blocks = 16-row tiles. At 120 registers gate|up: 8."""
    want = {"qkv": 4, "o": 8, "gate_up": 2, "down": 8}
    for name, (n, k, _) in QWEN.items():
        for m in (1, 8):
            cfg = C.plan(m, n, k, 132, 112)
            assert cfg["WK"] == want[name], (name, cfg)
            assert cfg["WR"] == 1 and cfg["blocks"] == -(-n // 16) and cfg["threads"] == 32 * cfg["WK"]
            assert cfg["MT"] == 1 and cfg["U"] == 4
    assert C.plan(1, 37888, 3584, 132, 120)["WK"] == 8
    cfg = C.plan(16, 3584, 3584, 132, 128)
    assert cfg["MT"] == 2 and cfg["U"] == 2 and 1 <= cfg["WK"] <= C.MAX_WARPS
    assert C.plan(1, 40, 80, 132)["WK"] == 1  # one chunk of K: one warp
    # 64 chunks and one tile: even 16 warps leave 4 chunks each; 4096 chunks: no WK keeps a warp
    # under the limit, so the score decides alone
    assert C.plan(1, 16, 128 * 64, 132)["WK"] == 16
    assert C.plan(1, 16, 128 * 4096, 132)["WK"] == 16
    with pytest.raises(ValueError):
        C.plan(17, 64, 128)


def test_header_constants_match():
    header = (C.CSRC / "nvfp4_gemv.h").read_text()
    consts = dict(re.findall(r"constexpr int (\w+) = (\d+);", header))
    assert int(consts["kMaxSlices"]) == C.MAX_SLICES and int(consts["kMaxWarps"]) == C.MAX_WARPS
    assert int(consts["kMaxRank"]) == C.MAX_RANK
    assert int(consts["kMaxWarpsPipe2"]) == C.MAX_WARPS_PIPE2
    # the K loops' numbers are LOOPS' order (the binding passes LOOPS.index(loop))
    assert [int(consts[k]) for k in ("kRounds", "kRing", "kPipe", "kPipe2")] == list(range(len(C.LOOPS)))
    # blocks of up to MAX_WARPS warps (MAX_WARPS_PIPE2 for pipe2) must be launchable: the launch bound says so
    assert ("__launch_bounds__(LOOP == kPipe2 ? kMaxWarpsPipe2 * 32 : kMaxWarps * 32) gemv_kernel"
            in (C.CSRC / "nvfp4_gemv.cu").read_text())


def test_loop_configs():
    """config `loop` names one of LOOPS; `ring: True` (the older switch) means the ring; anything else is refused
    by name. pipe2's plan keeps its blocks within MAX_WARPS_PIPE2 warps."""
    assert C.loop_of(None) == C.loop_of({}) == C.loop_of({"repacked": True}) == "rounds"
    assert C.loop_of({"ring": True}) == "ring" and C.loop_of({"loop": "pipe2", "ring": True}) == "pipe2"
    assert [C.loop_of({"loop": name}) for name in C.LOOPS] == list(C.LOOPS)
    with pytest.raises(ValueError, match="'pipe3'"):
        C.loop_of({"loop": "pipe3"})
    # 64 chunks and one tile: 16 warps unless the variant's block limit says 8
    assert C.plan(1, 16, 128 * 64, 132)["WK"] == 16
    assert C.plan(1, 16, 128 * 64, 132, 168, max_warps=C.loop_max_warps("pipe2"))["WK"] == 8
    assert [C.loop_max_warps(loop) for loop in C.LOOPS] == [C.MAX_WARPS] * 3 + [C.MAX_WARPS_PIPE2]


def test_bad_inputs_fail_before_the_gpu():
    """The same ValueErrors as the Triton wrapper, raised on CPU tensors before anything is built; a valid
    CPU call says CUDA tensors only."""
    gen = torch.Generator().manual_seed(0)
    p, s, gs = make_weight(64, 128, "random", gen)
    x = torch.randn(3, 128, generator=gen).to(torch.bfloat16)
    a = torch.randn(4, 128, generator=gen).to(torch.bfloat16)
    b = torch.randn(64, 4, generator=gen).to(torch.bfloat16)
    for fn in (lambda: C.nvfp4_gemv(torch.randn(17, 128).to(torch.bfloat16), p, s, gs),  # too many rows
               lambda: C.nvfp4_gemv(x.float(), p, s, gs),  # float32 activations
               lambda: C.nvfp4_gemv(x, p, s, gs, None, a, b[:60]),  # B rows != N
               lambda: C.nvfp4_gemv(x, p, s[:, :4], gs),  # scale shape
               lambda: C.nvfp4_gemv(x, p, s, torch.ones(3)),  # global scale size
               lambda: C.nvfp4_gemv(x, p[:, :32], s, gs),  # packed width
               lambda: C.nvfp4_gemv(x, p, s, gs, None, [a, a, a, a], [b[:16]] * 4),  # 4 slices
               lambda: C.nvfp4_gemv(x, p, s, gs, None, a, b, 1.0, torch.zeros(2, dtype=torch.long)),  # index
               lambda: C.nvfp4_gemv(x, p, s, gs, torch.zeros(63)),  # bias size
               lambda: C.nvfp4_gemv(x, p, s, gs, None, torch.zeros(65, 128, dtype=torch.bfloat16),
                                    torch.zeros(64, 65, dtype=torch.bfloat16))):  # rank 65
        with pytest.raises(ValueError):
            fn()
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        C.nvfp4_gemv(x, p, s, gs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error path of a machine without a GPU")
def test_load_extension_without_a_gpu_names_nvcc():
    with pytest.raises(RuntimeError, match="nvcc"):
        C.load_extension()
    assert C.available() is False


def test_build_flags_target_the_arch():
    cuda, host = C.build_flags("90")
    assert "-gencode=arch=compute_90,code=sm_90" in cuda and "-O3" in cuda and "-O3" in host
    assert not any("fast_math" in f for f in cuda)  # the epilogue's division and subnormal scales stay exact


@pytest.fixture(scope="module")
def host_test_exe(tmp_path_factory) -> Path:
    """csrc/nvfp4_gemv_host_test.cu built with nvcc for the CPU (skips without nvcc)."""
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc (CPU run of the kernel's per-lane code)")
    exe = tmp_path_factory.mktemp("host") / "qg_host_test"
    build = subprocess.run(["nvcc", "-std=c++17", "-O1", "-o", str(exe), str(C.CSRC / "nvfp4_gemv_host_test.cu")],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    return exe


def test_host_emulation_of_the_kernel(host_test_exe: Path):
    """Every case twice: codes as compressed-tensors writes them, and repacked."""
    run = subprocess.run([str(host_test_exe)], capture_output=True, text=True, timeout=600)
    last = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 0 and re.fullmatch(r"\d+ passed, 0 failed", last), run.stdout[-3000:]
    assert run.stdout.count(" repacked ") == run.stdout.count(" ct ") > 30


def test_repack_codes_is_the_kernels_layout(host_test_exe: Path, tmp_path: Path):
    """`repack_codes` writes what the kernel's `repack_word` defines, and the repacked decode of every word
    gives the bits of the compressed-tensors decode: every byte value in every position of a word, plus
    random words, through the host build (`--check-repack`)."""
    gen = torch.Generator().manual_seed(5)
    every = torch.arange(256, dtype=torch.uint8)
    rows = [torch.stack([every if i == pos else torch.randint(0, 256, (256,), generator=gen, dtype=torch.uint8)
                         for i in range(4)], 1).reshape(-1) for pos in range(4)]
    packed = torch.cat(rows + [torch.randint(0, 256, (4096,), generator=gen, dtype=torch.uint8)]).reshape(-1, 64)
    repacked = C.repack_codes(packed, rows_per_step=7)
    assert repacked.shape == packed.shape and repacked.dtype == torch.uint8
    words = torch.stack([packed.reshape(-1).view(torch.int32), repacked.reshape(-1).view(torch.int32)], 1)
    path = tmp_path / "pairs.bin"
    path.write_bytes(words.numpy().astype("<i4").tobytes())
    run = subprocess.run([str(host_test_exe), "--check-repack", str(path)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip().splitlines()[-1] == f"{words.shape[0]} passed, 0 failed", \
        run.stdout[-2000:]
    # a bijection: distinct words stay distinct, and zero codes stay zero (the kernel's K tail reads zeros)
    assert torch.unique(words[:, 1]).numel() == torch.unique(words[:, 0]).numel()
    assert int(C.repack_codes(torch.zeros(2, 8, dtype=torch.uint8)).abs().sum()) == 0


def test_repack_codes_refuses_other_layouts():
    with pytest.raises(ValueError, match=r"uint8 \[N, K/2\]"):
        C.repack_codes(torch.zeros(4, 6, dtype=torch.uint8))  # K/2 not a multiple of 4
    with pytest.raises(ValueError, match="repack_codes"):
        C.repack_codes(torch.zeros(4, 8, dtype=torch.int32))


# ---------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run_case(m, n, k, kind, lora, per_row_gs, index, gen, dtype=torch.bfloat16, config=None, misalign=False,
             bias_dtype=None, index_dtype=torch.long):
    """One call on the GPU and its reference check; returns (ok, detail, y)."""
    p, s, gs = make_weight(n, k, kind, gen, per_row_gs)
    x = (torch.randn(m, k, generator=gen) * (4.0 if kind == "subnormal" else 1.0)).to(dtype)
    bias = torch.randn(n, generator=gen).to(bias_dtype or dtype)
    a_list = b_list = idx = rows = None
    scale = 0.75
    if lora is not None:
        rank, widths = lora
        a_list = [(torch.randn(rank, k, generator=gen) * 0.1).to(dtype) for _ in widths]
        b_list = [(torch.randn(wd, rank, generator=gen) * 0.1).to(dtype) for wd in widths]
        if index:
            idx = torch.randint(-1, 2, (m + 5,), generator=gen).to(index_dtype)
            rows = idx[:m] == 0
    ref = reference(x, p, s, gs, bias.float(), None if lora is None else (a_list, b_list, scale, rows))
    P = p.cuda()
    if misalign:  # rows 8 bytes off a 16-byte boundary: the kernel's 8-byte path
        big = torch.zeros(n, k // 2 + 8, dtype=torch.uint8, device="cuda")
        big[:, 8:] = P
        P = big[:, 8:]
    cu = lambda t: None if t is None else t.cuda()  # noqa: E731
    y = C.nvfp4_gemv(x.cuda(), P, s.cuda(), gs.cuda(), bias.cuda(), None if a_list is None else [cu(a) for a in a_list],
                     None if b_list is None else [cu(b) for b in b_list], scale, cu(idx), 0, config=config)
    torch.cuda.synchronize()
    ok, detail = within(y, *ref)
    return ok and y.shape == (m, n) and y.dtype == dtype and bool(torch.isfinite(y).all()), detail, y


@gpu
@needs_cuda
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("shape", list(QWEN))
def test_gpu_every_row_count(shape, lora):
    """Every M in 1..16 on the 7B shape: within bf16 rounding of the float32 reference, every output
    written (NaN-poisoned first), a repeat bit-identical."""
    from qerl_lib.nvfp4 import dequantize_nvfp4

    n, k, widths = QWEN[shape]
    gen = torch.Generator().manual_seed(n + k + lora)
    p, s, _ = make_weight(n, k, "codes", gen)
    P, S, GS = p.cuda(), s.cuda(), torch.tensor([150.0], device="cuda")
    rank = 16
    A = [(torch.randn(rank, k, generator=gen) * 0.05).to("cuda", torch.bfloat16) for _ in widths] if lora else None
    B = [(torch.randn(w, rank, generator=gen) * 0.05).to("cuda", torch.bfloat16) for w in widths] if lora else None
    Wd = dequantize_nvfp4(P, S, GS, torch.float32).double()
    failures = []
    for m in ROWS:
        x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
        idx = torch.randint(-1, 1, (m,), generator=gen).cuda() if lora else None
        _poison()
        y = C.nvfp4_gemv(x, P, S, GS, None, A, B, 1.0, idx, 0)
        y2 = C.nvfp4_gemv(x, P, S, GS, None, A, B, 1.0, idx, 0)
        torch.cuda.synchronize()
        xd = x.double()
        ref, bound = xd @ Wd.T, xd.abs() @ Wd.abs().T
        lb = torch.zeros_like(ref)
        if lora:
            lo = torch.cat([(xd @ a.double().T) @ b.double().T for a, b in zip(A, B)], 1)
            ref = ref + lo * (idx == 0).double()[:, None]
            lb = torch.cat([(xd.abs() @ a.double().abs().T) @ b.double().abs().T for a, b in zip(A, B)], 1)
        ok, detail = within(y, ref, bound, lb)
        if not ok or not torch.isfinite(y).all() or not torch.equal(y, y2):
            failures.append(f"m={m}: {detail} finite={bool(torch.isfinite(y).all())} repeat={torch.equal(y, y2)}")
    assert not failures, "\n".join(failures[:10])


@gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["max", "zero", "subnormal", "random", "codes"])
def test_gpu_adversarial_and_tails(kind):
    """Adversarial codes, K tails (K % 128, K % 32 = 16), N not a multiple of 16, misaligned code rows,
    per-row global scales, explicit launch configurations (several row tiles per block, K split over
    1..16 warps), float32 bias, int32 slots."""
    gen = torch.Generator().manual_seed(7)
    cases = [  # m, n, k, lora, config, misalign
        (1, 512, 3584, None, None, False), (13, 1000, 400, (8, [600, 400]), None, False),
        (16, 384, 1024, (16, [128, 128, 128]), None, False), (5, 256, 512, None, {"WR": 2, "WK": 2}, False),
        (3, 72, 80, (8, [72]), None, False), (7, 33, 208, None, {"WR": 1, "WK": 3}, False),
        (9, 130, 336, (4, [64, 66]), {"WR": 2, "WK": 8}, True), (2, 48, 2048, None, {"WR": 1, "WK": 16}, True),
        (8, 64, 1024, None, {"WR": 4, "WK": 4}, False), (4, 96, 640, (16, [32, 32, 32]), {"WR": 1, "WK": 1}, False),
    ]
    for m, n, k, lora, cfg, mis in cases:
        ok, detail, _ = run_case(m, n, k, kind, lora, kind == "random", lora is not None, gen, config=cfg,
                                 misalign=mis, bias_dtype=torch.float32 if m % 2 else None,
                                 index_dtype=torch.int32 if m % 3 == 0 else torch.long)
        assert ok, f"{kind} m={m} n={n} k={k} cfg={cfg} misalign={mis}: {detail}"


@gpu
@needs_cuda
def test_gpu_fp16():
    gen = torch.Generator().manual_seed(8)
    for m in (1, 8, 16):
        ok, detail, _ = run_case(m, 4608, 3584, "random", (16, [3584, 512, 512]), False, True, gen, dtype=torch.float16)
        assert ok, f"m={m}: {detail}"


@gpu
@needs_cuda
def test_gpu_configs_agree():
    """Every launch configuration of one call gives the reference's result (summation orders differ, so
    within the criterion rather than bit-identical); a config is repeatable bit for bit."""
    for cfg in ({"WR": 1, "WK": 1}, {"WR": 1, "WK": 4}, {"WR": 2, "WK": 8}, {"WR": 1, "WK": 16}, {"WR": 4, "WK": 2}):
        ok, detail, y = run_case(6, 3584, 3584, "codes", (16, [3584]), False, True, torch.Generator().manual_seed(1),
                                 config=cfg)
        assert ok, f"{cfg}: {detail}"
        _, _, y2 = run_case(6, 3584, 3584, "codes", (16, [3584]), False, True, torch.Generator().manual_seed(1),
                            config=cfg)
        assert torch.equal(y, y2), cfg


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 5, 8, 11, 16])
def test_gpu_repacked_equals_compressed_tensors(m):
    """The kernel on `repack_codes(packed)` with config repacked=True (and with every K loop: ring, pipe, pipe2)
    decodes the same bits as on `packed` and runs the same MMAs in the same order: equal outputs bit for bit, at every
    WK (tail chunks, a partial last chunk, sets past K), misaligned code rows, fp16, with and without LoRA."""
    gen = torch.Generator().manual_seed(100 + m)
    for n, k, wk, dtype in ((4608, 3584, 4, torch.bfloat16), (3584, 18944, 8, torch.bfloat16),
                            (520, 2128, 2, torch.bfloat16), (64, 16 * 37, 3, torch.float16), (48, 256, 1, torch.float16)):
        p, s, gs = (t.cuda() for t in make_weight(n, k, "codes", gen))
        r = C.repack_codes(p)
        x = torch.randn(m, k, generator=gen).to("cuda", dtype)
        a = (torch.randn(16, k, generator=gen) * 0.05).to("cuda", dtype)
        b = (torch.randn(n, 16, generator=gen) * 0.05).to("cuda", dtype)
        for lora in ((), (a, b, 0.5)):
            y = C.nvfp4_gemv(x, p, s, gs, None, *lora, config={"WR": 1, "WK": wk})
            y_r = C.nvfp4_gemv(x, r, s, gs, None, *lora, config={"WR": 1, "WK": wk, "repacked": True})
            assert torch.equal(y, y_r), (m, n, k, wk, bool(lora))
            for loop in ("ring", "pipe", "pipe2"):
                y_loop = C.nvfp4_gemv(x, r, s, gs, None, *lora, config={"WR": 1, "WK": wk, "repacked": True,
                                                                         "loop": loop})
                assert torch.equal(y, y_loop), (loop, m, n, k, wk, bool(lora))
    # code rows 8-byte but not 16-byte aligned (the kernel's unaligned loads), and the plan's own config
    p, s, gs = (t.cuda() for t in make_weight(64, 1024, "random", gen))
    wide = torch.zeros(64, 512 + 8, dtype=torch.uint8, device="cuda")
    wide[:, :512] = p
    wide_r = wide.clone()
    wide_r[:, :512] = C.repack_codes(p)
    x = torch.randn(m, 1024, generator=gen).to("cuda", torch.bfloat16)
    y = C.nvfp4_gemv(x, wide[:, :512], s, gs)
    assert torch.equal(y, C.nvfp4_gemv(x, wide_r[:, :512], s, gs, config={"repacked": True}))
    assert torch.equal(y, C.nvfp4_gemv(x, wide_r[:, :512], s, gs, config={"repacked": True, "ring": True}))
    for loop in ("pipe", "pipe2"):  # their own plans: 8 chunks, so WK 8 here (at most 8 for pipe2)
        assert torch.equal(y, C.nvfp4_gemv(x, wide_r[:, :512], s, gs, config={"repacked": True, "loop": loop}))
    with pytest.raises(ValueError, match="1..8 warps"):
        C.nvfp4_gemv(x, wide_r[:, :512], s, gs, config={"repacked": True, "loop": "pipe2", "WR": 1, "WK": 16})


@gpu
@needs_cuda
def test_gpu_matches_triton():
    """The CUDA and Triton kernels agree on the down projection, LoRA included (two bf16 roundings of
    float32 sums in different orders: a relative difference of a few 1e-3; a wrong weight gives ~1)."""
    from qerl_lib.kernels.nvfp4_gemv import nvfp4_gemv as triton_gemv

    gen = torch.Generator().manual_seed(11)
    p, s, gs = (t.cuda() for t in make_weight(3584, 18944, "random", gen))
    a = (torch.randn(16, 18944, generator=gen) * 0.05).to("cuda", torch.bfloat16)
    b = (torch.randn(3584, 16, generator=gen) * 0.05).to("cuda", torch.bfloat16)
    for m in (1, 4, 16):
        x = torch.randn(m, 18944, generator=gen).to("cuda", torch.bfloat16)
        y_c = C.nvfp4_gemv(x, p, s, gs, None, a, b, 0.5)
        y_t = triton_gemv(x, p, s, gs, None, a, b, 0.5)
        rel = float((y_c.float() - y_t.float()).norm() / y_t.float().norm())
        assert rel < 1e-2, f"m={m}: rel {rel}"


@gpu
@needs_cuda
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_cuda_graph_replay(pdl):
    """The custom op captured in a CUDA graph replays with new inputs and slots like an eager call (LoRA
    shrink + GEMV; with PDL the GEMV is a programmatic dependent launch)."""
    op = C.register_op()
    gen = torch.Generator().manual_seed(9)
    P, S, GS = (t.cuda() for t in make_weight(4608, 3584, "random", gen))
    a = [(torch.randn(16, 3584, generator=gen) * 0.05).to("cuda", torch.bfloat16) for _ in range(3)]
    b = [(torch.randn(w, 16, generator=gen) * 0.05).to("cuda", torch.bfloat16) for w in (3584, 512, 512)]
    idx = torch.zeros(8, dtype=torch.long, device="cuda")
    x = torch.randn(8, 3584, generator=gen).to("cuda", torch.bfloat16)
    old = C.os.environ.get(C.PDL_ENV)
    C.os.environ[C.PDL_ENV] = "1" if pdl else "0"
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            op(x, P, S, GS, None, a, b, 1.0, idx, 0)  # eager first: builds and loads the extension
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                y = op(x, P, S, GS, None, a, b, 1.0, idx, 0)
        torch.cuda.current_stream().wait_stream(stream)
        for trial in range(3):
            x.copy_(torch.randn(8, 3584, generator=gen).to("cuda", torch.bfloat16))
            idx.copy_(torch.tensor([0, -1] * 4) if trial % 2 else torch.tensor([0, 0, 1, 0, -1, 0, 0, 0]))
            graph.replay()
            torch.cuda.synchronize()
            want = C.nvfp4_gemv(x, P, S, GS, None, a, b, 1.0, idx, 0)
            assert torch.equal(y, want), f"replay {trial} differs from an eager call"
    finally:
        if old is None:
            C.os.environ.pop(C.PDL_ENV, None)
        else:
            C.os.environ[C.PDL_ENV] = old


@gpu
@needs_cuda
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_pdl_chain(graph):
    """GEMVs that feed each other directly (y of one is x of the next, square W) as programmatic dependent
    launches, eager and in a CUDA graph, equal the same chain without PDL: a GEMV that read x before its
    producer finished would differ (the first layer's x is rewritten just before, by a copy)."""
    gen = torch.Generator().manual_seed(13)
    ws = [tuple(t.cuda() for t in make_weight(3584, 3584, "random", gen)) for _ in range(6)]
    x0 = torch.randn(4, 3584, generator=gen).to("cuda", torch.bfloat16)
    src = torch.randn(4, 3584, generator=gen).to("cuda", torch.bfloat16)

    def chain(pdl):
        x0.copy_(src)
        y = x0
        for p, s, gs in ws:
            y = C.nvfp4_gemv(y, p, s, gs, config={"pdl": pdl})  # grows ~3x per layer: no overflow in 6
        return y

    want = chain(False).clone()
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            chain(True)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                out = chain(True)
        torch.cuda.current_stream().wait_stream(stream)
        for _ in range(3):
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want)
    else:
        for _ in range(3):
            assert torch.equal(chain(True), want)


@gpu
@needs_cuda
def test_gpu_opcheck():
    op = C.register_op()
    gen = torch.Generator().manual_seed(12)
    p, s, gs = (t.cuda() for t in make_weight(64, 256, "random", gen))
    x = torch.randn(5, 256, generator=gen).to("cuda", torch.bfloat16)
    a = (torch.randn(4, 256, generator=gen) * 0.1).to("cuda", torch.bfloat16)
    b = (torch.randn(64, 4, generator=gen) * 0.1).to("cuda", torch.bfloat16)
    idx = torch.tensor([0, -1, 0, 1, 0], device="cuda")
    args = (x, p, s.view(torch.uint8), gs, None, [a], [b], 0.5, idx, 0)
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    assert torch.equal(torch.ops.qerl.nvfp4_gemv_cuda(*args), C.nvfp4_gemv(x, p, s, gs, None, a, b, 0.5, idx, 0))
    assert C.kernel_regs(True, 1, True) > 0
