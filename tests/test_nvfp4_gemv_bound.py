"""benchmarks/nvfp4_gemv_bound.py on the CPU: its read-only kernels compile for sm_90 (where nvcc is),
and without a GPU it stops with a message instead of a traceback. The timings need the H200."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import nvfp4_gemv_bound as B  # noqa: E402


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_read_kernels_compile_for_sm90(tmp_path: Path):
    # the kernels without the torch binding (torch's CUDA headers are not in the CPU wheel)
    kernels = B.CUDA_SRC.split("void pattern(")[0]
    kernels = "\n".join(line for line in kernels.splitlines() if "torch/" not in line and "c10/" not in line)
    src = tmp_path / "bound.cu"
    src.write_text(kernels + "\ntemplate __global__ void read_pattern<4>(const uint8_t*, const uint8_t*, int, int, "
                   "uint32_t*);\n")
    out = subprocess.run(["nvcc", "-O3", "-std=c++17", "-arch=sm_90", "-cubin", "-Xptxas=-v", "-o",
                          str(tmp_path / "bound.cubin"), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # both kernels reach ptxas, and neither spills (a spill would time local memory, not the reads)
    assert out.stderr.count("Compiling entry function") == 2, out.stderr
    assert "spill stores" in out.stderr and " 0 bytes spill stores" in out.stderr
    assert all(" 0 bytes spill stores" in line for line in out.stderr.splitlines() if "spill stores" in line)


def test_without_a_gpu_it_says_so(tmp_path: Path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["nvfp4_gemv_bound.py", "--out", str(tmp_path / "b.json")])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        B.main()
    assert not (tmp_path / "b.json").exists()


def test_an_unknown_arm_is_refused_before_anything_runs(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["nvfp4_gemv_bound.py", "--out", str(tmp_path / "b.json"),
                                      "--arms", "gemv_repacked,gemv_pipe3"])
    with pytest.raises(SystemExit, match=r"--arms: unknown \['gemv_pipe3'\]; known: gemv, read_pattern"):
        B.main()
    assert not (tmp_path / "b.json").exists()
    assert {"gemv_pipe", "gemv_pipe2_l2_resident", "gemv_ring"} <= set(B.ARMS)
