"""Gradient checkpointing with the layer inputs offloaded (`qerl_lib.checkpointing`): same gradients."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from qerl_lib import checkpointing
from qerl_lib.config import LoraConfig, QerlConfig
from qerl_lib.lora import apply_lora

PACK = checkpointing._pack_to_host


def _lora_grads(model_dir, mode: str, monkeypatch, device: str = "cpu") -> tuple[dict[str, torch.Tensor], list[tuple]]:
    """LoRA gradients of one token-mean log-prob loss; mode: none | plain | offload. Also the
    shapes the offload hooks packed."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model = apply_lora(model, LoraConfig(r=4, alpha=8.0))
    with torch.no_grad():  # B starts at 0, which would leave every A gradient 0
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    model.train()
    packed = []
    monkeypatch.setattr(checkpointing, "_pack_to_host", lambda t: packed.append(tuple(t.shape)) or PACK(t))
    if mode != "none":
        checkpointing.enable_checkpointing(model, offload=mode == "offload")
    ids = torch.randint(4, 200, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    loss = -torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).mean()
    loss.backward()
    grads = {n: p.grad.cpu() for n, p in model.named_parameters() if p.requires_grad}
    return grads, packed


def test_offloaded_checkpointing_gives_the_same_lora_gradients(tiny_qwen2_dir, monkeypatch):
    ref, _ = _lora_grads(tiny_qwen2_dir, "none", monkeypatch)
    plain, packed_plain = _lora_grads(tiny_qwen2_dir, "plain", monkeypatch)
    offload, packed = _lora_grads(tiny_qwen2_dir, "offload", monkeypatch)
    assert ref.keys() == plain.keys() == offload.keys() and len(ref) > 0
    for n in ref:
        assert torch.allclose(plain[n], ref[n], rtol=1e-5, atol=1e-7), n
        assert torch.allclose(offload[n], ref[n], rtol=1e-5, atol=1e-7), n
        assert offload[n].abs().sum() > 0, n  # the gradient did reach every adapter through the reentrant path
    # What went to the host: each decoder layer's hidden-state input [B, T, H], nothing else
    # (the plain path packs nothing).
    cfg = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir).config
    assert packed_plain == []
    assert packed == [(2, 12, cfg.hidden_size)] * cfg.num_hidden_layers


def test_offload_without_checkpointing_is_refused():
    with pytest.raises(ValueError, match="offload_activations=true needs optim.gradient_checkpointing"):
        QerlConfig.model_validate({"optim": {"offload_activations": True}})


@pytest.mark.gpu
def test_gpu_offload_round_trip_through_pinned_memory_gives_the_same_gradients(tiny_qwen2_dir, monkeypatch):
    """On CUDA the hooks copy asynchronously into pinned host memory and back."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    plain, _ = _lora_grads(tiny_qwen2_dir, "plain", monkeypatch, "cuda")
    offload, packed = _lora_grads(tiny_qwen2_dir, "offload", monkeypatch, "cuda")
    assert len(packed) == AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir).config.num_hidden_layers
    for n in plain:
        assert torch.allclose(offload[n], plain[n], rtol=1e-5, atol=1e-7), n
