"""GPU test of the engine's default decode GEMM (`rollout.vllm_gemv_rows: 8`, `vllm_gemv_kernel: auto`,
`vllm_gemv_pdl: true`):
one engine on the small random NVFP4 Llama of test_vllm_engine_gpu.py, with the CUDA decode GEMM up to
8 rows and the merged dense path above. Checks that `auto` built the CUDA kernel inside vLLM's worker,
that the kernel agrees with the dequantized base, and that rows decoded through it (LoRA fused in)
carry the transformers backend's log-probabilities with the same adapter. `-m gpu`; skipped without vLLM
and CUDA; the CPU side of the switch is tested in test_vllm_worker_gemv.py."""

from __future__ import annotations

import pytest
import torch
from test_vllm_engine_gpu import (  # noqa: F401 - fixtures
    PROMPTS,
    _teacher_forced_logprobs,
    _use_adapter,
    gpu,
    hf_model,
    needs_engine,
    small_nvfp4,
)

from qerl_lib.rollout.sampling import SamplingParams
from qerl_lib.rollout.vllm_engine import VLLMEngine

GEMV_ROWS = 8


@pytest.fixture(scope="module")
def gemv_engine(small_nvfp4):
    ckpt, _ = small_nvfp4
    # Eager: the kernel's CUDA-graph capture is tested in test_nvfp4_gemv_cuda.py and ran in vLLM's graphs
    # in benchmarks/results/rollout_throughput_cuda_gemv.json; this engine checks the switch and the numerics.
    eng = VLLMEngine(ckpt, max_lora_rank=8, gpu_memory_utilization=0.25, enforce_eager=True, seed=0,
                     max_model_len=512, dense_above=GEMV_ROWS, lora_dual_stream=True, gemv_rows=GEMV_ROWS,
                     gemv_kernel="auto", gemv_pdl=True, engine_kwargs={"max_num_seqs": 16})
    print(f"\n[vllm] gemv engine start-up {eng.stats.startup_seconds:.1f} s; linears: {eng.rpc('qerl_linear_info')}")
    yield eng
    eng.close()


@gpu
@needs_engine
def test_auto_builds_the_cuda_decode_gemm_in_the_worker(gemv_engine):
    info = gemv_engine.rpc("qerl_linear_info")
    assert info["gemv_fallback"] is None, info["gemv_fallback"]
    assert (info["gemv_kernel"], info["gemv_rows"]) == ("cuda", GEMV_ROWS)
    assert info["hybrid_layers"] == 8 and info["gemv_bytes"] > 0
    check = gemv_engine.rpc("qerl_check_hybrid", GEMV_ROWS)
    print(f"[vllm] decode GEMM vs dequantized base, max relative difference {check['max_rel_diff_gemv']:.2e}")
    assert 0 < check["max_rel_diff_gemv"] < 2e-2


@gpu
@needs_engine
def test_rows_through_the_decode_gemm_carry_the_adapters_logprobs(gemv_engine, hf_model, small_nvfp4):
    """Batch 1 and batch 8 decode every step on the CUDA kernel with the LoRA fused in: the sampled
    tokens' log-probs equal log_softmax(logits / T) of the float32 transformers model with the same
    adapter, up to bf16 rounding; and the adapter moves them (it is really applied)."""
    _, adapters = small_nvfp4
    temp = 0.7
    gemv_engine.set_policy(adapters[0], 1)
    _use_adapter(hf_model, adapters[0])
    prompts = PROMPTS[:GEMV_ROWS]
    comps = gemv_engine.generate(prompts, list(range(200, 200 + GEMV_ROWS)), SamplingParams(temp, 1.0, 16))
    comps += [gemv_engine.generate([p], [300], SamplingParams(temp, 1.0, 16))[0] for p in prompts[:2]]
    diffs = []
    for p, c in zip(prompts + prompts[:2], comps):
        lp = _teacher_forced_logprobs(hf_model, p, c.token_ids, temp)
        toks = torch.tensor(c.token_ids, device="cuda")
        diffs.append(torch.tensor(c.logprobs) - lp.gather(1, toks[:, None])[:, 0].cpu())
    d = torch.cat(diffs)
    print(f"[vllm] decode GEMM + fused LoRA vs transformers: mean |logprob diff| {d.abs().mean():.4f}")
    assert d.abs().mean() < 0.05 and abs(float(d.mean())) < 0.02
    gemv_engine.set_policy(None, 2)  # the base: the same tokens now score differently
    base = gemv_engine.generate(prompts[:1], [200], SamplingParams(temp, 1.0, 16))[0]
    assert base.token_ids != comps[0].token_ids or base.logprobs != comps[0].logprobs
