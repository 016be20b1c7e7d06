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
    ("nvfp4-dq:offload:mlpchunk1152", ("nvfp4", "dq", "offload")),
    ("bf16:mlpchunk", ("bf16", None, "chunked")),
])
def test_arm_parts(arm, parts):
    assert ts.arm_parts(arm) == parts


def test_mlp_chunk_arms_are_parsed_validated_and_named_with_their_size():
    import argparse

    assert ts.split_mlp_chunk("bf16:offload:mlpchunk576") == ("bf16:offload", 576)
    assert ts.split_mlp_chunk("bf16:offload") == ("bf16:offload", 0)
    assert ts.split_mlp_chunk("bf16:mlpchunk", 1152) == ("bf16", 1152)
    for good in ("nvfp4-dq:offload:mlpchunk", "bf16:mlpchunk2304", "nf4:full"):
        assert ts.arm_name(good) == good
    for bad in ("bf16:mlpchunk0", "bf16:mlpchunkx", "nvfp4-xx", "bf16:offload:full", "bf16:mlpchunk1:offload"):
        with pytest.raises(argparse.ArgumentTypeError):
            ts.arm_name(bad)


def test_step_summary_compares_mlp_chunk_arms_like_for_like():
    def arm(ms, gib):
        return {"micro_batch": {"2": {"ms_median": ms, "peak_gib": gib}}}

    arms = {"nvfp4-dq:offload": arm(750.0, 7.73), "nvfp4-dq:offload:mlpchunk1152": arm(800.0, 6.6),
            "bf16:offload": arm(730.0, 16.48), "bf16:offload:mlpchunk1152": arm(740.0, 15.4)}
    row = ts.step_summary(arms, [2])["2"]
    chunked = row["nvfp4-dq:offload:mlpchunk1152"]
    assert chunked["peak_vs_bf16"] == round(6.6 / 15.4, 3) and chunked["time_vs_bf16"] == round(800 / 740, 3)
    assert chunked["peak_vs_unchunked_mlp"] == round(6.6 / 7.73, 3) and chunked["peak_saved_gib"] == 1.13
    assert chunked["time_vs_unchunked_mlp"] == round(800 / 750, 3)
    assert chunked["peak_vs_bf16_unchunked_mlp"] == round(6.6 / 16.48, 3)
    assert row["nvfp4-dq:offload"]["peak_vs_bf16"] == round(7.73 / 16.48, 3)
    assert "peak_vs_unchunked_mlp" not in row["nvfp4-dq:offload"]


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


def test_step_mode_runs_mlp_chunk_arms_end_to_end_on_a_tiny_cpu_model(monkeypatch):
    """`mode_step` with a tiny Qwen2 shape on the CPU (CUDA timing and memory calls stubbed): the
    ':mlpchunk' arms switch the chunks on and off on the shared model and land in the summary."""
    import types

    import torch

    monkeypatch.setitem(ts.QWEN25, "tiny", dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                                rms_norm_eps=1e-6))

    class Event:
        def __init__(self, **_):
            self.t = 0.0

        def record(self):
            import time
            self.t = time.perf_counter()

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    for name, value in dict(Event=Event, synchronize=lambda: None, reset_peak_memory_stats=lambda: None,
                            max_memory_allocated=lambda: 1 << 30, memory_allocated=lambda: 0,
                            empty_cache=lambda: None).items():
        monkeypatch.setattr(torch.cuda, name, value)
    from qerl_lib import nvfp4_linear as nl

    monkeypatch.setattr(nl, "_BACKENDS", {})
    monkeypatch.setattr(nl, "_CHOSEN", set())
    from qerl_lib import chunked_mlp

    chunk_rows = []
    real = chunked_mlp._forward_chunks
    monkeypatch.setattr(chunked_mlp, "_forward_chunks", lambda m, x, c: chunk_rows.append((x.shape[0], c)) or real(m, x, c))
    arms = ["nvfp4-torch:offload", "nvfp4-torch:offload:mlpchunk7", "bf16", "bf16:mlpchunk7"]
    args = types.SimpleNamespace(shape="tiny", layers=None, prompt=4, completion=8, micro_batches=[2], arms=arms,
                                 grad_ckpt=True, warmup=1, repeats=1)
    out = ts.mode_step(args, torch.device("cpu"))
    assert set(out["arms"]) == set(arms)
    for arm in arms:
        r = out["arms"][arm]["micro_batch"]["2"]
        assert r["loss_finite"] and r["tokens"] == 24, (arm, r)
    assert out["arms"]["bf16:mlpchunk7"]["mlp_chunk_tokens"] == 7 and out["arms"]["bf16"]["mlp_chunk_tokens"] is None
    # the chunks do not change the loss (same weights, same batch)
    loss = {a: out["arms"][a]["micro_batch"]["2"]["loss"] for a in arms}
    assert loss["bf16:mlpchunk7"] == pytest.approx(loss["bf16"], rel=1e-2)
    assert loss["nvfp4-torch:offload:mlpchunk7"] == pytest.approx(loss["nvfp4-torch:offload"], rel=1e-2)
    assert chunk_rows and set(chunk_rows) == {(24, 7)}  # the chunked arms did run chunks
    row = out["summary"]["2"]
    assert row["nvfp4-torch:offload:mlpchunk7"]["peak_vs_unchunked_mlp"] == 1.0
    assert "peak_vs_bf16" in row["bf16:mlpchunk7"]
