"""LoRA on NVFP4 and dense bases: numerics against the dense equivalent, seeding, PEFT files."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from safetensors.torch import load_file

from qerl_lib.config import LoraConfig
from qerl_lib.lora import (
    NVFP4LoraLinear,
    adapter_hash,
    apply_lora,
    load_adapter_weights,
    save_adapter,
    trainable_parameters,
)
from qerl_lib.nvfp4_linear import NVFP4Linear
from qerl_lib.nvfp4_loader import load_dense_model, load_nvfp4_model

IDS = torch.tensor([[5, 17, 42, 9, 100, 3], [7, 7, 8, 200, 31, 64]])
CFG = LoraConfig(r=4, alpha=8.0)


@torch.no_grad()
def _randomize_b(peft_model, seed: int = 0, std: float = 0.05) -> None:
    """Non-zero B matrices, so the adapter changes the output."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(peft_model.named_parameters()):
        if "lora_B" in name:
            p.copy_(torch.randn(p.shape, generator=g) * std)


def _lora_params(peft_model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" in n}


@pytest.fixture
def nvfp4_lora(tiny_llama_nvfp4_dir):
    return apply_lora(load_nvfp4_model(tiny_llama_nvfp4_dir, torch.float32), CFG)


def test_wraps_nvfp4_layers_and_only_lora_trains(nvfp4_lora):
    wrapped = [m for m in nvfp4_lora.modules() if isinstance(m, NVFP4LoraLinear)]
    assert len(wrapped) == 14 and all(isinstance(m.base_layer, NVFP4Linear) for m in wrapped)
    trainable = trainable_parameters(nvfp4_lora)
    assert len(trainable) == 28 and all(("lora_A" in n or "lora_B" in n) for n in trainable)
    assert all(p.dtype == torch.float32 for p in trainable.values())
    assert all(not p.requires_grad for n, p in nvfp4_lora.named_parameters() if "lora_" not in n)
    with pytest.raises(NotImplementedError):
        wrapped[0].merge()


def test_initial_adapter_is_identity_and_seeded(tiny_llama_nvfp4_dir, nvfp4_lora):
    base = load_nvfp4_model(tiny_llama_nvfp4_dir, torch.float32)
    with torch.no_grad():
        assert torch.equal(nvfp4_lora(IDS).logits, base(IDS).logits)  # B = 0
    params = _lora_params(nvfp4_lora)
    assert all(t.abs().sum() == 0 for n, t in params.items() if "lora_B" in n)
    a = params["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"]
    assert a.abs().max() <= 1 / 64**0.5 and a.std() > 0.1 / 8  # U(-1/sqrt(in), 1/sqrt(in))
    torch.manual_seed(123)  # the global RNG must not matter
    again = _lora_params(apply_lora(load_nvfp4_model(tiny_llama_nvfp4_dir, torch.float32), CFG))
    assert all(torch.equal(params[n], again[n]) for n in params)
    other = _lora_params(apply_lora(base, CFG.model_copy(update={"init_seed": 1})))
    assert not torch.equal(params[next(iter(params))], other[next(iter(params))])


def test_lora_layer_matches_dense_equivalent(nvfp4_lora):
    """forward, and grads of A, B and x, equal autograd on nn.Linear(dequantized W) + LoRA."""
    _randomize_b(nvfp4_lora)
    layer = nvfp4_lora.base_model.model.model.layers[0].mlp.down_proj
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    scaling = CFG.alpha / CFG.r
    assert layer.scaling["default"] == scaling

    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(0), requires_grad=True)
    y = layer(x)
    grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    y.backward(grad_y)

    dense = torch.nn.Linear(128, 64, bias=False)
    with torch.no_grad():
        dense.weight.copy_(layer.base_layer.dequantized_weight(torch.float32))
    dense.weight.requires_grad_(False)
    a_ref, b_ref = a.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = dense(x_ref) + (x_ref @ a_ref.T @ b_ref.T) * scaling
    y_ref.backward(grad_y)

    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(a.grad, a_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.grad, b_ref.grad, rtol=1e-5, atol=1e-6)
    assert layer.base_layer.weight_packed.grad is None


@pytest.mark.parametrize("model_kind", ["llama", "qwen2"])
def test_saved_adapter_loads_on_dense_dequantized_model(model_kind, request, ct_dequantized_dir, tmp_path):
    nvfp4_dir = request.getfixturevalue(f"tiny_{model_kind}_nvfp4_dir")
    peft_model = apply_lora(load_nvfp4_model(nvfp4_dir, torch.float32), CFG)
    _randomize_b(peft_model)
    out = save_adapter(peft_model, tmp_path / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    assert not (out / "norms.safetensors").exists()
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(CFG.target_modules)
    assert config["base_model_name_or_path"] == str(nvfp4_dir)
    assert config["r"] == CFG.r and config["lora_alpha"] == CFG.alpha and config["peft_type"] == "LORA"
    keys = set(load_file(str(out / "adapter_model.safetensors")))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys and len(keys) == 28

    dense = load_dense_model(ct_dequantized_dir(nvfp4_dir, torch.float32), torch.float32)
    on_dense = PeftModel.from_pretrained(dense, out)
    assert isinstance(on_dense.base_model.model.model.layers[0].self_attn.q_proj, PeftLoraLinear)
    with torch.no_grad():
        ours = peft_model(IDS).logits
        theirs = on_dense(IDS).logits
        base = load_nvfp4_model(nvfp4_dir, torch.float32)(IDS).logits
    assert not torch.allclose(ours, base, atol=1e-3)  # the adapter does something
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_load_adapter_weights_in_place_and_hash(nvfp4_lora, tmp_path):
    _randomize_b(nvfp4_lora, seed=1)
    first = save_adapter(nvfp4_lora, tmp_path / "step1")
    saved = _lora_params(nvfp4_lora)
    h1 = adapter_hash(first)
    assert len(h1) == 64 and h1 == adapter_hash(save_adapter(nvfp4_lora, tmp_path / "again"))

    identities = {n: p for n, p in nvfp4_lora.named_parameters() if "lora_" in n}
    _randomize_b(nvfp4_lora, seed=2)
    assert adapter_hash(save_adapter(nvfp4_lora, tmp_path / "step2")) != h1
    load_adapter_weights(nvfp4_lora, first)
    now = dict(nvfp4_lora.named_parameters())
    assert all(now[n] is identities[n] for n in identities)  # same Parameter objects
    assert all(torch.equal(now[n], saved[n]) for n in saved)


def test_load_adapter_rejects_other_rank(tiny_llama_nvfp4_dir, nvfp4_lora, tmp_path):
    other = apply_lora(load_nvfp4_model(tiny_llama_nvfp4_dir, torch.float32), CFG.model_copy(update={"r": 8}))
    path = save_adapter(other, tmp_path / "r8")
    with pytest.raises(ValueError, match="r=8"):
        load_adapter_weights(nvfp4_lora, path)


def test_train_norms_saved_and_loaded(tiny_qwen2_nvfp4_dir, tmp_path):
    cfg = CFG.model_copy(update={"train_norms": True})
    peft_model = apply_lora(load_nvfp4_model(tiny_qwen2_nvfp4_dir, torch.float32), cfg)
    norms = {n: p for n, p in trainable_parameters(peft_model).items() if "lora_" not in n}
    assert len(norms) == 2 * 2 + 1 and all(n.endswith("norm.weight") for n in norms)
    with torch.no_grad():
        for p in norms.values():
            p.add_(0.25)
    out = save_adapter(peft_model, tmp_path / "with_norms")
    stored = load_file(str(out / "norms.safetensors"))
    assert "model.layers.0.input_layernorm.weight" in stored and "model.norm.weight" in stored
    fresh = apply_lora(load_nvfp4_model(tiny_qwen2_nvfp4_dir, torch.float32), cfg)
    load_adapter_weights(fresh, out)
    for name, p in fresh.get_base_model().named_parameters():
        if name in stored:
            assert torch.equal(p, stored[name])
    with torch.no_grad():
        torch.testing.assert_close(fresh(IDS).logits, peft_model(IDS).logits, rtol=0, atol=0)


def test_dense_base_uses_peft_linear(tiny_llama_dir):
    peft_model = apply_lora(load_dense_model(tiny_llama_dir, torch.float32), CFG)
    layer = peft_model.base_model.model.model.layers[1].self_attn.v_proj
    assert type(layer) is PeftLoraLinear
    assert len(trainable_parameters(peft_model)) == 28
    peft_model(IDS).logits.mean().backward()
    assert layer.lora_B["default"].weight.grad is not None
    assert all(p.grad is None for n, p in peft_model.named_parameters() if "lora_" not in n)


def test_load_adapter_and_disable_adapter(tiny_llama_nvfp4_dir, nvfp4_lora, tmp_path):
    from qerl_lib.lora import load_adapter

    _randomize_b(nvfp4_lora, seed=3)
    path = save_adapter(nvfp4_lora, tmp_path / "a")
    restored = load_adapter(load_nvfp4_model(tiny_llama_nvfp4_dir, torch.float32), path)
    base = load_nvfp4_model(tiny_llama_nvfp4_dir, torch.float32)
    with torch.no_grad():
        assert torch.equal(restored(IDS).logits, nvfp4_lora(IDS).logits)
        with restored.disable_adapter():  # the GRPO reference: the base with the adapter off
            assert torch.equal(restored(IDS).logits, base(IDS).logits)
