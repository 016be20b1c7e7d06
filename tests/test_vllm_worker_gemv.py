"""The worker's decode-GEMM switch on the CPU (`qerl_lib.rollout.vllm_gemv`, `qerl_lib.rollout.vllm_worker`;
vLLM itself is GPU-side, test_vllm_gemv_gpu.py runs it there).

First, at model load: the worker's patch of vLLM's compressed-tensors linear method, driven against a
stand-in for that one vLLM class. Each case runs in a fresh interpreter: the patch registers torch custom
ops once per process. Then the switch's pure parts: the environment variables, the kernel choice, the views
of vLLM's LoRA buffers, and what `rollout.vllm_gemv_*` passes to the engine and to `vllm serve`.

What it pins down (`rollout.vllm_gemv_kernel: auto`, the default): when the CUDA extension builds, an
NVFP4 layer keeps its compressed-tensors codes for the decode GEMM and steps of at most 8 rows go to it;
when the build fails, the layer is left to vLLM's own method (Marlin) at every row count and the reason
is kept for `qerl_linear_info`; `cuda` named explicitly fails the load with the build error.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from qerl_lib.kernels import nvfp4_gemv_cuda as C

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent('''
    import json, os, sys, types
    import torch

    # A stand-in for the one vLLM class the patch wraps; `import vllm` must succeed for the patch to install.
    calls = []

    class CompressedTensorsLinearMethod:
        def process_weights_after_loading(self, layer):
            calls.append("process")  # Marlin would repack layer.weight_packed here

        def apply(self, layer, x, bias=None):
            calls.append(("marlin", x.shape[0]))
            return x.new_zeros((x.shape[0], layer.output_size_per_partition))

    names = ["vllm", "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.quantization",
             "vllm.model_executor.layers.quantization.compressed_tensors",
             "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors"]
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    sys.modules[names[-1]].CompressedTensorsLinearMethod = CompressedTensorsLinearMethod

    from qerl_lib.kernels import nvfp4_gemv_cuda

    mode = sys.argv[1]
    if mode == "builds-repack":
        os.environ["QERL_VLLM_GEMV_REPACK"] = "1"
    if mode.startswith("builds"):
        nvfp4_gemv_cuda.load_extension = lambda: object()
    else:
        def broken():
            raise RuntimeError("nvfp4_gemv_cuda: building the CUDA extension failed (no nvcc here)")
        nvfp4_gemv_cuda.load_extension = broken

    from qerl_lib.rollout import vllm_worker as W

    gemv_calls = []

    def fake_gemv_function(rows, kernel, repacked=False):
        def gemv(x, packed, scale, gs, bias=None, *lora):
            gemv_calls.append((kernel, rows, tuple(packed.shape), gs.tolist(), repacked))
            return x.new_ones((x.shape[0], packed.shape[0]))
        return gemv

    W.gemv_function = fake_gemv_function

    class CompressedTensorsW4A4Fp4:
        use_a16 = True

    n, k = 48, 64
    layer = torch.nn.Module()
    layer.scheme = CompressedTensorsW4A4Fp4()
    layer.weight_packed = torch.nn.Parameter(torch.randint(0, 255, (n, k // 2), dtype=torch.uint8), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(torch.ones(n, k // 16).to(torch.float8_e4m3fn), requires_grad=False)
    layer.weight_global_scale = torch.nn.Parameter(torch.tensor([2.0, 3.0]), requires_grad=False)
    layer.logical_widths = [32, 16]
    layer.output_size_per_partition = n
    layer.bias = None

    os.environ["QERL_VLLM_GEMV_ROWS"] = "8"
    os.environ["QERL_VLLM_GEMV_KERNEL"] = "cuda" if mode == "cuda-broken" else "auto"
    os.environ.pop("QERL_VLLM_DENSE_ABOVE", None)
    method = CompressedTensorsLinearMethod()
    try:
        method.process_weights_after_loading(layer)
    except RuntimeError as e:
        print(json.dumps({"error": str(e)}))
        sys.exit(0)
    out = {"calls": calls[:], "hybrid": getattr(layer, "qerl_hybrid_index", None) is not None,
           "gemv_rows": W._STATE["gemv_rows"], "gemv_kernel": W._STATE["gemv_kernel"],
           "fallback": W._STATE["gemv_resolved"][2], "repacked": W._STATE["gemv_repacked"]}
    if getattr(layer, "qerl_gemv", None) is not None:  # the GEMV's codes: the layer's, or them repacked
        codes = layer.qerl_gemv[0]
        out["codes_equal"] = bool(torch.equal(codes, layer.weight_packed.data))
        out["codes_unrepack_equal"] = bool(torch.equal(nvfp4_gemv_cuda.unrepack_codes(codes), layer.weight_packed.data))
        out["codes_repack_equal"] = bool(torch.equal(codes, nvfp4_gemv_cuda.repack_codes(layer.weight_packed.data)))
    for rows in (1, 8, 9):
        method.apply(layer, torch.zeros(rows, k, dtype=torch.bfloat16))
    out["applied"] = calls[len(out["calls"]):]
    out["gemv_calls"] = gemv_calls
    print(json.dumps(out))
''')


def _run(mode: str) -> dict:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "QERL_CACHE_DIR": "/nonexistent"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_auto_serves_small_steps_when_the_extension_builds():
    out = _run("builds")
    assert out["calls"] == ["process"] and out["hybrid"]
    assert (out["gemv_rows"], out["gemv_kernel"], out["fallback"]) == (8, "cuda", None)
    # rows 1 and 8 go to the decode GEMM (compressed-tensors codes, one global scale per output row), 9 to Marlin
    assert [c[:3] for c in out["gemv_calls"]] == [["cuda", 1, [48, 32]], ["cuda", 8, [48, 32]]]
    assert out["gemv_calls"][0][3] == [2.0] * 32 + [3.0] * 16
    assert out["applied"] == [["marlin", 9]]


def test_repack_switch_gives_the_cuda_kernel_repacked_codes():
    """QERL_VLLM_GEMV_REPACK=1 (rollout_throughput's `-rp` engines): the decode GEMM's copy of the codes is
    `repack_codes` of the layer's, the calls say so; without it the copy is the layer's codes as they are."""
    plain, rp = _run("builds"), _run("builds-repack")
    assert not plain["repacked"] and plain["codes_equal"] and not plain["codes_repack_equal"]
    assert rp["repacked"] and rp["codes_repack_equal"] and rp["codes_unrepack_equal"] and not rp["codes_equal"]
    assert [c[4] for c in plain["gemv_calls"]] == [False, False] and [c[4] for c in rp["gemv_calls"]] == [True, True]
    assert rp["applied"] == [["marlin", 9]]


def test_gemv_function_reads_repacked_codes_with_the_cuda_kernel_only():
    from functools import partial

    from qerl_lib.kernels import nvfp4_gemv as T
    from qerl_lib.rollout.vllm_gemv import gemv_function

    f = gemv_function(8, "cuda", repacked=True)
    assert isinstance(f, partial) and f.func is C.nvfp4_gemv and f.keywords == {"config": {"repacked": True}}
    assert gemv_function(8, "cuda") is C.nvfp4_gemv and gemv_function(32, "cuda") is T.nvfp4_gemv
    with pytest.raises(ValueError, match="CUDA kernel only"):
        gemv_function(32, "cuda", repacked=True)
    with pytest.raises(ValueError, match="CUDA kernel only"):
        gemv_function(4, "triton", repacked=True)


def test_unrepack_inverts_repack():
    gen = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (37, 40), dtype=torch.uint8, generator=gen)
    r = C.repack_codes(packed, rows_per_step=5)
    assert not torch.equal(r, packed) and torch.equal(C.unrepack_codes(r, rows_per_step=9), packed)
    with pytest.raises(ValueError, match="unrepack_codes"):
        C.unrepack_codes(torch.zeros(3, 6, dtype=torch.uint8))


def test_auto_keeps_marlin_and_says_why_when_the_build_fails():
    out = _run("broken")
    assert out["calls"] == ["process"] and not out["hybrid"]
    assert out["gemv_rows"] == 0 and out["gemv_calls"] == []
    assert "no nvcc here" in out["fallback"]
    assert out["applied"] == [["marlin", 1], ["marlin", 8], ["marlin", 9]]


def test_cuda_by_name_fails_the_load_with_the_build_error():
    out = _run("cuda-broken")
    assert "no nvcc here" in out["error"]


# ---------------------------------------------------------------------------------------
# The switch's pure parts: environment, kernel choice, LoRA views, what reaches the engine
# ---------------------------------------------------------------------------------------


def test_worker_gemv_rows_env(monkeypatch):
    from qerl_lib.rollout.vllm_gemv import GEMV_ROWS_ENV, gemv_rows_from_env

    for raw, want in (("", None), ("0", None), ("off", None), ("16", 16), (" 48 ", 48)):
        monkeypatch.setenv(GEMV_ROWS_ENV, raw)
        assert gemv_rows_from_env() == want
    monkeypatch.delenv(GEMV_ROWS_ENV)
    assert gemv_rows_from_env() is None
    monkeypatch.setenv(GEMV_ROWS_ENV, "65")
    with pytest.raises(ValueError):
        gemv_rows_from_env()


def test_gemv_rows_reaches_the_served_engine(tmp_path):
    """`rollout.vllm_gemv_rows` (8 by default) becomes the worker's `QERL_VLLM_GEMV_ROWS` for `vllm serve`
    of an NVFP4 base; 0, or a BF16 base, sets nothing, so vLLM's own path (and its compile cache) stays."""
    from qerl_lib.config import QerlConfig
    from qerl_lib.rollout.serve import vllm_command
    from qerl_lib.rollout.vllm_gemv import GEMV_ROWS_ENV

    (tmp_path / "config.json").write_text('{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}')
    cfg = QerlConfig()
    assert cfg.model.quant == "nvfp4" and cfg.rollout.vllm_gemv_rows == 8
    _, env = vllm_command(cfg, tmp_path, "127.0.0.1", 8000)
    assert env[GEMV_ROWS_ENV] == "8" and env["VLLM_DISABLE_COMPILE_CACHE"] == "1"
    cfg.rollout.vllm_gemv_rows = 16
    _, env = vllm_command(cfg, tmp_path, "127.0.0.1", 8000)
    assert env[GEMV_ROWS_ENV] == "16"
    cfg.rollout.vllm_gemv_rows = 0
    _, env = vllm_command(cfg, tmp_path, "127.0.0.1", 8000)
    assert GEMV_ROWS_ENV not in env
    bf16 = QerlConfig.model_validate({"model": {"quant": "bf16"}})
    assert bf16.rollout.vllm_gemv_rows == 8
    _, env = vllm_command(bf16, tmp_path, "127.0.0.1", 8000)
    assert GEMV_ROWS_ENV not in env


def test_engine_gets_gemv_rows_only_for_nvfp4():
    from qerl_lib.config import QerlConfig
    from qerl_lib.policy import gemv_rows_for

    assert gemv_rows_for(QerlConfig()) == 8
    assert gemv_rows_for(QerlConfig.model_validate({"rollout": {"vllm_gemv_rows": 0}})) is None
    for quant in ("bf16", "nf4"):
        assert gemv_rows_for(QerlConfig.model_validate({"model": {"quant": quant}})) is None


def test_worker_partition_scales():
    from qerl_lib.rollout.vllm_gemv import partition_scales

    got = partition_scales(torch.tensor([2.0, 5.0, 7.0]), [3, 1, 2])
    assert got.dtype == torch.float32 and got.tolist() == [2.0, 2.0, 2.0, 5.0, 7.0, 7.0]
    with pytest.raises(ValueError):
        partition_scales(torch.tensor([2.0]), [3, 1])


def test_worker_gemv_lora_views():
    """The fused path takes zero-copy slot-0 views of vLLM's stacked LoRA buffers and the per-token slots;
    engines with more than one slot, another dtype, or B slices not covering the rows keep vLLM's path."""
    from types import SimpleNamespace

    from qerl_lib.rollout.vllm_gemv import _gemv_lora

    def wrapper(max_loras=1, dtype=torch.bfloat16, widths=(64, 16, 16), out=96):
        a = tuple(torch.zeros(max_loras, 1, 16, 32, dtype=dtype) for _ in widths)
        b = tuple(torch.zeros(max_loras, 1, w, 16, dtype=dtype) for w in widths)
        base = SimpleNamespace(output_size_per_partition=out, params_dtype=torch.bfloat16)
        return SimpleNamespace(lora_a_stacked=a, lora_b_stacked=b, base_layer=base,
                               punica_wrapper=SimpleNamespace(_token_lora_indices=torch.zeros(256, dtype=torch.long)))

    w = wrapper()
    a, b, slots = _gemv_lora(w)
    assert [t.shape for t in a] == [(16, 32)] * 3 and [tuple(t.shape) for t in b] == [(64, 16), (16, 16), (16, 16)]
    assert all(t.data_ptr() == s.data_ptr() for t, s in zip(a + b, w.lora_a_stacked + w.lora_b_stacked))
    assert slots is w.punica_wrapper._token_lora_indices
    assert _gemv_lora(wrapper(max_loras=2)) is None
    assert _gemv_lora(wrapper(dtype=torch.float16)) is None
    assert _gemv_lora(wrapper(out=100)) is None
    assert _gemv_lora(wrapper(), max_rank=16) is not None
    assert _gemv_lora(wrapper(), max_rank=8) is None  # the CUDA kernel's rank cap: vLLM's LoRA path instead


def test_worker_gemv_kernel_env(monkeypatch):
    from qerl_lib.rollout.vllm_gemv import GEMV_KERNEL_ENV, gemv_kernel_from_env

    monkeypatch.delenv(GEMV_KERNEL_ENV, raising=False)
    assert gemv_kernel_from_env() == "triton"
    for raw, want in (("", "triton"), ("triton", "triton"), (" CUDA ", "cuda")):
        monkeypatch.setenv(GEMV_KERNEL_ENV, raw)
        assert gemv_kernel_from_env() == want
    monkeypatch.setenv(GEMV_KERNEL_ENV, "marlin")
    with pytest.raises(ValueError):
        gemv_kernel_from_env()


def test_worker_resolves_auto(monkeypatch):
    """`auto` is the CUDA kernel, capped at its 16 rows, when the extension builds; when the build fails
    the decode GEMM is off (Marlin) with the reason; `cuda` named explicitly raises the build error."""
    from qerl_lib.rollout.vllm_gemv import resolve_kernel

    monkeypatch.setattr(C, "load_extension", lambda: object())
    assert resolve_kernel("auto", 8) == ("cuda", 8, None)
    assert resolve_kernel("auto", 32) == ("cuda", C.MAX_ROWS, None)
    assert resolve_kernel("cuda", 32) == ("cuda", 32, None)  # larger steps keep Triton (gemv_function)
    assert resolve_kernel("triton", 32) == ("triton", 32, None)

    def broken():
        raise RuntimeError("nvfp4_gemv_cuda: building the CUDA extension failed (no nvcc)")

    monkeypatch.setattr(C, "load_extension", broken)
    kernel, rows, why = resolve_kernel("auto", 8)
    assert (kernel, rows) == (None, 0) and "no nvcc" in why and why.startswith("RuntimeError")
    with pytest.raises(RuntimeError, match="no nvcc"):
        resolve_kernel("cuda", 8)
    assert resolve_kernel("triton", 8) == ("triton", 8, None)
    with pytest.raises(ValueError):
        resolve_kernel("marlin", 8)


def test_worker_gemv_function_dispatch():
    """`cuda` serves steps of at most 16 rows with the CUDA kernel; larger steps and `triton` keep Triton."""
    pytest.importorskip("triton")
    from qerl_lib.kernels import nvfp4_gemv as T
    from qerl_lib.rollout.vllm_gemv import gemv_function

    assert gemv_function(1, "cuda") is C.nvfp4_gemv and gemv_function(16, "cuda") is C.nvfp4_gemv
    assert gemv_function(17, "cuda") is T.nvfp4_gemv and gemv_function(4, "triton") is T.nvfp4_gemv


def test_gemv_kernel_reaches_the_served_engine(tmp_path):
    """`rollout.vllm_gemv_kernel` travels with `vllm_gemv_rows` as `QERL_VLLM_GEMV_KERNEL`; without rows, neither."""
    from qerl_lib.config import QerlConfig
    from qerl_lib.rollout.serve import vllm_command
    from qerl_lib.rollout.vllm_engine import VLLMEngine
    from qerl_lib.rollout.vllm_gemv import GEMV_KERNEL_ENV

    (tmp_path / "config.json").write_text('{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}')
    cfg = QerlConfig()
    assert cfg.rollout.vllm_gemv_kernel == "auto"
    _, env = vllm_command(cfg, tmp_path, "127.0.0.1", 8000)
    assert env[GEMV_KERNEL_ENV] == "auto"
    cfg.rollout.vllm_gemv_kernel = "cuda"
    cfg.rollout.vllm_gemv_rows = 0
    _, env = vllm_command(cfg, tmp_path, "127.0.0.1", 8000)
    assert GEMV_KERNEL_ENV not in env
    cfg.rollout.vllm_gemv_rows = 16
    _, env = vllm_command(cfg, tmp_path, "127.0.0.1", 8000)
    assert env[GEMV_KERNEL_ENV] == "cuda"
    with pytest.raises(ValueError):
        VLLMEngine(tmp_path, gemv_kernel="marlin", llm=object())


def test_gemv_pdl_reaches_the_served_engine(tmp_path):
    """`rollout.vllm_gemv_pdl` (on by default) travels with the decode GEMM as `QERL_GEMV_PDL=1`, the
    variable the CUDA kernel reads; off, or without the decode GEMM, the served engine has none."""
    from qerl_lib.config import QerlConfig
    from qerl_lib.kernels.nvfp4_gemv_cuda import PDL_ENV
    from qerl_lib.rollout.serve import vllm_command
    from qerl_lib.rollout.vllm_gemv import GEMV_PDL_ENV

    assert GEMV_PDL_ENV == PDL_ENV
    (tmp_path / "config.json").write_text('{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}')
    cfg = QerlConfig()
    assert cfg.rollout.vllm_gemv_pdl is True
    _, env = vllm_command(cfg, tmp_path, "127.0.0.1", 8000)
    assert env[GEMV_PDL_ENV] == "1"
    cfg.rollout.vllm_gemv_pdl = False
    _, env = vllm_command(cfg, tmp_path, "127.0.0.1", 8000)
    assert GEMV_PDL_ENV not in env
    cfg.rollout.vllm_gemv_pdl = True
    cfg.rollout.vllm_gemv_rows = 0
    _, env = vllm_command(cfg, tmp_path, "127.0.0.1", 8000)
    assert GEMV_PDL_ENV not in env


def test_gemv_repack_reaches_the_served_engine_and_the_policy_engine(tmp_path, monkeypatch):
    """`rollout.vllm_gemv_repack` (on by default, measured faster on the H200) travels with the decode GEMM
    as `QERL_VLLM_GEMV_REPACK=1` to the served engine and as `gemv_repack` to the in-process one; off, or
    without the decode GEMM, neither has it."""
    from qerl_lib import policy
    from qerl_lib.config import QerlConfig
    from qerl_lib.rollout.serve import vllm_command
    from qerl_lib.rollout.vllm_gemv import GEMV_REPACK_ENV

    (tmp_path / "config.json").write_text('{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}')
    cfg = QerlConfig()
    assert cfg.rollout.vllm_gemv_repack is True
    _, env = vllm_command(cfg, tmp_path, "127.0.0.1", 8000)
    assert env[GEMV_REPACK_ENV] == "1"
    cfg.rollout.vllm_gemv_repack = False
    _, env = vllm_command(cfg, tmp_path, "127.0.0.1", 8000)
    assert GEMV_REPACK_ENV not in env
    cfg.rollout.vllm_gemv_repack = True
    cfg.rollout.vllm_gemv_rows = 0
    _, env = vllm_command(cfg, tmp_path, "127.0.0.1", 8000)
    assert GEMV_REPACK_ENV not in env

    # the two settings are two engines: the key that caches one tells them apart
    cfg = QerlConfig()
    on = policy._engine_key(cfg, tmp_path)
    cfg.rollout.vllm_gemv_repack = False
    assert policy._engine_key(cfg, tmp_path) != on


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
