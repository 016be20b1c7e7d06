"""The decoder layers' MLP over token chunks, recomputed chunk by chunk in backward.

A Llama/Qwen2-style MLP, `down_proj(act_fn(gate_proj(x)) * up_proj(x))` with each projection a
frozen base (NVFP4 or dense) plus PEFT LoRA, keeps four [tokens, intermediate] tensors for its
backward: gate_proj's output (for the activation), act and up (for the product), and the product
again as down_proj's LoRA input, upcast to float32 because the adapters are float32 (a dense base
also keeps the bf16 product). Per token that is 10 x intermediate bytes with an NVFP4 base and 12
with a dense one; in the backward of the one layer that gradient checkpointing has recomputed, the
gradients of those tensors come on top (a float32 and two bf16 [tokens, intermediate] for down_proj's
input gradient alone). Measured on the CPU (`benchmarks/chunked_mlp_memory.py`), forward with grad
plus backward peaks 18.1 (dense) / 18.7 (NVFP4) bytes per token and intermediate column above what
was live before: 1.47 / 1.52 GiB for Qwen2.5-7B at micro-batch 2 (4608 tokens, intermediate 18944),
the largest single item beside the weights at the training step's peak.

`ChunkedMLPFunction` runs the MLP over row chunks of `chunk` tokens:

    forward:   y[s:s+c] = mlp(x[s:s+c]) without grad, for each chunk; only x [N, H] is saved
    backward:  for each chunk: recompute y_c = mlp(x_c) with grad (same RNG state and autocast as
               the forward), then autograd.grad(y_c, (x_c, LoRA params), dy_c); dx is written
               chunk by chunk, the parameter gradients are summed over the chunks

so one chunk's [c, intermediate] tensors are the most of them that ever exist. The math is the
unchunked MLP's row by row (every op of the MLP is per token); the parameter gradients differ only
by the float32 summation order of the chunks.

No extra FLOPs under this project's checkpointing: the checkpointed layer's recomputation (which is
what would otherwise rebuild the MLP's saved tensors) runs inside `recomputing()` (set by
`qerl_lib.checkpointing` around the recompute, reentrant and non-reentrant alike), where this
Function skips the MLP and returns zeros: in the supported decoder layers (`CHUNKABLE_MODEL_TYPES`)
the MLP's output only enters `residual + mlp(...)`, whose result a recomputation never reads (the
add saves nothing, and the recomputed layer output is discarded). The MLP is then computed twice per
step, as before (forward, then the chunked recomputation in backward), not three times. The cost is
one matmul call per chunk instead of one per token batch: smaller GEMMs, and an NVFP4 base
dequantizes its weights once per chunk and call (`qerl_lib.nvfp4_linear`).

`set_mlp_chunking(model, chunk)` switches every decoder layer's MLP of a supported model to this
(chunk None or 0: back to the plain forward); `optim.mlp_chunk_tokens` sets it through
`qerl_lib.checkpointing.enable_checkpointing`.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn

CHUNKABLE_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})
"""transformers model types whose decoder layer ends with `residual + mlp(post_attention_layernorm(h))`
(checked in their modeling files, transformers 5.17) and whose MLP is
`down_proj(act_fn(gate_proj(x)) * up_proj(x))`: the recomputation skip above is exact only there."""

MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")

_state = threading.local()


def is_recomputing() -> bool:
    """True inside a checkpointed layer's recomputation (see `recomputing`)."""
    return getattr(_state, "recomputing", 0) > 0


class recomputing:
    """Marks a gradient-checkpointing recomputation on this thread: chunked MLPs run inside it
    return zeros instead of their output (their backward recomputes the MLP itself). Reusable and
    nestable (a frame may be recomputed again, e.g. for a second backward with retain_graph); an
    exception (non-reentrant checkpointing stops a recomputation early by raising) resets it."""

    def __enter__(self) -> None:
        _state.recomputing = getattr(_state, "recomputing", 0) + 1

    def __exit__(self, *exc) -> None:
        _state.recomputing -= 1


def recompute_contexts():
    """`context_fn` for non-reentrant `torch.utils.checkpoint`: (forward context, recompute context)."""
    return contextlib.nullcontext(), recomputing()


def _plain_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MLP's own forward (its class's), whatever forward the instance has been given."""
    return type(mlp).forward(mlp, x)


def _has_active_dropout(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and m.training for m in module.modules())


def _forward_chunks(mlp: nn.Module, x2d: torch.Tensor, chunk: int) -> torch.Tensor:
    """mlp over x2d [N, H] in row chunks of `chunk`, written into one [N, H_out] output."""
    out = None
    for s in range(0, x2d.shape[0], chunk):
        y = _plain_forward(mlp, x2d[s:s + chunk])
        if out is None:
            out = y.new_empty((x2d.shape[0], y.shape[-1]))
        out[s:s + chunk] = y
        del y  # free this chunk's output before the next chunk's intermediates exist
    return out


class ChunkedMLPFunction(torch.autograd.Function):
    """y [..., H] = mlp(x [..., H]) over token chunks; saves only x; backward recomputes per chunk.

    apply(x, mlp, chunk, *params): `params` are the MLP's parameters that require grad (the LoRA
    A/B matrices), passed so that autograd returns their gradients through this node (works with
    `torch.autograd.grad` as well as `.backward()`).
    """

    @staticmethod
    def forward(ctx, x, mlp, chunk, *params):  # type: ignore[override]
        dev = x.device.type
        ctx.mlp, ctx.chunk, ctx.params = mlp, chunk, params
        ctx.autocast = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        ctx.rng = None
        if _has_active_dropout(mlp):  # LoRA dropout: the backward must redraw the same masks
            ctx.rng = (torch.get_rng_state(), torch.cuda.get_rng_state(x.device) if x.is_cuda else None)
        ctx.save_for_backward(x)
        if is_recomputing():
            # A checkpointed layer's recomputation: nobody reads this output (module docstring).
            out_dtype = ctx.autocast[1] if ctx.autocast[0] else x.dtype
            return x.new_zeros(x.shape[:-1] + (getattr(mlp.down_proj, "out_features", x.shape[-1]),), dtype=out_dtype)
        y = _forward_chunks(mlp, x.reshape(-1, x.shape[-1]), chunk)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        mlp, chunk, params = ctx.mlp, ctx.chunk, ctx.params
        need_x = ctx.needs_input_grad[0]
        need_p = [ctx.needs_input_grad[3 + i] for i in range(len(params))]
        x2d = x.reshape(-1, x.shape[-1])
        g2d = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = torch.empty_like(x2d) if need_x else None
        grad_p: list[torch.Tensor | None] = [None] * len(params)
        wanted = [p for p, need in zip(params, need_p) if need]
        rng = contextlib.nullcontext()
        if ctx.rng is not None:
            rng = torch.random.fork_rng(devices=[x.device] if x.is_cuda else [])
        with rng, torch.enable_grad(), torch.autocast(x.device.type, dtype=ctx.autocast[1], enabled=ctx.autocast[0]):
            if ctx.rng is not None:  # chunks in forward order: the same dropout draws as the forward
                torch.set_rng_state(ctx.rng[0])
                if ctx.rng[1] is not None:
                    torch.cuda.set_rng_state(ctx.rng[1], x.device)
            for s in range(0, x2d.shape[0], chunk):
                xc = x2d[s:s + chunk].detach().requires_grad_(need_x)
                yc = _plain_forward(mlp, xc)  # this chunk's [c, intermediate] tensors, saved by autograd
                inputs = ([xc] if need_x else []) + wanted
                grads = list(torch.autograd.grad(yc, inputs, g2d[s:s + chunk], allow_unused=True))
                del yc  # (the graph and its saved tensors are already freed by autograd.grad)
                if need_x:
                    grad_x[s:s + chunk] = grads.pop(0)
                k = 0
                for i, need in enumerate(need_p):
                    if need:
                        g = grads[k]
                        k += 1
                        if g is not None:
                            grad_p[i] = g if grad_p[i] is None else grad_p[i].add_(g)
                del grads
        return (None if grad_x is None else grad_x.view_as(x), None, None, *grad_p)


def chunked_mlp(mlp: nn.Module, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """mlp(x [..., H]) -> [..., H_out] over chunks of `chunk` tokens (see the module docstring).

    At most `chunk` tokens: the plain forward. Without grad (reference and old-logprob passes, or
    nothing requires grad): the chunks without a Function, so that the no-grad passes give the same
    values as the training forward (both chunked alike).
    """
    n = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if n <= chunk:
        return _plain_forward(mlp, x)
    params = tuple(p for p in mlp.parameters() if p.requires_grad)
    if torch.is_grad_enabled() and (x.requires_grad or params):
        return ChunkedMLPFunction.apply(x, mlp, chunk, *params)
    with torch.no_grad():
        y = _forward_chunks(mlp, x.reshape(-1, x.shape[-1]), chunk)
    return y.reshape(*x.shape[:-1], y.shape[-1])


class _ChunkedForward:
    """Instance-level `forward` of a chunked MLP (module-level class, so the model still pickles)."""

    def __init__(self, mlp: nn.Module, chunk: int) -> None:
        self.mlp, self.chunk = mlp, chunk

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return chunked_mlp(self.mlp, x, self.chunk)


def _decoder_mlps(model) -> list[tuple[str, nn.Module]]:
    """(name, mlp) of every decoder layer of a (PEFT-wrapped) supported model; raises ValueError
    naming the model type or the module when the model or an MLP does not have the expected shape."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if model_type not in CHUNKABLE_MODEL_TYPES:
        raise ValueError(f"optim.mlp_chunk_tokens: model type {model_type!r} ({type(base).__name__}) is not supported; "
                         f"the chunked MLP handles {sorted(CHUNKABLE_MODEL_TYPES)} (decoder layers ending with "
                         "residual + mlp(h), MLP = down_proj(act_fn(gate_proj(x)) * up_proj(x))); set it to null")
    out = []
    for name, layer in base.named_modules():
        if not isinstance(layer, GradientCheckpointingLayer):
            continue
        mlp = getattr(layer, "mlp", None)
        missing = [p for p in MLP_PARTS if not hasattr(mlp, p)] if mlp is not None else list(MLP_PARTS)
        if missing:
            raise ValueError(f"optim.mlp_chunk_tokens: {name}.mlp ({type(mlp).__name__}) of model type {model_type!r} "
                             f"has no {', '.join(missing)}; the chunked MLP needs {', '.join(MLP_PARTS)}; set it to null")
        out.append((f"{name}.mlp", mlp))
    if not out:
        raise ValueError(f"optim.mlp_chunk_tokens: no decoder layer with an MLP found in {type(base).__name__} "
                         f"(model type {model_type!r}); set it to null")
    return out


def set_mlp_chunking(model, chunk: int | None) -> int:
    """Run every decoder layer's MLP over chunks of `chunk` tokens (None or 0: the plain forward
    again). Returns the number of MLPs changed. Refuses (ValueError) unsupported models when on."""
    if not chunk:
        count = 0
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        for module in base.modules():
            if isinstance(module.__dict__.get("forward"), _ChunkedForward):
                del module.forward
                count += 1
        return count
    if chunk < 0:
        raise ValueError(f"optim.mlp_chunk_tokens must be >= 0, got {chunk}")
    mlps = _decoder_mlps(model)
    for _, mlp in mlps:
        mlp.forward = _ChunkedForward(mlp, int(chunk))
    return len(mlps)
