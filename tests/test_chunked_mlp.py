"""The chunked MLP (`qerl_lib.chunked_mlp`, `optim.mlp_chunk_tokens`): same gradients, bounded intermediates."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, Qwen2Config

from qerl_lib import checkpointing
from qerl_lib.chunked_mlp import chunked_mlp, set_mlp_chunking
from qerl_lib.config import LoraConfig, QerlConfig
from qerl_lib.lora import apply_lora

HIDDEN, INTER = 64, 160  # intermediate unlike any other width of the tiny model, so shapes identify it


def _tiny_lora_model(dtype=torch.float32, dropout: float = 0.0, layers: int = 2):
    """A random tiny Qwen2 (hidden 64, intermediate 160) in `dtype` with LoRA r4 (B random, not 0)."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=128, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    return _with_lora(model, dropout)


def _with_lora(model, dropout: float = 0.0):
    model = apply_lora(model, LoraConfig(r=4, alpha=8.0, dropout=dropout))
    with torch.no_grad():  # B starts at 0, which would leave every A gradient 0
        for i, (n, p) in enumerate(model.named_parameters()):
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(i))
    return model.train()


def _lora(model) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _mlp_grads(mlp, params, x, g, chunk):
    """(y, dx, {param: grad}) of one MLP call, plain (chunk None) or chunked."""
    for p in params.values():
        p.grad = None
    x = x.detach().requires_grad_(True)
    y = mlp(x) if chunk is None else chunked_mlp(mlp, x, chunk)
    y.backward(g)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in params.items() if p.grad is not None}


def _close(a, b, rtol):
    """max |a - b| <= rtol * max |b| (float32 summation-order differences scale with the values)."""
    return float((a.float() - b.float()).abs().max()) <= rtol * float(b.float().abs().max()) + 1e-12


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunk", [1, 5, 7, 13, 23, 24, 100])
def test_one_mlp_chunked_equals_unchunked(dtype, chunk):
    """Values, input gradient and LoRA gradients of one MLP over 2 x 12 = 24 tokens, for chunks that
    divide 24, do not, and exceed it (the plain path)."""
    model = _tiny_lora_model(dtype)
    mlp = model.get_base_model().model.layers[0].mlp
    params = {n: p for n, p in mlp.named_parameters() if p.requires_grad}
    assert len(params) == 6  # A and B of gate, up, down
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 12, HIDDEN, generator=gen).to(dtype)
    g = torch.randn(2, 12, HIDDEN, generator=gen).to(dtype)
    y0, dx0, dp0 = _mlp_grads(mlp, params, x, g, None)
    y1, dx1, dp1 = _mlp_grads(mlp, params, x, g, chunk)
    assert y1.shape == y0.shape and y1.dtype == y0.dtype and dx1.dtype == dx0.dtype
    assert _close(y1, y0, TOL[dtype]) and _close(dx1, dx0, TOL[dtype])
    assert dp0.keys() == dp1.keys() == params.keys()
    for n in dp0:
        assert dp1[n].dtype == torch.float32  # the adapters stay float32
        assert _close(dp1[n], dp0[n], TOL[dtype]), n
    if dtype == torch.float32:  # per-row math: the forward is the same up to matmul blocking
        assert torch.allclose(y1, y0, rtol=1e-6, atol=1e-7)


def test_autograd_grad_reaches_lora_params_through_the_function():
    """The LoRA parameters are inputs of the Function: torch.autograd.grad (not only .backward) sees them."""
    model = _tiny_lora_model()
    mlp = model.get_base_model().model.layers[1].mlp
    params = [p for p in mlp.parameters() if p.requires_grad]
    x = torch.randn(30, HIDDEN, generator=torch.Generator().manual_seed(4), requires_grad=True)
    y = chunked_mlp(mlp, x, 8)
    assert y.grad_fn is not None and type(y.grad_fn).__name__.startswith("ChunkedMLPFunction")
    grads = torch.autograd.grad(y.square().sum(), [x, *params])
    ref = torch.autograd.grad(mlp(x).square().sum(), [x, *params])
    for a, b in zip(grads, ref):
        assert _close(a, b, 1e-5)


def _activation_shapes(model, run) -> list[tuple]:
    """Shapes of the non-parameter tensors autograd saves for backward while `run()` runs
    (forward and backward: the saved-tensor hooks stay active through both)."""
    param_ptrs = {p.data_ptr() for p in model.parameters()}
    shapes = []

    def pack(t):
        if t.data_ptr() not in param_ptrs:
            shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return shapes


def _intermediate_rows(shapes) -> int:
    """Most rows of any saved [rows, intermediate]-like activation (0 if none)."""
    return max([s[0] * (s[1] if len(s) == 3 else 1) for s in shapes if s and s[-1] == INTER] + [0])


@pytest.mark.parametrize("chunk", [5, 7])
def test_no_full_size_intermediate_is_saved_for_backward(chunk):
    """With the chunks, autograd never saves an activation of more than `chunk` rows x intermediate
    width (forward and the chunked recomputation in backward); without them it saves [24, 160] ones."""
    model = _tiny_lora_model()
    mlp = model.get_base_model().model.layers[0].mlp
    x = torch.randn(2, 12, HIDDEN, generator=torch.Generator().manual_seed(5), requires_grad=True)

    plain = _activation_shapes(model, lambda: mlp(x).sum().backward())
    chunked = _activation_shapes(model, lambda: chunked_mlp(mlp, x, chunk).sum().backward())
    assert _intermediate_rows(plain) == 24
    assert 0 < _intermediate_rows(chunked) <= chunk
    # the Function itself keeps only its input between forward and backward
    saved = _activation_shapes(model, lambda: chunked_mlp(mlp, x, chunk))
    assert saved == [(2, 12, HIDDEN)]


def _model_step(model, ids):
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    loss = -torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).mean()
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("offload", [False, True], ids=["plain", "offload"])
def test_checkpointed_model_saves_no_full_size_intermediate_and_recomputes_the_mlp_once(offload):
    """Whole model under gradient checkpointing (reentrant with offload, non-reentrant without): the
    layer recomputation skips the chunked MLP, so gate_proj sees every token exactly twice per step
    (forward, chunked recomputation in backward), as without chunks, and no saved activation exceeds
    a chunk. Plain checkpointing (reentrant recomputation visible to the hooks) saves [24, 160] ones."""
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    rows = {}
    for chunk in (None, 5):
        model = _tiny_lora_model()
        checkpointing.enable_checkpointing(model, offload=offload, mlp_chunk_tokens=chunk)
        gates = [layer.mlp.gate_proj for layer in model.get_base_model().model.layers]
        calls = []
        hooks = [g.register_forward_hook(lambda m, i, o: calls.append(i[0].numel() // HIDDEN)) for g in gates]
        shapes = _activation_shapes(model, lambda: _model_step(model, ids))
        for h in hooks:
            h.remove()
        rows[chunk] = (sum(calls), max(calls), _intermediate_rows(shapes))
    layers = 2
    assert rows[None][0] == rows[5][0] == 2 * 24 * layers  # no extra MLP FLOPs
    assert rows[None][1] == 24 and rows[5][1] == 5
    if offload:  # reentrant: the recomputed layer's tensors are saved under the test's hooks
        assert rows[None][2] == 24
    assert rows[5][2] <= 5


def _model_grads(make_model, mode: str, chunk, ids):
    """LoRA gradients and loss of one token-mean log-prob loss; mode: none | plain | offload."""
    model = make_model()
    if mode != "none":
        checkpointing.enable_checkpointing(model, offload=mode == "offload", mlp_chunk_tokens=chunk)
    loss = _model_step(model, ids)
    return loss, {n: p.grad.clone() for n, p in _lora(model).items()}


@pytest.mark.parametrize("mode", ["plain", "offload"])
@pytest.mark.parametrize("chunk", [5, 7, 24])
def test_checkpointed_model_gradients_equal_unchunked(mode, chunk):
    """Every LoRA gradient (and the loss) of the whole tiny model, chunked vs not checkpointed at all."""
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    ref_loss, ref = _model_grads(_tiny_lora_model, "none", None, ids)
    loss, grads = _model_grads(_tiny_lora_model, mode, chunk, ids)
    assert torch.allclose(loss, ref_loss, rtol=1e-6)
    assert grads.keys() == ref.keys() and len(ref) == 2 * 7 * 2
    for n in ref:
        assert grads[n].abs().sum() > 0, n
        assert _close(grads[n], ref[n], 1e-5), n


def _old_enable_checkpointing(model, offload):
    """`enable_checkpointing` as it was before `mlp_chunk_tokens` (commit 8944cb9)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if offload:
        model.get_base_model()._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=checkpointing.offloaded_checkpoint)
    model.enable_input_require_grads()


@pytest.mark.parametrize("offload", [False, True], ids=["plain", "offload"])
@pytest.mark.parametrize("off", [None, 0], ids=["None", "0"])
def test_option_off_is_bit_identical_to_before(offload, off):
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    old = _tiny_lora_model()
    _old_enable_checkpointing(old, offload)
    old_loss = _model_step(old, ids)
    new = _tiny_lora_model()
    checkpointing.enable_checkpointing(new, offload=offload, mlp_chunk_tokens=off)
    assert all("forward" not in m.__dict__ for m in new.modules())
    assert torch.equal(_model_step(new, ids), old_loss)
    for n, p in _lora(old).items():
        assert torch.equal(_lora(new)[n].grad, p.grad), n


def test_switching_chunks_off_again_restores_the_plain_forward():
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = _tiny_lora_model()
    checkpointing.enable_checkpointing(ref)
    ref_loss = _model_step(ref, ids)
    model = _tiny_lora_model()
    checkpointing.enable_checkpointing(model, mlp_chunk_tokens=5)
    assert sum("forward" in m.__dict__ for m in model.modules()) == 2
    checkpointing.enable_checkpointing(model, offload=True)  # as the benchmark does between arms
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert torch.equal(_model_step(model, ids), ref_loss)
    for n, p in _lora(ref).items():
        assert torch.equal(_lora(model)[n].grad, p.grad), n


@pytest.mark.parametrize("model_kind", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_nvfp4_base_chunked_equals_unchunked(model_kind, dtype, request):
    """The same through the packed NVFP4 base (`NVFP4Linear`, PyTorch path on the CPU) of the tiny
    llm-compressor checkpoints, whole model, both checkpointing paths, 2 x 12 tokens in chunks of 5."""
    from qerl_lib.nvfp4_linear import NVFP4Linear
    from qerl_lib.nvfp4_loader import load_nvfp4_model

    nvfp4_dir = request.getfixturevalue(f"tiny_{model_kind}_nvfp4_dir")

    def make():
        torch.manual_seed(0)
        return _with_lora(load_nvfp4_model(nvfp4_dir, dtype=dtype))

    model = make()
    mlp = model.get_base_model().model.layers[0].mlp
    assert isinstance(mlp.down_proj.base_layer, NVFP4Linear)
    ids = torch.randint(4, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    ref_loss, ref = _model_grads(make, "none", None, ids)
    for mode in ("plain", "offload"):
        loss, grads = _model_grads(make, mode, 5, ids)
        assert _close(loss, ref_loss, TOL[dtype] / 10)
        for n in ref:
            assert grads[n].abs().sum() > 0, n
            assert _close(grads[n], ref[n], TOL[dtype]), (mode, n)


def test_lora_dropout_masks_are_redrawn_identically_in_backward():
    """With LoRA dropout the backward recomputation replays the forward's RNG: the gradient is that
    of the very masks the forward used (reference: the same chunks run with autograd, same seed)."""
    model = _tiny_lora_model(dropout=0.5)
    mlp = model.get_base_model().model.layers[0].mlp
    params = {n: p for n, p in mlp.named_parameters() if p.requires_grad}
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(23, HIDDEN, generator=gen)
    g = torch.randn(23, HIDDEN, generator=gen)

    torch.manual_seed(42)
    xr = x.clone().requires_grad_(True)
    ref_y = torch.cat([mlp(xr[s:s + 5]) for s in range(0, 23, 5)])
    ref_y.backward(g)
    ref = {n: p.grad.clone() for n, p in params.items()}
    ref_dx, ref_y = xr.grad, ref_y.detach()

    torch.manual_seed(42)
    y, dx, grads = _mlp_grads(mlp, params, x, g, 5)
    assert torch.allclose(y, ref_y, rtol=1e-6, atol=1e-7)
    assert _close(dx, ref_dx, 1e-5)
    for n in ref:
        assert _close(grads[n], ref[n], 1e-5), n
    # and the masks really differ between calls (dropout is on): another seed gives another output
    torch.manual_seed(43)
    assert not torch.allclose(chunked_mlp(mlp, x, 5), y)


def test_unsupported_model_type_is_refused_by_name():
    from transformers import GPT2Config

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    with pytest.raises(ValueError, match=r"model type 'gpt2' \(GPT2LMHeadModel\) is not supported"):
        checkpointing.enable_checkpointing(gpt2, mlp_chunk_tokens=8)
    assert not getattr(gpt2, "is_gradient_checkpointing", False)  # refused before anything changed


def test_mlp_of_another_shape_is_refused_by_module_name():
    model = _tiny_lora_model()
    layer = model.get_base_model().model.layers[1]
    layer.mlp = nn.Sequential(nn.Linear(HIDDEN, INTER), nn.GELU(), nn.Linear(INTER, HIDDEN))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp \(Sequential\) of model type 'qwen2' has no "
                                         r"gate_proj, up_proj, down_proj, act_fn"):
        set_mlp_chunking(model, 8)


def test_config_needs_gradient_checkpointing_and_a_non_negative_size():
    with pytest.raises(ValueError, match="optim.mlp_chunk_tokens needs optim.gradient_checkpointing=true"):
        QerlConfig.model_validate({"optim": {"mlp_chunk_tokens": 1024}})
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        QerlConfig.model_validate({"optim": {"gradient_checkpointing": True, "mlp_chunk_tokens": -1}})
    assert QerlConfig().optim.mlp_chunk_tokens is None  # off by default
    assert QerlConfig.model_validate({"optim": {"mlp_chunk_tokens": 0}}).optim.mlp_chunk_tokens == 0
    ok = QerlConfig.model_validate({"optim": {"gradient_checkpointing": True, "mlp_chunk_tokens": 1024}})
    assert ok.optim.mlp_chunk_tokens == 1024


def test_update_stage_with_chunked_mlp_trains_the_same_adapter(scored_workspace, tmp_path):
    """optim.mlp_chunk_tokens through the trainer (tiny NVFP4 Llama, chunks of 5 tokens): the same update."""
    from conftest import copy_workspace
    from safetensors.torch import load_file

    from qerl_lib.stages import update_stage

    cfg, layout = scored_workspace
    adapters = {}
    for chunk in (None, 5):
        work = copy_workspace(layout, tmp_path / f"w{chunk}")
        c = cfg.model_copy(deep=True)
        c.run.root = str(work.root)
        c.optim.gradient_checkpointing = True
        c.optim.mlp_chunk_tokens = chunk
        assert update_stage(c, work, 0)["optimizer_steps"] > 0
        adapters[chunk] = load_file(str(work.adapter(1) / "adapter_model.safetensors"))
    before = load_file(str(layout.adapter(0) / "adapter_model.safetensors"))
    assert any(not torch.equal(before[k], adapters[5][k]) for k in before)
    for k in before:
        # float32 gradient differences; AdamW's first steps (about lr * sign(g)) magnify them on the few
        # elements whose gradient is near 0, so the bound is a share of the update, not of the weight
        step = float((adapters[None][k] - before[k]).abs().max())
        assert float((adapters[5][k] - adapters[None][k]).abs().max()) <= 2e-3 * step, k


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["plain", "offload"])
def test_gpu_nvfp4_chunked_equals_unchunked(mode, tiny_qwen2_nvfp4_dir):
    """On CUDA (Triton NVFP4 backend, pinned-memory offload for 'offload'), bf16: the same gradients."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from qerl_lib.nvfp4_loader import load_nvfp4_model

    def make():
        torch.manual_seed(0)
        return _with_lora(load_nvfp4_model(tiny_qwen2_nvfp4_dir, dtype=torch.bfloat16, device="cuda"))

    ids = torch.randint(4, 200, (2, 40), generator=torch.Generator().manual_seed(1)).cuda()
    ref_loss, ref = _model_grads(make, mode, None, ids)
    loss, grads = _model_grads(make, mode, 17, ids)
    assert _close(loss, ref_loss, 1e-3)
    for n in ref:
        assert torch.isfinite(grads[n]).all() and grads[n].abs().sum() > 0, n
        assert _close(grads[n], ref[n], 2e-2), n
