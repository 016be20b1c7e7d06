"""Pieces of `benchmarks/train_step.py` that run without a GPU: arm names and backend registration."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import train_step as ts  # noqa: E402


@pytest.mark.parametrize("arm, parts", [
    ("nvfp4-dq:full", ("nvfp4", "dq", "full")),
    ("nvfp4-auto", ("nvfp4", "auto", "chunked")),
    ("bf16", ("bf16", None, "chunked")),
    ("nf4:full", ("nf4", None, "full")),
])
def test_arm_parts(arm, parts):
    assert ts.arm_parts(arm) == parts


@pytest.mark.parametrize("backend, name", [
    ("torch", "torch"), ("dq", "triton-dq"), ("auto", "triton<={rows}<triton-dq"), ("triton", "triton"),
])
def test_set_backend_registers_the_named_cuda_backend(backend, name, monkeypatch):
    from qerl_lib import nvfp4_linear as nl

    if backend != "torch":
        pytest.importorskip("triton")
    monkeypatch.setattr(nl, "_BACKENDS", {})
    monkeypatch.setattr(nl, "_CHOSEN", set())
    ts.set_backend(backend)
    assert nl._BACKENDS["cuda"].name == name.format(rows=nl.DENSE_ABOVE_ROWS)
