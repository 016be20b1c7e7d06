"""The vLLM rollout backend (`qerl_lib.rollout.vllm_engine`, `Policy` with `rollout.backend=vllm`).

CPU tests (default) cover the pure parts without vLLM installed: sampling translation,
completion conversion, adapter bookkeeping, the norm-noise writer against the trainer's
`NoiseInjector`, the partition dequantization of the dense fallback, the llm-compressor-free
NVFP4 writer against llm-compressor, and the Policy/stage wiring with a fake engine.

GPU tests of the engine itself are in test_vllm_engine_gpu.py.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qerl_lib.rollout.sampling import Completion, SamplingParams
from qerl_lib.nvfp4_checkpoint import write_nvfp4_checkpoint
from qerl_lib.rollout.vllm_engine import (
    AdapterSlots,
    VLLMEngine,
    logit_scale,
    to_completion,
    vllm_sampling_kwargs,
)
from qerl_lib.rollout.dense_regime import auto_dense_above, dense_declined_note, linear_param_count
from qerl_lib.rollout.vllm_weights import NormNoise, adapter_deltas, dequantize_partitions, merge_partitions

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def build_small_dense(out_dir: Path, seed: int = 0) -> Path:
    """A random Llama big enough for vLLM's kernels (hidden 256, intermediate 512, 2 layers,
    4 heads of 64, 2 KV heads, tied embeddings), the tests' tiny tokenizer (vocab 256), bf16."""
    from conftest import build_tiny_tokenizer
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    tok = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, bos_token_id=None, initializer_range=0.08, tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    with torch.no_grad():  # non-trivial norms, so that AQN and trained norms are really tested
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.uniform_(0.8, 1.2)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                               bos_token_id=None)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def make_adapter(checkpoint: Path, out_dir: Path, seed: int, r: int = 8, scale: float = 0.05) -> Path:
    """A PEFT adapter for `checkpoint` with random non-zero B (so it changes the outputs)."""
    from qerl_lib.config import LoraConfig
    from qerl_lib.lora import apply_lora, save_adapter
    from qerl_lib.model import load_base

    base = load_base(checkpoint, "nvfp4", torch.float32, torch.device("cpu"))
    model = apply_lora(base, LoraConfig(r=r, alpha=2 * r, init_seed=seed))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return save_adapter(model, out_dir)


# =============================================================================== CPU: pure parts


def test_sampling_kwargs_fold_temperature_into_the_logit_scale():
    sampled = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12)
    kw = vllm_sampling_kwargs(sampled, 123, {5, 2})
    assert kw == {"n": 1, "seed": 123, "temperature": 1.0, "top_p": 0.9, "max_tokens": 12, "logprobs": 0,
                  "stop_token_ids": [2, 5], "detokenize": False}
    assert logit_scale(sampled) == pytest.approx(1 / 0.7)
    greedy = SamplingParams(temperature=0.0, top_p=0.5, max_new_tokens=3)
    kw = vllm_sampling_kwargs(greedy, 1, [])
    assert (kw["temperature"], kw["top_p"]) == (0.0, 1.0)
    assert logit_scale(greedy) == 1.0


def _fake_output(tokens, lps, reason):
    logprobs = [{t: SimpleNamespace(logprob=lp), t + 1: SimpleNamespace(logprob=-99.0)} for t, lp in zip(tokens, lps)]
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, logprobs=logprobs, finish_reason=reason)])


def test_to_completion_takes_the_sampled_tokens_logprob():
    c = to_completion(_fake_output([4, 7, 2], [-0.5, -1.25, -0.1], "stop"))
    assert c == Completion([4, 7, 2], [-0.5, -1.25, -0.1], "stop")
    assert to_completion(_fake_output([1], [-2.0], "length")).finish_reason == "length"
    with pytest.raises(RuntimeError, match="abort"):
        to_completion(_fake_output([1], [-2.0], "abort"))
    bad = _fake_output([1, 2], [-1.0, -1.0], "length")
    bad.outputs[0].logprobs = bad.outputs[0].logprobs[:1]
    with pytest.raises(RuntimeError, match="1 logprobs for 2 tokens"):
        to_completion(bad)


class FakeLoraEngine:
    def __init__(self):
        self.loaded: dict[int, object] = {}
        self.calls: list[tuple] = []

    def add_lora(self, req):
        self.calls.append(("add", req.lora_int_id))
        self.loaded[req.lora_int_id] = req
        return True

    def remove_lora(self, lora_id):
        self.calls.append(("remove", lora_id))
        return self.loaded.pop(lora_id, None) is not None

    def list_loras(self):
        return set(self.loaded)


def _req(name, lora_id, path):
    return SimpleNamespace(lora_name=name, lora_int_id=lora_id, lora_path=path)


def test_adapter_slots_give_each_version_a_fresh_id_and_remove_the_old_one_first():
    eng = FakeLoraEngine()
    slots = AdapterSlots(eng.add_lora, eng.remove_lora, eng.list_loras, _req)
    r0 = slots.set("/a0", 0, "aa" * 32)
    assert (r0.lora_int_id, r0.lora_name) == (1, "qerl-v0-" + "a" * 12)
    assert slots.set("/a0", 0, "aa" * 32) is r0  # same version and bytes: nothing to do
    r1 = slots.set("/a1", 1, "bb" * 32)
    assert r1.lora_int_id == 2 and eng.list_loras() == {2}
    assert eng.calls == [("add", 1), ("remove", 1), ("add", 2)]  # removed before the new one is added
    r1b = slots.set("/a1", 1, "cc" * 32)  # same version, other bytes: a new id, never a cached one
    assert r1b.lora_int_id == 3 and eng.list_loras() == {3}
    slots.clear()
    assert eng.list_loras() == set() and slots.request is None


def test_norm_noise_writes_the_trainers_exact_bits(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from qerl_lib.aqn import NoiseInjector, fingerprint

    a = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    b = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    clean = fingerprint(a)
    writer, injector = NormNoise(a), NoiseInjector(b)
    writer.apply(0.03, 11, 2)
    injector.apply(0.03, 11, 2)
    assert fingerprint(a) == fingerprint(b) != clean
    writer.apply(0.03, 11, 2)  # again: from the clean copy, no random walk
    assert fingerprint(a) == fingerprint(b)
    writer.apply(0.03, 11, 3)
    assert fingerprint(a) != fingerprint(b)
    writer.apply(0.0, 0, 0)
    assert fingerprint(a) == clean
    info = writer.describe()
    assert info["targets"] == 4 and info["fingerprint"] == clean


def test_norm_noise_overrides_apply_trained_norms_and_restore_the_checkpoint(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    writer = NormNoise(model)
    before_final = model.model.norm.weight.detach().clone()
    trained = {"model.layers.1.post_attention_layernorm.weight": torch.full((64,), 1.5),
               "model.norm.weight": torch.full((64,), 0.5)}
    assert writer.set_overrides(trained) == 2
    assert torch.equal(model.model.layers[1].post_attention_layernorm.weight, torch.full((64,), 1.5, dtype=torch.bfloat16))
    assert torch.equal(model.model.norm.weight, torch.full((64,), 0.5, dtype=torch.bfloat16))
    writer.apply(0.1, 1, 1)
    writer.apply(0.0, 0, 0)  # noise off returns to the trained clean weights
    assert torch.equal(model.model.layers[1].post_attention_layernorm.weight, torch.full((64,), 1.5, dtype=torch.bfloat16))
    writer.set_overrides(None)
    assert torch.equal(model.model.norm.weight, before_final)
    assert not torch.equal(model.model.layers[1].post_attention_layernorm.weight,
                           torch.full((64,), 1.5, dtype=torch.bfloat16))
    with pytest.raises(KeyError):
        writer.set_overrides({"model.nowhere.weight": torch.ones(64)})


def test_dequantize_partitions_uses_each_partitions_global_scale():
    from qerl_lib.nvfp4 import dequantize_nvfp4, quantize_nvfp4

    torch.manual_seed(0)
    ws = [torch.randn(32, 64), torch.randn(16, 64) * 3, torch.randn(16, 64) * 0.1]
    parts = [quantize_nvfp4(w) for w in ws]  # three different global scales
    packed = torch.cat([p for p, _, _ in parts])
    scale = torch.cat([s for _, s, _ in parts])
    gs = torch.cat([g for _, _, g in parts])
    dense = dequantize_partitions(packed, scale, gs, [32, 16, 16], torch.bfloat16)
    want = torch.cat([dequantize_nvfp4(p, s, g, torch.bfloat16) for p, s, g in parts])
    assert torch.equal(dense, want)
    with pytest.raises(ValueError):
        dequantize_partitions(packed, scale, gs, [32, 32], torch.bfloat16)


def test_merge_partitions_adds_each_delta_in_float32_and_casts_once():
    dense = torch.randn(8, 16).to(torch.bfloat16)
    before = dense.clone()
    d0, d2 = torch.randn(4, 16) * 1e-3, torch.randn(2, 16)
    merge_partitions(dense, [4, 2, 2], [d0, None, d2])
    assert torch.equal(dense[:4], (before[:4].float() + d0).to(torch.bfloat16))
    assert torch.equal(dense[4:6], before[4:6])
    assert torch.equal(dense[6:], (before[6:].float() + d2).to(torch.bfloat16))
    with pytest.raises(ValueError, match="does not fit"):
        merge_partitions(dense, [4, 2, 2], [torch.zeros(3, 16), None, None])


def test_merged_dense_qkv_equals_the_peft_layers_on_the_nvfp4_base(tiny_qwen2_nvfp4_dir, tmp_path):
    """What the merged regime computes for a fused q|k|v layer (vLLM's layout: partitions stacked,
    one global scale each) equals base + LoRA of the PEFT model the trainer runs."""
    from safetensors.torch import load_file

    ckpt = tiny_qwen2_nvfp4_dir
    adapter = make_adapter(ckpt, tmp_path / "adapter", seed=3, r=8, scale=0.2)
    pairs, scaling, cfg = adapter_deltas(adapter)
    assert scaling == cfg["lora_alpha"] / cfg["r"] == 2.0
    assert "model.layers.0.self_attn.q_proj" in pairs and len(pairs) == 2 * 7
    t = load_file(str(ckpt / "model.safetensors"))
    pre = "model.layers.0.self_attn"
    parts = ("q_proj", "k_proj", "v_proj")
    packed = torch.cat([t[f"{pre}.{p}.weight_packed"] for p in parts])
    scale = torch.cat([t[f"{pre}.{p}.weight_scale"] for p in parts])
    gs = torch.cat([t[f"{pre}.{p}.weight_global_scale"].reshape(1) for p in parts])
    widths = [t[f"{pre}.{p}.weight_packed"].shape[0] for p in parts]
    dense = dequantize_partitions(packed, scale, gs, widths, torch.float32)
    deltas = [(pairs[f"{pre}.{p}"]["lora_B"].float() @ pairs[f"{pre}.{p}"]["lora_A"].float()) * scaling for p in parts]
    merged = merge_partitions(dense, widths, deltas)

    from qerl_lib.lora import load_adapter
    from qerl_lib.model import load_base

    model = load_adapter(load_base(ckpt, "nvfp4", torch.float32, torch.device("cpu")), adapter)
    attn = model.base_model.model.model.layers[0].self_attn
    x = torch.randn(5, dense.shape[1])
    with torch.no_grad():
        want = torch.cat([getattr(attn, p)(x) - getattr(attn, p).base_layer.bias for p in parts], dim=-1)
    got = x @ merged.T
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(x @ dense_base(packed, scale, gs, widths).T, want, atol=1e-2)  # the adapter matters


def dense_base(packed, scale, gs, widths):
    return dequantize_partitions(packed, scale, gs, widths, torch.float32)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_direct_nvfp4_writer_matches_llm_compressor(kind, tiny_llama_dir, tiny_qwen2_dir, tiny_llama_nvfp4_dir,
                                                    tiny_qwen2_nvfp4_dir, tmp_path):
    from safetensors.torch import load_file

    dense, ref = {"llama": (tiny_llama_dir, tiny_llama_nvfp4_dir), "qwen2": (tiny_qwen2_dir, tiny_qwen2_nvfp4_dir)}[kind]
    out = write_nvfp4_checkpoint(dense, tmp_path / "ct")
    got, want = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k].view(torch.uint8) if got[k].dtype == torch.float8_e4m3fn else got[k],
                           want[k].view(torch.uint8) if want[k].dtype == torch.float8_e4m3fn else want[k]), k
    qc_got = json.loads((out / "config.json").read_text())["quantization_config"]
    qc_want = json.loads((ref / "config.json").read_text())["quantization_config"]
    qc_got.pop("version"), qc_want.pop("version")
    assert qc_got == qc_want
    assert (out / "tokenizer.json").is_file()


QWEN7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4,
          "num_hidden_layers": 28}


def qwen7b_checkpoint(tmp_path, quantized: bool = True) -> Path:
    """A folder with only the config.json of a Qwen2.5-7B-shaped checkpoint (NVFP4 or BF16)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    config = {**QWEN7B, **({"quantization_config": {"format": "nvfp4"}} if quantized else {})}
    (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt


def test_regime_choice_counts_the_dense_copy_of_a_7b_model(tmp_path):
    assert linear_param_count(QWEN7B) == 6_525_288_448
    ckpt = qwen7b_checkpoint(tmp_path)
    assert auto_dense_above(ckpt, 0.5 * 141e9, 32) == 32  # 13 GB of dense copies in a 70 GB budget
    assert auto_dense_above(ckpt, 0.3 * 80e9, 32) is None  # not in 24 GB
    ckpt = qwen7b_checkpoint(tmp_path, quantized=False)
    assert auto_dense_above(ckpt, 1e12, 32) is None  # a BF16 checkpoint needs no dense copy


def test_auto_says_when_it_declines_the_dense_copies_and_what_keeps_them(tmp_path):
    ckpt, h100 = qwen7b_checkpoint(tmp_path), 79.2 * 2**30  # torch's total_memory of an H100 80GB HBM3
    note = dense_declined_note(ckpt, h100, 0.5)  # the default share: 13.05 GB > 0.25 x 0.5 x 79.2 GiB
    assert "13.05 GB" in note and ">= 0.62 lets auto keep them" in note and "off runs without them" in note
    assert auto_dense_above(ckpt, 0.62 * h100, 48) == 48  # the share it names does keep them
    assert auto_dense_above(ckpt, 0.61 * h100, 48) is None
    assert dense_declined_note(ckpt, h100, 0.65) is None  # session 30's setting: auto keeps them
    assert "no vllm_gpu_memory_utilization" in dense_declined_note(ckpt, 40e9, 0.9)  # > a quarter of 40 GB
    assert dense_declined_note(ckpt, 0, 0.5) is None  # no GPU: nothing chosen, nothing to say
    assert dense_declined_note(qwen7b_checkpoint(tmp_path, quantized=False), h100, 0.5) is None


def test_engine_regime_warns_when_auto_declines_the_dense_copies(tmp_path, monkeypatch, caplog):
    from qerl_lib import policy
    from qerl_lib.config import QerlConfig

    ckpt = qwen7b_checkpoint(tmp_path)
    monkeypatch.setattr(policy.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(policy.torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(total_memory=int(79.2 * 2**30)))
    cfg = QerlConfig.model_validate({"model": {"quant": "nvfp4"}, "rollout": {"backend": "vllm"}})
    with caplog.at_level("WARNING", logger="qerl_lib.policy"):
        assert policy.dense_above_for(cfg, ckpt) is None
    assert "no dense copies" in caplog.text and ">= 0.62" in caplog.text
    caplog.clear()
    cfg = QerlConfig.model_validate({"model": {"quant": "nvfp4"},
                                     "rollout": {"backend": "vllm", "vllm_gpu_memory_utilization": 0.65}})
    with caplog.at_level("WARNING", logger="qerl_lib.policy"):
        assert policy.dense_above_for(cfg, ckpt) == policy.DEFAULT_DENSE_ABOVE
    assert caplog.text == ""


# =============================================================================== CPU: engine and Policy wiring


class FakeLLM:
    """Enough of `vllm.LLM` for `VLLMEngine`: records rpc calls, lists adapters, fakes generation."""

    def __init__(self):
        self.llm_engine = FakeLoraEngine()
        self.rpcs: list[tuple] = []
        self.resets = 0
        self.sleeping = False
        self.generated: list[tuple] = []

    def collective_rpc(self, method, args=()):
        self.rpcs.append((method, args))
        return [{"method": method}]

    def reset_prefix_cache(self):
        self.resets += 1

    def sleep(self, level=1):
        self.sleeping = True

    def wake_up(self):
        self.sleeping = False

    def generate(self, prompts, sps, lora_request=None, use_tqdm=False):
        assert not self.sleeping
        self.generated.append((prompts, sps, lora_request))
        outs = []
        for p, sp in zip(prompts, sps):
            toks = [(sp["seed"] + i) % 7 for i in range(min(3, sp["max_tokens"]))]
            outs.append(_fake_output(toks, [-0.5] * len(toks), "length"))
        return outs


@pytest.fixture
def fake_engine(monkeypatch, tmp_path):
    import qerl_lib.rollout.vllm_engine as ve

    monkeypatch.setattr(ve, "_make_lora_request", _req)
    llm = FakeLLM()
    monkeypatch.setitem(__import__("sys").modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: kw))
    return VLLMEngine(tmp_path / "ckpt", llm=llm), llm


def _adapter_dir(tmp_path, name, payload):
    d = tmp_path / name
    d.mkdir()
    (d / "adapter_model.safetensors").write_bytes(payload)
    return d


def test_engine_pushes_adapter_noise_and_scale_before_generating(fake_engine, tmp_path):
    engine, llm = fake_engine
    a0 = _adapter_dir(tmp_path, "a0", b"zero")
    engine.set_policy(a0, 0)
    assert llm.llm_engine.list_loras() == {1}
    engine.set_noise(0.02, 5, 0)
    assert llm.rpcs[-1] == ("qerl_set_noise", (0.02, 5, 0, "absolute"))
    n = len(llm.rpcs)
    assert engine.set_noise(0.02, 5, 0) is None and len(llm.rpcs) == n  # unchanged: no rpc
    comps = engine.generate([[1, 2], [3]], [10, 11], SamplingParams(0.5, 0.9, 4), stop_token_ids=[2])
    assert ("qerl_set_logit_scale", (2.0,)) in llm.rpcs
    prompts, sps, req = llm.generated[-1]
    assert prompts == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]
    assert [s["seed"] for s in sps] == [10, 11] and sps[0]["temperature"] == 1.0 and req.lora_int_id == 1
    assert [c.token_ids for c in comps] == [[3, 4, 5], [4, 5, 6]]
    a1 = _adapter_dir(tmp_path, "a1", b"one")
    resets = llm.resets
    engine.set_policy(a1, 1)
    assert llm.llm_engine.list_loras() == {2} and llm.resets > resets
    assert llm.rpcs[-1] == ("qerl_set_noise", (0.0, 0, 0, "absolute"))  # a new adapter starts without noise
    engine.sleep()
    assert llm.sleeping
    engine.generate([[1]], [1], SamplingParams(0.0, 1.0, 2))  # wakes up by itself
    assert not llm.sleeping and llm.rpcs[-1] == ("qerl_set_logit_scale", (1.0,))
    stats = engine.stats_dict()
    assert stats["adapter_id"] == 2 and stats["generate_calls"] == 2 and stats["sleeps"] == 1


def test_engine_passes_trained_norms_to_the_workers(fake_engine, tmp_path):
    engine, llm = fake_engine
    a = _adapter_dir(tmp_path, "a", b"x")
    (a / "norms.safetensors").write_bytes(b"n")
    engine.set_policy(a, 0)
    assert ("qerl_set_norm_overrides", (str((a / "norms.safetensors").resolve()),)) in llm.rpcs
    b = _adapter_dir(tmp_path, "b", b"y")
    engine.set_policy(b, 1)
    assert llm.rpcs[-2] == ("qerl_set_norm_overrides", (None,))  # back to the checkpoint's norms


def test_policy_with_vllm_backend_rolls_out_through_the_engine(tiny_llama_dir, tmp_path, monkeypatch):
    """The stages run unchanged with `rollout.backend=vllm`: adapter, noise and sleep reach the engine."""
    import pyarrow.parquet as pq

    import qerl_lib.policy as policy_mod
    from qerl_lib import stages
    from qerl_lib.config import load_config
    from qerl_lib.paths import Layout

    cfg = load_config(None, {
        "run": {"root": str(tmp_path / "ws"), "steps": 4},
        "model": {"base": str(tiny_llama_dir)},
        "data": {"synthetic_train": 8, "synthetic_test": 2},
        "rollout": {"backend": "vllm", "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
        "aqn": {"enabled": True, "stages": 2},
    })
    layout = Layout(cfg.run.root)
    stages.prepare_stage(cfg, layout)
    stages.convert_stage(cfg, layout)
    stages.init_adapter_stage(cfg, layout)

    class RecordingEngine:
        def __init__(self):
            self.calls = []

        def set_policy(self, adapter_dir, version):
            self.calls.append(("policy", Path(adapter_dir).name, version))

        def set_noise(self, sigma, seed, step, mode="absolute"):
            self.calls.append(("noise", sigma, seed, step))

        def generate(self, prompts, seeds, params, stop_token_ids=()):
            self.calls.append(("generate", len(prompts), params.temperature, tuple(sorted(stop_token_ids))))
            return [Completion([5, 6], [-1.0, -2.0], "length") for _ in prompts]

        def sleep(self):
            self.calls.append(("sleep",))

        def stats_dict(self):
            return {"startup_seconds": 1.0}

    engine = RecordingEngine()
    monkeypatch.setattr(policy_mod, "get_engine", lambda cfg, ckpt: engine)
    pol = policy_mod.get_policy(cfg, layout, reuse=True)
    step = 3  # stage 1 of 2: noisy
    (layout.adapter(3)).parent.mkdir(parents=True, exist_ok=True)
    import shutil

    shutil.copytree(layout.adapter(0), layout.adapter(3))
    path = stages.rollout_stage(cfg, layout, step, pol)
    from qerl_lib.aqn import sigma_at

    sigma = sigma_at(step, cfg.run.steps, cfg.aqn)
    assert sigma > 0
    assert engine.calls[0] == ("policy", "step=3", 3)
    assert engine.calls[1] == ("noise", sigma, cfg.aqn.seed, step)
    assert engine.calls[2][:3] == ("generate", 4, 1.0) and engine.calls[3] == ("sleep",)
    rows = pq.read_table(path).to_pylist()
    assert [r["completion_token_ids"] for r in rows] == [[5, 6]] * 4
    assert rows[0]["sampling_logprobs"] == [-1.0, -2.0] and rows[0]["aqn_sigma"] == pytest.approx(sigma)
    assert json.loads((layout.root / "vllm_engine.json").read_text()) == {"startup_seconds": 1.0}
    policy_mod.clear_policy_cache()


def test_kv_cache_size_and_max_model_len_reach_vllm_in_process_and_served(tmp_path):
    """`rollout.vllm_kv_cache_gib` / `vllm_max_model_len` go to `vllm.LLM` and to `vllm serve` alike;
    unset, neither door passes them (vLLM sizes the cache by profiling)."""
    from qerl_lib.config import QerlConfig
    from qerl_lib.policy import vllm_memory_kwargs
    from qerl_lib.rollout.serve import vllm_command

    (tmp_path / "config.json").write_text('{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}')
    cfg = QerlConfig()
    assert vllm_memory_kwargs(cfg.rollout) == {}
    argv, _ = vllm_command(cfg, tmp_path, "127.0.0.1", 8000)
    assert "--kv-cache-memory-bytes" not in argv and "--max-model-len" not in argv
    cfg.rollout.vllm_kv_cache_gib = 2.5
    cfg.rollout.vllm_max_model_len = 1024
    assert vllm_memory_kwargs(cfg.rollout) == {"kv_cache_memory_bytes": int(2.5 * 2**30)}
    argv, _ = vllm_command(cfg, tmp_path, "127.0.0.1", 8000)
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(int(2.5 * 2**30))
    assert argv[argv.index("--max-model-len") + 1] == "1024"


def test_nf4_reaches_vllm_as_bitsandbytes_in_process_and_served(tmp_path, monkeypatch):
    """model.quant=nf4 with the vLLM backend: the in-process engine and `vllm serve` both get
    bitsandbytes in-flight quantization; other formats get none."""
    import qerl_lib.rollout.vllm_engine as ve
    from qerl_lib import policy as policy_mod
    from qerl_lib.config import QerlConfig
    from qerl_lib.rollout.serve import vllm_command

    (tmp_path / "config.json").write_text('{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}')
    seen = []

    class Engine:
        def __init__(self, checkpoint, **kwargs):
            seen.append(kwargs)

        def close(self):
            pass

    monkeypatch.setattr(ve, "VLLMEngine", Engine)
    for quant, want in (("nf4", "bitsandbytes"), ("bf16", None)):
        cfg = QerlConfig.model_validate({"model": {"quant": quant}, "rollout": {"backend": "vllm"}})
        policy_mod.get_engine(cfg, tmp_path)
        assert seen[-1]["quantization"] == want
        argv, _ = vllm_command(cfg, tmp_path, "127.0.0.1", 8000)
        assert (argv[argv.index("--quantization") + 1] if "--quantization" in argv else None) == want
    policy_mod.close_engines()


def test_a_sleep_check_tripped_by_another_process_leaves_the_engine_asleep(fake_engine):
    """vLLM asserts, after offloading, that the device's free memory grew; another process on the GPU
    can trip that. The engine is asleep then, so it counts the race and goes on; other errors raise."""
    engine, llm = fake_engine

    def racy_sleep(level=1):
        llm.sleeping = True
        raise Exception("Call to sleep method failed: Memory usage increased after sleeping.")

    llm.sleep = racy_sleep
    engine.sleep()
    assert engine.asleep and engine.stats_dict()["sleep_races"] == 1
    engine.wake_up()

    def broken_sleep(level=1):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    llm.sleep = broken_sleep
    with pytest.raises(RuntimeError, match="illegal memory access"):
        engine.sleep()
    assert not engine.asleep
