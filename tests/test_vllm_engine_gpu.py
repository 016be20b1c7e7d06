"""GPU tests of the vLLM backend (`-m gpu`; skipped without vLLM and CUDA): one engine on a small
random Llama in NVFP4, with the dense merged regime above 4 rows and dual-stream LoRA, checked
against the transformers backend on the same checkpoint. Run on the H200 by
`scripts/device_vllm.sh gpu-tests`; the CPU tests of the same modules are in test_vllm_engine.py."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from test_vllm_engine import build_small_dense, make_adapter

from qerl_lib.nvfp4_checkpoint import write_nvfp4_checkpoint
from qerl_lib.rollout.sampling import SamplingParams
from qerl_lib.rollout.vllm_engine import VLLMEngine

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


gpu = pytest.mark.gpu
needs_engine = pytest.mark.skipif(not (HAVE_VLLM and torch.cuda.is_available()), reason="needs vLLM and a CUDA GPU")
DENSE_ABOVE = 4
"""Rows above which the test engine runs dense: batch 1 decodes on Marlin, batch 16 on the dense copies."""


@pytest.fixture(scope="module")
def small_nvfp4(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    dense = build_small_dense(root / "dense")
    if importlib.util.find_spec("llmcompressor") is not None:
        from conftest import convert_nvfp4

        ckpt = convert_nvfp4(dense, root / "nvfp4")
    else:  # the GPU machine: the same tensors, without llm-compressor (tested on the CPU above)
        ckpt = write_nvfp4_checkpoint(dense, root / "nvfp4")
    adapters = [make_adapter(ckpt, root / f"adapter{i}", seed=i + 1) for i in range(2)]
    return ckpt, adapters


@pytest.fixture(scope="module")
def engine(small_nvfp4):
    ckpt, _ = small_nvfp4
    eng = VLLMEngine(ckpt, max_lora_rank=8, gpu_memory_utilization=0.25, enforce_eager=False, seed=0,
                     max_model_len=512, dense_above=DENSE_ABOVE, lora_dual_stream=True,
                     engine_kwargs={"max_num_seqs": 32, "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}})
    print(f"\n[vllm] engine start-up {eng.stats.startup_seconds:.1f} s; linears: {eng.rpc('qerl_linear_info')}")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def hf_model(small_nvfp4):
    """The transformers backend's model on the GPU: packed NVFP4 dequantized in float32 + LoRA."""
    from qerl_lib.config import LoraConfig
    from qerl_lib.lora import apply_lora
    from qerl_lib.model import load_base
    from qerl_lib.nvfp4_linear import register_matmul_backend

    register_matmul_backend("cuda", None)  # the exact reference: dequantize_nvfp4 + F.linear in float32
    ckpt, _ = small_nvfp4
    base = load_base(ckpt, "nvfp4", torch.float32, torch.device("cuda"))
    return apply_lora(base, LoraConfig(r=8, alpha=16)).eval()


def _use_adapter(model, adapter_dir):
    from qerl_lib.lora import load_adapter_weights

    load_adapter_weights(model, adapter_dir)


PROMPTS = [[2] + [(7 * i + 3 * j) % 200 + 40 for j in range(5 + i % 7)] for i in range(16)]


@torch.no_grad()
def _teacher_forced_logprobs(model, prompt, tokens, temperature=1.0):
    """log_softmax(logits / T) [len(tokens), V] of the transformers model at each completion position."""
    ids = torch.tensor([prompt + tokens[:-1]], device="cuda")
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:].float()
    return torch.log_softmax(logits / temperature, dim=-1)


@gpu
@needs_engine
def test_engine_runs_marlin_and_the_dense_fallback_agrees(engine):
    info = engine.rpc("qerl_linear_info")
    assert set(info["kernels"]) == {"MarlinNvFp4LinearKernel"}
    assert info["hybrid_layers"] == 8 and info["merged_lora_layers"] == 8 and info["threshold"] == DENSE_ABOVE
    assert info["lora_dual_stream"]
    check = engine.rpc("qerl_check_hybrid", 16)
    print(f"[vllm] Marlin vs dense copy, max relative difference {check['max_rel_diff']:.2e}")
    assert check["max_rel_diff"] < 2e-2


@gpu
@needs_engine
@pytest.mark.parametrize("batch", [1, 16])
def test_greedy_tokens_equal_the_transformers_backend(engine, hf_model, small_nvfp4, batch):
    """batch 1 decodes on Marlin, batch 16 on the dense copies; both must be the NVFP4 model's
    greedy tokens: every token is the float32 transformers argmax, except at near-ties
    (top-2 logprob gap under 0.15, where bf16 rounding may pick either)."""
    from qerl_lib.rollout.sampling import sample_batch

    _, adapters = small_nvfp4
    engine.set_policy(adapters[0], 0)
    _use_adapter(hf_model, adapters[0])
    params = SamplingParams(0.0, 1.0, 24)
    prompts = PROMPTS[:batch] if batch > 1 else PROMPTS[:4]
    comps = []
    for i in range(0, len(prompts), batch):
        comps += engine.generate(prompts[i:i + batch], list(range(i, i + batch)), params, stop_token_ids=[3])
    ref = sample_batch(hf_model, prompts, [0] * len(prompts), params, {3}, 1)
    equal = ties = 0
    for p, c, r in zip(prompts, comps, ref):
        lp = _teacher_forced_logprobs(hf_model, p, c.token_ids)
        top2 = lp.topk(2, dim=-1).values
        for t, tok in enumerate(c.token_ids):
            gap = float(lp[t].max() - lp[t, tok])
            assert gap < 0.15, f"token {t} of {c.token_ids} is not the argmax (gap {gap:.3f})"
        if c.token_ids == r.token_ids:
            equal += 1
        else:
            first = next(t for t, (a, b) in enumerate(zip(c.token_ids, r.token_ids)) if a != b)
            assert float(top2[first, 0] - top2[first, 1]) < 0.15, "diverged without a near-tie"
            ties += 1
        # greedy logprobs are the untempered log softmax
        want = lp.gather(1, torch.tensor(c.token_ids, device="cuda")[:, None])[:, 0].cpu()
        assert torch.allclose(torch.tensor(c.logprobs), want, atol=0.1)
    # Measured on the H200 (random tiny model, flat distributions): batch 1 1/4 identical, batch 16
    # 8/16; every other row split at a near-tie, which the assertions above require.
    print(f"[vllm] batch {batch}: {equal}/{len(prompts)} greedy sequences identical, {ties} split at near-ties")


@gpu
@needs_engine
def test_merged_dense_path_agrees_with_marlin_plus_lora_kernels(engine, small_nvfp4):
    """The same greedy rows decoded one at a time (Marlin + vLLM's LoRA kernels on a second
    stream) and 16 at a time (dense weights with the adapter merged in): equal logprobs up to
    bf16 rounding, and the merge follows every adapter swap."""
    _, (a0, a1) = small_nvfp4
    params = SamplingParams(0.0, 1.0, 12)
    for version, adapter in enumerate((a0, a1, None)):
        engine.set_policy(adapter, 100 + version)
        together = engine.generate(PROMPTS, [0] * 16, params)
        alone = [engine.generate([p], [0], params)[0] for p in PROMPTS]
        same = sum(x.token_ids == y.token_ids for x, y in zip(together, alone))
        diffs = []  # logprobs of the common prefix: after a split at a near-tie the rows differ anyway
        for x, y in zip(together, alone):
            for t, (tx, ty) in enumerate(zip(x.token_ids, y.token_ids)):
                if tx != ty:
                    break
                diffs.append(abs(x.logprobs[t] - y.logprobs[t]))
        print(f"[vllm] adapter {adapter and adapter.name}: {same}/16 rows equal across regimes, "
              f"max |logprob diff| over common prefixes {max(diffs):.3f}")
        assert same >= 8 and max(diffs) < 0.1
    info = engine.rpc("qerl_linear_info")
    assert info["merged_adapter"] is None


@gpu
@needs_engine
def test_sampling_logprobs_are_log_softmax_over_t_before_top_p(engine, hf_model, small_nvfp4):
    _, adapters = small_nvfp4
    engine.set_policy(adapters[0], 0)
    _use_adapter(hf_model, adapters[0])
    temp, top_p = 0.7, 0.8
    comps = engine.generate(PROMPTS, list(range(100, 116)), SamplingParams(temp, top_p, 16))
    diffs, kept_logmass = [], []
    for p, c in zip(PROMPTS, comps):
        lp = _teacher_forced_logprobs(hf_model, p, c.token_ids, temp)
        toks = torch.tensor(c.token_ids, device="cuda")
        diffs.append(torch.tensor(c.logprobs) - lp.gather(1, toks[:, None])[:, 0].cpu())
        sorted_p = lp.exp().sort(dim=-1, descending=True).values
        mass = torch.where((sorted_p.cumsum(-1) - sorted_p) < top_p, sorted_p, 0).sum(-1)
        kept_logmass.append(mass.log().cpu())
    d, bias = torch.cat(diffs), -torch.cat(kept_logmass).mean()
    print(f"[vllm] logprob - log_softmax(logits/T): mean {d.mean():+.4f}, mean |.| {d.abs().mean():.4f}; "
          f"a renormalised (processed) logprob would be {bias:+.4f} higher on average")
    assert d.abs().mean() < 0.05 and abs(float(d.mean())) < 0.02
    assert bias > 3 * abs(float(d.mean()))  # the test tells the two conventions apart


@gpu
@needs_engine
def test_per_request_seeds_repeat_and_do_not_depend_on_order(engine, small_nvfp4):
    _, adapters = small_nvfp4
    engine.set_policy(adapters[0], 0)
    params = SamplingParams(1.0, 1.0, 16)
    seeds = list(range(16))
    a = engine.generate(PROMPTS, seeds, params)
    b = engine.generate(PROMPTS, seeds, params)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    order = list(reversed(range(16)))
    c = engine.generate([PROMPTS[i] for i in order], [seeds[i] for i in order], params)
    assert [c[order.index(i)].token_ids for i in range(16)] == [x.token_ids for x in a]
    d = engine.generate(PROMPTS, [s + 1000 for s in seeds], params)
    assert sum(x.token_ids != y.token_ids for x, y in zip(a, d)) >= 12


@gpu
@needs_engine
def test_adapter_versions_are_explicit_and_never_stale(engine, small_nvfp4):
    _, (a0, a1) = small_nvfp4
    params = SamplingParams(0.0, 1.0, 12)
    engine.set_policy(None, 0)
    base = engine.generate(PROMPTS, [0] * 16, params)
    engine.set_policy(a0, 10)
    id0 = engine.lora_request.lora_int_id
    assert set(engine.llm.llm_engine.list_loras()) == {id0}  # a list over IPC, a set in-process
    out0 = engine.generate(PROMPTS, [0] * 16, params)
    engine.set_policy(a1, 11)
    id1 = engine.lora_request.lora_int_id
    assert id1 != id0 and set(engine.llm.llm_engine.list_loras()) == {id1}
    out1 = engine.generate(PROMPTS, [0] * 16, params)
    engine.set_policy(a0, 12)
    assert set(engine.llm.llm_engine.list_loras()) == {engine.lora_request.lora_int_id} != {id0}
    again = engine.generate(PROMPTS, [0] * 16, params)
    toks = lambda cs: [c.token_ids for c in cs]  # noqa: E731
    assert toks(out0) != toks(base) and toks(out1) != toks(out0)
    assert toks(again) == toks(out0)


@gpu
@needs_engine
def test_aqn_reaches_vllm_rmsnorm_with_the_trainers_bits(engine, small_nvfp4):
    from qerl_lib.aqn import fingerprint, noised

    ckpt, (a0, _) = small_nvfp4
    engine.set_policy(a0, 0)
    params = SamplingParams(1.0, 1.0, 12)
    seeds = list(range(16))

    def run(sigma, seed, step):
        info = engine.set_noise(sigma, seed, step, force=True)
        comps = engine.generate(PROMPTS, seeds, params)
        return info, [c.token_ids for c in comps], torch.tensor([x for c in comps for x in c.logprobs[:4]])

    info0, t0, l0 = run(0.0, 0, 0)
    print(f"[vllm] AQN targets: {info0['targets']} modules of {info0['classes']}")
    assert len(info0["classes"]) == 1 and info0["classes"][0].startswith("vllm.") and "RMSNorm" in info0["classes"][0]
    assert info0["targets"] == 4
    info1, t1, l1 = run(0.05, 7, 1)
    info1b, t1b, l1b = run(0.05, 7, 1)
    info2, t2, l2 = run(0.05, 7, 2)
    info3, t3, l3 = run(0.0, 0, 0)
    print(f"[vllm] AQN sigma 0.05: max |logprob change| {float((l1 - l0).abs().max()):.3f}; "
          f"same (seed, step) again {float((l1b - l1).abs().max()):.2e}; back to sigma 0 {float((l3 - l0).abs().max()):.2e}")
    assert info1["fingerprint"] == info1b["fingerprint"] != info0["fingerprint"] != info2["fingerprint"]
    assert float((l1 - l0).abs().max()) > 1e-2 and t1 == t1b and float((l1b - l1).abs().max()) < 1e-4
    assert float((l2 - l1).abs().max()) > 1e-2
    assert info3["fingerprint"] == info0["fingerprint"] and t3 == t0 and float((l3 - l0).abs().max()) < 1e-4
    # the trainer's NoiseInjector writes the very same bits into the transformers norms
    from qerl_lib.model import load_base

    trainer = load_base(ckpt, "nvfp4", torch.bfloat16, torch.device("cuda"))
    assert info0["dtype"] == "torch.bfloat16" and fingerprint(trainer) == info0["fingerprint"]
    with noised(trainer, 0.05, 7, 1):
        assert fingerprint(trainer) == info1["fingerprint"]


@gpu
@needs_engine
def test_sleep_frees_memory_and_wake_restores_identical_outputs(engine, small_nvfp4):
    _, (a0, _) = small_nvfp4
    engine.set_policy(a0, 0)
    engine.set_noise(0.05, 3, 1)
    params = SamplingParams(1.0, 1.0, 12)
    before = engine.generate(PROMPTS, list(range(16)), params)
    free0 = torch.cuda.mem_get_info()[0]
    engine.sleep()
    free1 = torch.cuda.mem_get_info()[0]
    engine.wake_up()
    after = engine.generate(PROMPTS, list(range(16)), params)
    print(f"[vllm] sleep freed {(free1 - free0) / 2**30:.2f} GiB; sleep {engine.stats.sleep_seconds:.2f} s, "
          f"wake {engine.stats.wake_seconds:.2f} s")
    assert free1 - free0 > 2**28
    assert [c.token_ids for c in after] == [c.token_ids for c in before]
    assert all(math.isclose(x, y, abs_tol=1e-4) for c, d in zip(before, after) for x, y in zip(c.logprobs, d.logprobs))
    engine.set_noise(0.0, 0, 0)
