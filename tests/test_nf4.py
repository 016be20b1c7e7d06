"""model.quant = nf4: QLoRA's base (bitsandbytes NF4, double quant) through the whole loop on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from qerl_lib.config import load_config
from qerl_lib.paths import Layout

bnb = pytest.importorskip("bitsandbytes")


def test_nf4_base_quantizes_the_decoder_linears_only(tiny_llama_dir):
    from qerl_lib.model import load_base
    from qerl_lib.nvfp4_loader import load_dense_model

    nf4 = load_base(tiny_llama_dir, "nf4", torch.float32, torch.device("cpu"))
    dense = load_dense_model(tiny_llama_dir, torch.float32)
    layer = nf4.model.layers[0]
    for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"):
        assert isinstance(layer.get_submodule(name), bnb.nn.Linear4bit), name
    assert type(nf4.lm_head) is torch.nn.Linear
    assert all(not p.requires_grad for p in nf4.parameters())
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        a, b = nf4(ids).logits, dense(ids).logits
    # 4-bit weights: close to the dense model, not equal to it.
    rel = float((a - b).norm() / b.norm())
    assert 0 < rel < 0.5, rel


def test_two_step_run_trains_the_adapter_on_an_nf4_base(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file

    from qerl_lib.run import run_all
    from qerl_lib.schema import read_metadata

    cfg = load_config(None, {
        "run": {"root": str(tmp_path), "steps": 2},
        "model": {"base": str(tiny_llama_dir), "quant": "nf4"},
        "data": {"synthetic_train": 16, "synthetic_test": 4},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8, "batch_size": 8},
        "eval": {"max_prompts": 2, "k": 1, "max_new_tokens": 6},
        "algo": {"dynamic_sampling": False},
        "reward": {"format_weight": 0.1},
        "optim": {"lr": 1e-2},
        "aqn": {"enabled": True, "stages": 2},
    })
    run_all(cfg)
    lay = Layout(tmp_path)
    report = json.loads(lay.convert_report("nf4").read_text())
    assert report["quant"] == "nf4"
    assert read_metadata(lay.rollouts(1))["quant_scheme"].startswith("NF4")
    a0 = load_file(str(lay.adapter(0) / "adapter_model.safetensors"))
    a2 = load_file(str(lay.adapter(2) / "adapter_model.safetensors"))
    assert any(not torch.equal(a0[k], a2[k]) for k in a0 if "lora_B" in k)
    m1 = json.loads(lay.update_metrics(1).read_text())
    assert m1["sigma"] == pytest.approx(cfg.aqn.sigma_start) and m1["optimizer_steps"] >= 1


def test_vllm_in_flight_nf4_holds_the_trainers_weights(tiny_llama_dir):
    """The vLLM backend quantizes the 16-bit checkpoint as it loads it (`quantize_4bit`, NF4,
    `compress_statistics=True`, vLLM's bitsandbytes loader); the trainer's transformers NF4 base
    must dequantize to the same weights, or rollouts would sample another policy."""
    from safetensors.torch import load_file

    from qerl_lib.model import load_base

    nf4 = load_base(tiny_llama_dir, "nf4", torch.float32, torch.device("cpu"))
    (st,) = sorted(tiny_llama_dir.glob("*.safetensors"))
    dense = load_file(str(st))
    for name in ("self_attn.q_proj", "mlp.down_proj"):
        lin = nf4.model.layers[0].get_submodule(name)
        # vLLM quantizes the checkpoint tensor in the engine's dtype; the trainer's copy here is float32
        w16 = dense[f"model.layers.0.{name}.weight"].to(torch.float32)
        packed, state = bnb.functional.quantize_4bit(w16.contiguous(), compress_statistics=True, quant_type="nf4")
        assert torch.equal(packed.flatten(), lin.weight.data.flatten()), name
        vllm_w = bnb.functional.dequantize_4bit(packed, state)
        trainer_w = bnb.functional.dequantize_4bit(lin.weight.data, lin.weight.quant_state)
        assert torch.equal(vllm_w, trainer_w), name


def test_nf4_with_the_vllm_backend_quantizes_in_flight():
    """nf4 + vLLM is a valid config; both doors ask vLLM for bitsandbytes quantization."""
    from qerl_lib.rollout.vllm_engine import vllm_quantization

    cfg = load_config(None, {"model": {"quant": "nf4"}, "rollout": {"backend": "vllm"}})
    assert vllm_quantization(cfg.model.quant) == "bitsandbytes"
    assert vllm_quantization("nvfp4") is None and vllm_quantization("bf16") is None


def test_nf4_lora_gradients_equal_a_dense_model_of_the_dequantized_weights(tiny_qwen2_dir):
    """The trainer's NF4 path (transformers' bnb `Linear4bit` under PEFT LoRA) computes the same
    logprobs and LoRA gradients as a dense model holding the dequantized NF4 weights: the 4-bit base
    changes the weights, never the training math (the Qwen NF4 arm's collapse is not a gradient bug)."""
    from qerl_lib.config import LoraConfig
    from qerl_lib.lora import apply_lora
    from qerl_lib.model import load_base
    from qerl_lib.nvfp4_loader import load_dense_model

    nf4 = load_base(tiny_qwen2_dir, "nf4", torch.float32, torch.device("cpu"))
    dense = load_dense_model(tiny_qwen2_dir, torch.float32)
    with torch.no_grad():
        for name, mod in nf4.named_modules():
            if isinstance(mod, bnb.nn.Linear4bit):
                w = bnb.functional.dequantize_4bit(mod.weight.data, mod.weight.quant_state).float()
                dense.get_submodule(name).weight.copy_(w)
    lcfg = LoraConfig(r=4, alpha=8)
    pn, pd = apply_lora(nf4, lcfg), apply_lora(dense, lcfg)
    with torch.no_grad():  # B = 0 at init: give it values so A's gradient is not zero
        for (na, a), (nb, b) in zip(pn.named_parameters(), pd.named_parameters()):
            if "lora_B" in na:
                assert na == nb
                g = torch.Generator().manual_seed(len(na))
                val = torch.randn(a.shape, generator=g) * 0.05
                a.copy_(val)
                b.copy_(val)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27]])
    outs = []
    for m in (pn, pd):
        # train mode, as the trainer's update runs (bitsandbytes' CPU eval path rounds differently:
        # 0.5 % on a gradient here)
        m.train()
        logits = m(ids).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).sum()
        logp.backward()
        outs.append((logp.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}))
    (la, ga), (lb, gb) = outs
    torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)
    assert ga.keys() == gb.keys() and len(ga) > 0
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-3, atol=1e-5, msg=n)
