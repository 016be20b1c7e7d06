"""Gradient checkpointing of the decoder layers, optionally with each layer's input in host memory.

Checkpointing keeps only each decoder layer's input between forward and backward and recomputes
the layer in backward. Those inputs are L x [B, T, H] tensors: for Qwen2.5-7B at micro-batch 2 and
T = 2304 that is 28 x 33 MB = 0.92 GB of GPU memory held through the whole step.

With `offload`, each layer runs under reentrant checkpointing, whose only tensors saved for
backward are exactly the layer's inputs (its forward runs without grad), inside saved-tensor hooks
that copy each saved CUDA tensor to pinned host memory and back when backward recomputes that
layer. The copies are issued on the compute stream without a host sync (stream order makes them
safe), so they cost PCIe time, not a stall per layer. This is the checkpoint-input offload that
verl's `enable_activation_offload` does. Nothing else is offloaded: weights saved outside the
layers (the head's) stay where they are, because the hooks are only active inside a layer's
checkpoint call.

Gradients are the same as with plain checkpointing (the recomputation is identical; CPU test).

With `mlp_chunk_tokens`, every decoder layer's MLP runs over token chunks and is recomputed chunk by
chunk in its own backward (`qerl_lib.chunked_mlp`); the layer recomputation (reentrant or not) then
runs inside `chunked_mlp.recomputing()`, where the chunked MLP skips itself, so the MLP is still
computed twice per step, not three times.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from qerl_lib.chunked_mlp import recompute_contexts, recomputing, set_mlp_chunking


def _pack_to_host(t: torch.Tensor):
    """Saved tensor -> (device, host copy). CUDA: async copy into pinned memory on the current stream."""
    if t.is_cuda:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return t.device, host
    return t.device, t.detach().clone()  # CPU: the same round trip, so tests exercise the hooks


def _unpack_from_host(packed) -> torch.Tensor:
    device, host = packed
    return host.to(device, non_blocking=True)


def _flag_recompute(function):
    """`function` that runs inside `recomputing()` when grad is enabled: under reentrant
    checkpointing the forward runs without grad and only the recomputation (in backward) with it."""

    @functools.wraps(function)
    def run(*args):
        if not torch.is_grad_enabled():
            return function(*args)
        with recomputing():
            return function(*args)

    return run


def offloaded_checkpoint(function, *args, flag_recompute: bool = False):
    """`torch.utils.checkpoint` (reentrant) of `function(*args)` whose saved inputs live on the host.

    transformers' `GradientCheckpointingLayer` calls this with the layer's keyword arguments bound
    into `function`, so the saved tensors are the positional ones (the hidden states [B, T, H]).
    Without grad (reference and old-logprob passes) there is nothing to save: plain call.
    `flag_recompute`: the recomputation runs inside `chunked_mlp.recomputing()`.
    """
    if not torch.is_grad_enabled():
        return function(*args)
    with torch.autograd.graph.saved_tensors_hooks(_pack_to_host, _unpack_from_host):
        return checkpoint(_flag_recompute(function) if flag_recompute else function, *args, use_reentrant=True)


def enable_checkpointing(model, offload: bool = False, mlp_chunk_tokens: int | None = None) -> None:
    """Checkpoint every decoder layer of a (PEFT-wrapped) transformers model; `offload` moves the
    checkpointed layer inputs to pinned host memory between forward and backward; `mlp_chunk_tokens`
    (None or 0: off) runs each decoder layer's MLP over chunks of that many tokens
    (`qerl_lib.chunked_mlp`; ValueError for a model type or MLP it does not support). Calling it
    again replaces all three settings."""
    chunk = int(mlp_chunk_tokens or 0)
    set_mlp_chunking(model, chunk)  # first: refuses an unsupported model before anything changes
    kwargs = {"use_reentrant": False}
    if chunk:
        kwargs["context_fn"] = recompute_contexts  # the recomputation runs inside recomputing()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if offload:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        func = functools.partial(offloaded_checkpoint, flag_recompute=True) if chunk else offloaded_checkpoint
        base._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=func)
    # Reentrant checkpointing needs an input that requires grad to reach the LoRA weights inside.
    model.enable_input_require_grads()
