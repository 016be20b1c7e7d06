"""The worker's decode-GEMM switch at model load, on the CPU: `qerl_lib.rollout.vllm_worker`'s patch of
vLLM's compressed-tensors linear method, driven against a stand-in for that one vLLM class (vLLM itself is
GPU-side). Each case runs in a fresh interpreter: the patch registers torch custom ops once per process.

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
    if mode == "builds":
        nvfp4_gemv_cuda.load_extension = lambda: object()
    else:
        def broken():
            raise RuntimeError("nvfp4_gemv_cuda: building the CUDA extension failed (no nvcc here)")
        nvfp4_gemv_cuda.load_extension = broken

    from qerl_lib.rollout import vllm_worker as W

    gemv_calls = []

    def fake_gemv_function(rows, kernel):
        def gemv(x, packed, scale, gs, bias=None, *lora):
            gemv_calls.append((kernel, rows, tuple(packed.shape), gs.tolist()))
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
           "fallback": W._STATE.get("gemv_fallback")}
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


def test_auto_keeps_marlin_and_says_why_when_the_build_fails():
    out = _run("broken")
    assert out["calls"] == ["process"] and not out["hybrid"]
    assert out["gemv_rows"] == 0 and out["gemv_calls"] == []
    assert "no nvcc here" in out["fallback"]
    assert out["applied"] == [["marlin", 1], ["marlin", 8], ["marlin", 9]]


def test_cuda_by_name_fails_the_load_with_the_build_error():
    out = _run("cuda-broken")
    assert "no nvcc here" in out["error"]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
