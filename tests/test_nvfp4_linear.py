"""NVFP4Linear (packed forward/backward) and the NVFP4 / dense model loaders."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from qerl_lib.nvfp4 import quantize_nvfp4
from qerl_lib.nvfp4_linear import MatmulBackend, NVFP4Linear, TORCH_BACKEND, register_matmul_backend, resident_weight_bytes
from qerl_lib.nvfp4_loader import CheckpointError, load_dense_model, load_model, load_nvfp4_model

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _layer(out_features=48, in_features=64, bias=False, seed=0) -> tuple[NVFP4Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g) * 0.05
    b = torch.randn(out_features, generator=g) if bias else None
    return NVFP4Linear.from_tensors(*quantize_nvfp4(weight), bias=b), b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_forward_equals_dense_linear_on_dequantized_weight(dtype, bias):
    layer, b = _layer(bias=bias)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    w = layer.dequantized_weight(dtype)
    expected = torch.nn.functional.linear(x, w, None if b is None else b.to(dtype))
    y = layer(x)
    assert y.dtype == dtype and y.shape == (2, 3, 48)
    assert torch.equal(y, expected)


def test_backward_gives_input_grad_and_saves_no_dense_weight():
    layer, _ = _layer()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    # only the packed buffers are kept for backward: no float [out, in] weight, not even x
    assert all(not (t.is_floating_point() and t.shape == (48, 64)) for t in saved)
    assert {t.dtype for t in saved} <= {torch.uint8, torch.float8_e4m3fn, torch.float32}
    assert not any(t.shape == x.shape for t in saved)
    grad_y = torch.randn(5, 48, generator=torch.Generator().manual_seed(3))
    y.backward(grad_y)

    x_ref = x.detach().clone().requires_grad_(True)
    w_ref = layer.dequantized_weight(torch.float32).requires_grad_(True)
    torch.nn.functional.linear(x_ref, w_ref).backward(grad_y)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
    assert all(not p.requires_grad for p in layer.parameters())
    assert all(not b.requires_grad for b in layer.buffers())


def test_split_by_rows_routes_each_call_by_its_rows():
    from qerl_lib.nvfp4_linear import split_by_rows

    calls = []

    def counting(name):
        def forward(x, packed, scale, gscale, bias):
            calls.append((name, "forward", x.shape[0]))
            return TORCH_BACKEND.forward(x, packed, scale, gscale, bias)

        def grad_input(gy, packed, scale, gscale):
            calls.append((name, "grad_input", gy.shape[0]))
            return TORCH_BACKEND.grad_input(gy, packed, scale, gscale)

        return MatmulBackend(name, forward, grad_input)

    layer, _ = _layer()
    register_matmul_backend("cpu", split_by_rows(counting("small"), counting("large"), above=4))
    try:
        for rows in (4, 5):
            layer(torch.randn(rows, 64, requires_grad=True)).sum().backward()
    finally:
        register_matmul_backend("cpu", None)
    assert calls == [("small", "forward", 4), ("small", "grad_input", 4),
                     ("large", "forward", 5), ("large", "grad_input", 5)]


def test_matmul_backend_is_pluggable():
    calls = []

    def forward(x, packed, scale, gscale, bias):
        calls.append("forward")
        return TORCH_BACKEND.forward(x, packed, scale, gscale, bias)

    def grad_input(gy, packed, scale, gscale):
        calls.append("grad_input")
        return TORCH_BACKEND.grad_input(gy, packed, scale, gscale)

    layer, _ = _layer()
    register_matmul_backend("cpu", MatmulBackend("counting", forward, grad_input))
    try:
        layer(torch.randn(2, 64, requires_grad=True)).sum().backward()
    finally:
        register_matmul_backend("cpu", None)
    assert calls == ["forward", "grad_input"]
    layer(torch.randn(2, 64))
    assert calls == ["forward", "grad_input"]


def test_unknown_backend_choice_is_named_and_not_settled(monkeypatch):
    """A typo in QERL_NVFP4_BACKEND fails on the first CUDA matmul (no GPU needed to check it), every time."""
    from qerl_lib import nvfp4_linear as nl

    monkeypatch.setenv("QERL_NVFP4_BACKEND", "trition")
    monkeypatch.setattr(nl, "_CHOSEN", set())
    for _ in range(2):
        with pytest.raises(ValueError, match="QERL_NVFP4_BACKEND='trition'.*triton-dq"):
            nl.get_matmul_backend("cuda")
    assert "cuda" not in nl._CHOSEN
    assert nl.get_matmul_backend("cpu") is TORCH_BACKEND  # the CPU ignores the variable


def _quantized_shapes(model: nn.Module) -> set[tuple[int, int]]:
    return {(m.out_features, m.in_features) for m in model.modules() if isinstance(m, NVFP4Linear)}


@pytest.mark.parametrize("model_kind", ["llama", "qwen2"])
def test_load_nvfp4_model_keeps_weights_packed(model_kind, request):
    nvfp4_dir = request.getfixturevalue(f"tiny_{model_kind}_nvfp4_dir")
    model = load_nvfp4_model(nvfp4_dir, torch.bfloat16, "cpu")
    quantized = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    assert len(quantized) == 14
    assert isinstance(model.lm_head, nn.Linear) and not isinstance(model.lm_head, NVFP4Linear)
    assert not model.training
    assert model.config.tie_word_embeddings == (model.lm_head.weight is model.model.embed_tokens.weight)
    # no float tensor shaped like a quantized weight is resident, anywhere
    shapes = _quantized_shapes(model)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        assert not t.is_meta, name
        assert not (t.is_floating_point() and t.element_size() >= 2 and tuple(t.shape) in shapes), name
        assert not t.requires_grad, name
    for m in quantized:
        assert m.weight_packed.dtype == torch.uint8 and m.weight_scale.dtype == torch.float8_e4m3fn
        assert not hasattr(m, "weight")
    # accounting: packed bytes are exactly N*K/2, and the total is far below a dense model's
    sizes = resident_weight_bytes(model)
    assert sizes["uint8"] == sum(m.out_features * m.in_features // 2 for m in quantized)
    assert sizes["float8_e4m3fn"] == sum(m.out_features * m.in_features // 16 for m in quantized)
    assert sizes["total"] == sum(v for k, v in sizes.items() if k != "total")
    dense = load_dense_model(request.getfixturevalue(f"tiny_{model_kind}_dir"), torch.bfloat16)
    dense_linear_bytes = 2 * sum(m.out_features * m.in_features for m in quantized)
    assert resident_weight_bytes(dense)["total"] - sizes["total"] == pytest.approx(
        dense_linear_bytes - sizes["uint8"] - sizes["float8_e4m3fn"] - 4 * len(quantized), abs=64
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("model_kind", ["llama", "qwen2"])
def test_logits_equal_dense_model_with_ct_dequantized_weights(model_kind, dtype, request, ct_dequantized_dir):
    nvfp4_dir = request.getfixturevalue(f"tiny_{model_kind}_nvfp4_dir")
    ours = load_nvfp4_model(nvfp4_dir, dtype)
    reference = load_dense_model(ct_dequantized_dir(nvfp4_dir, dtype), dtype)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask).logits
        b = reference(input_ids=ids, attention_mask=mask).logits
    assert a.dtype == dtype
    assert torch.equal(a, b)


def test_base_gets_no_gradients(tiny_qwen2_nvfp4_dir):
    model = load_nvfp4_model(tiny_qwen2_nvfp4_dir, torch.float32)
    embeds = model.get_input_embeddings()(torch.tensor([[3, 4, 5, 6]])).detach().requires_grad_(True)
    model(inputs_embeds=embeds).logits.square().mean().backward()
    assert embeds.grad is not None and embeds.grad.abs().sum() > 0  # gradient flows through the packed layers
    assert all(p.grad is None for p in model.parameters())


def test_generate_runs_with_tokenizer(tiny_llama_nvfp4_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_nvfp4_dir)
    model = load_nvfp4_model(tiny_llama_nvfp4_dir, torch.float32)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True, tokenize=False)
    assert tok.decode(tok(text).input_ids) == text
    inputs = tok(text, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert out.shape[1] <= inputs.input_ids.shape[1] + 5


def _broken_copy(src, dst, mutate):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    mutate(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_missing_tensor_is_named(tiny_llama_nvfp4_dir, tmp_path):
    key = "model.layers.1.mlp.down_proj.weight_scale"
    broken = _broken_copy(tiny_llama_nvfp4_dir, tmp_path / "ckpt", lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        load_nvfp4_model(broken, torch.float32)


def test_wrong_shape_is_named(tiny_llama_nvfp4_dir, tmp_path):
    key = "model.layers.0.self_attn.q_proj.weight_packed"

    def mutate(t):
        t[key] = t[key][:, :16].contiguous()

    broken = _broken_copy(tiny_llama_nvfp4_dir, tmp_path / "ckpt", mutate)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor model\.layers\.0\.self_attn\.q_proj\.weight_packed has shape"):
        load_nvfp4_model(broken, torch.float32)


def test_missing_packed_weight_is_named(tiny_llama_nvfp4_dir, tmp_path):
    key = "model.layers.0.mlp.up_proj.weight_packed"
    broken = _broken_copy(tiny_llama_nvfp4_dir, tmp_path / "ckpt", lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.") + " is missing"):
        load_nvfp4_model(broken, torch.float32)


def test_loader_choice_by_quant(tiny_llama_dir, tiny_llama_nvfp4_dir):
    with pytest.raises(CheckpointError, match="no quantization_config"):
        load_nvfp4_model(tiny_llama_dir, torch.float32)
    with pytest.raises(CheckpointError, match="load_nvfp4_model"):
        load_dense_model(tiny_llama_nvfp4_dir, torch.float32)
    dense = load_model(tiny_llama_dir, "bf16", torch.float32)
    assert not any(isinstance(m, NVFP4Linear) for m in dense.modules())
    assert all(not p.requires_grad for p in dense.parameters())
    packed = load_model(tiny_llama_nvfp4_dir, "nvfp4", torch.float32)
    assert any(isinstance(m, NVFP4Linear) for m in packed.modules())
    assert json.loads((tiny_llama_nvfp4_dir / "config.json").read_text())["quantization_config"]["format"] == "nvfp4-pack-quantized"
