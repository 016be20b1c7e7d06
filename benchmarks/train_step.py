"""Training-step cost of a frozen NVFP4 base vs a BF16 base (GPU): time and peak memory.

Three modes, each writing one JSON file (with the exact command, device and versions):

- `step` (default): one logprob forward plus backward through LoRA (r16, alpha 32, all seven
  projections) of a Qwen2.5-7B-shaped transformers `Qwen2ForCausalLM` at sequence 2304
  (prompt 256 + completion 2048), for each micro-batch in `--micro-batches`, for the arms
    nvfp4-triton  packed NVFP4 base, fused Triton dequantize-and-multiply kernels
    nvfp4-torch   the same packed base, plain PyTorch dequantization per call
    nvfp4-auto    the layer's own choice: the kernels up to `DENSE_ABOVE_ROWS` rows per call, nvfp4-dq above
    nvfp4-dq      dequantize once per call with one Triton kernel, then cuBLAS (QERL_NVFP4_BACKEND=triton-dq)
    bf16          a BF16 base (nn.Linear)
    nf4           bitsandbytes NF4 + double quant (QLoRA), when bitsandbytes imports
  An arm name with `:full` (e.g. `bf16:full`) measures the same with the log-probs taken from
  the full [B, T, V] logits instead of chunk by chunk (`qerl_lib.head_logprobs`), side by side;
  with `:offload` (e.g. `bf16:offload`) the checkpointed layer inputs wait in pinned host memory
  between forward and backward (`qerl_lib.checkpointing`, `optim.offload_activations`), and its
  ratios are taken against `bf16:offload`; a further `:mlpchunkN` (e.g. `nvfp4-dq:offload:mlpchunk1152`;
  a bare `:mlpchunk` takes `--mlp-chunk-tokens`) runs every decoder layer's MLP over chunks of N
  tokens, recomputed chunk by chunk in backward (`qerl_lib.chunked_mlp`, `optim.mlp_chunk_tokens`):
  its ratios are taken against `bf16` with the same suffixes (like for like), and it is also compared
  with its own arm without the chunks (`peak_vs_unchunked_mlp`, `time_vs_unchunked_mlp`).
  The step is the trainer's own: `qerl_lib.trainer.policy_logprobs` under
  `training_attention`, and a token-mean loss, backward with
  non-reentrant gradient checkpointing (`--no-grad-ckpt` turns it off). Median of
  `--repeats` timed steps (CUDA events) after `--warmup` steps (the first one autotunes the
  kernels); peak = torch.cuda.max_memory_allocated over the timed steps, weights included.
- `grpo32b`: peak GPU memory of a full GRPO/DAPO update step on a Qwen2.5-32B-shaped NVFP4
  model: a no-grad KL-metric pass with the adapter disabled, the policy logprob pass with
  entropy, the DAPO loss, backward (gradient checkpointing), gradient clipping and the
  optimizer step (`qerl_lib.optim.build_optimizer`, the project default), twice; with a
  breakdown (base weights, LoRA + grads + optimizer state, activations and temporaries).
- `linears`: the seven linears of one Qwen2.5-7B layer, forward and input gradient, at
  `--micro-batches` x 2304 tokens: cuBLAS BF16 vs the Triton kernels vs plain PyTorch
  dequantization vs one-kernel Triton dequantization + cuBLAS, with the measured bf16 matmul ceiling
  (`benchmarks/train_step_linears.py`).

Weights are random and built on the GPU directly: NVFP4 layers get random packed codes and
FP8 scales (no 16-bit copy of any quantized weight ever exists), the BF16 arm random bf16
weights, the model skeleton comes from the config on the meta device.

    python benchmarks/train_step.py --mode linears --out benchmarks/results/train_step_linears.json
    python benchmarks/train_step.py --mode step --out benchmarks/results/train_step.json
    python benchmarks/train_step.py --mode grpo32b --out benchmarks/results/train_step_32b.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.train_step_arms import (  # noqa: E402  (re-exported: tests/test_train_step_benchmark.py)
    ARM_NAMES, MLP_CHUNK, arm_name, arm_parts, split_mlp_chunk, step_summary,
)

QWEN25 = {
    # Qwen2.5-7B / -32B (Instruct) config.json values that shape the compute
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, rms_norm_eps=1e-6),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, rms_norm_eps=1e-5),
}
GIB = 1 << 30


def qwen_config(shape: str, layers: int | None):
    from transformers import Qwen2Config

    kw = dict(QWEN25[shape])
    if layers:
        kw["num_hidden_layers"] = layers
    return Qwen2Config(max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=False,
                       use_sliding_window=False, **kw)


# ---------------------------------------------------------------------------------------
# Random models, built on the GPU
# ---------------------------------------------------------------------------------------


def random_nvfp4_linear(in_f: int, out_f: int, bias: bool, device, gen: torch.Generator):
    """NVFP4Linear with random codes and FP8 block scales, made on `device` (W rms ~0.02)."""
    from qerl_lib.nvfp4_linear import NVFP4Linear

    packed = torch.randint(0, 256, (out_f, in_f // 2), dtype=torch.uint8, device=device, generator=gen)
    # random codes have rms |e2m1| ~2.9; global scale 2688 / amax(0.12) = 22400, so block scales
    # around 150 give W rms ~ 2.9 * 150 / 22400 ~ 0.02
    scale = torch.empty(out_f, in_f // 16, device=device).uniform_(100.0, 200.0, generator=gen).to(torch.float8_e4m3fn)
    gs = torch.full((1,), 22400.0, device=device)
    b = torch.zeros(out_f, dtype=torch.bfloat16, device=device) if bias else None
    return NVFP4Linear.from_tensors(packed, scale, gs, bias=b)


def random_bf16_linear(in_f: int, out_f: int, bias: bool, device, gen: torch.Generator):
    lin = nn.Linear(in_f, out_f, bias=bias, device="meta", dtype=torch.bfloat16)
    lin.weight = nn.Parameter(torch.empty(out_f, in_f, dtype=torch.bfloat16, device=device).normal_(0, 0.02, generator=gen),
                              requires_grad=False)
    if bias:
        lin.bias = nn.Parameter(torch.zeros(out_f, dtype=torch.bfloat16, device=device), requires_grad=False)
    return lin


def random_nf4_linear(in_f: int, out_f: int, bias: bool, device, gen: torch.Generator):
    """bitsandbytes Linear4bit (NF4, double quant, bf16 compute): QLoRA's base layer. The bf16
    weight exists only for this layer while it is quantized."""
    import bitsandbytes as bnb

    lin = bnb.nn.Linear4bit(in_f, out_f, bias=bias, compute_dtype=torch.bfloat16, compress_statistics=True,
                            quant_type="nf4", device="meta")
    w = torch.empty(out_f, in_f, dtype=torch.bfloat16, device=device).normal_(0, 0.02, generator=gen)
    lin.weight = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=True, quant_type="nf4").to(device)
    del w
    if bias:
        lin.bias = nn.Parameter(torch.zeros(out_f, dtype=torch.bfloat16, device=device), requires_grad=False)
    return lin


LINEAR_BUILDERS = {"nvfp4": random_nvfp4_linear, "bf16": random_bf16_linear, "nf4": random_nf4_linear}


def build_model(shape: str, quant: str, layers: int | None, device: torch.device, seed: int = 0):
    """Qwen2ForCausalLM of `shape` with random weights on `device`; decoder linears per `quant`."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = qwen_config(shape, layers)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    gen = torch.Generator(device=device).manual_seed(seed)
    make = LINEAR_BUILDERS[quant]
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and ".layers." in f".{name}":
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child,
                    make(module.in_features, module.out_features, module.bias is not None, device, gen))
    for module in model.modules():  # embeddings, norms, lm_head: bf16 on the device
        for pname, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                t = torch.empty(p.shape, dtype=torch.bfloat16, device=device)
                if "norm" in type(module).__name__.lower():
                    t.fill_(1.0)
                elif pname == "bias":
                    t.zero_()
                else:
                    t.normal_(0, 0.02, generator=gen)
                setattr(module, pname, nn.Parameter(t, requires_grad=False))
    model.to(device)  # rotary buffers
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def add_lora(model, grad_ckpt: bool, offload: bool = False):
    from qerl_lib.checkpointing import enable_checkpointing
    from qerl_lib.config import LoraConfig
    from qerl_lib.lora import apply_lora

    peft_model = apply_lora(model, LoraConfig(r=16, alpha=32.0))
    if grad_ckpt:  # as qerl_lib.trainer does
        enable_checkpointing(peft_model, offload=offload)
    peft_model.train()
    return peft_model


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.is_meta:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def base_weight_bytes(peft_model) -> int:
    base = [p for n, p in peft_model.named_parameters() if "lora_" not in n]
    return tensor_bytes(base + list(peft_model.buffers()))


def lora_bytes(peft_model) -> int:
    return tensor_bytes([p for n, p in peft_model.named_parameters() if "lora_" in n])


def make_batch(batch: int, prompt: int, completion: int, vocab: int, device, seed: int = 0):
    from qerl_lib.trainer import Batch

    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, prompt + completion), device=device, generator=g)
    attn = torch.ones_like(ids)
    pos = torch.arange(prompt + completion, device=device).expand(batch, -1).contiguous()
    mask = torch.ones(batch, completion, device=device)
    rlp = -torch.rand(batch, completion, device=device, generator=g) * 3
    adv = torch.randn(batch, device=device, generator=g)
    return Batch(ids, attn, pos, ids[:, prompt:].contiguous(), mask, rlp, adv)


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for mod in ("triton", "transformers", "peft", "bitsandbytes"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            out[mod] = f"unavailable ({type(e).__name__})"
    if torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name()
        out["device_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / GIB, 1)
    return out


def free_gpu():
    gc.collect()
    torch.cuda.empty_cache()


def set_backend(name: str):
    """Register the CUDA backend an arm names: torch, triton, auto (the layer's own split) or dq (triton-dq)."""
    from qerl_lib import nvfp4_linear as nl

    nl.register_matmul_backend("cuda", nl.cuda_backend({"auto": "", "dq": "triton-dq"}.get(name, name)))


# ---------------------------------------------------------------------------------------
# mode: step
# ---------------------------------------------------------------------------------------


def logprob_step(model, batch) -> float:
    """One logprob forward + backward (token-mean of -logp over the completion), under the
    trainer's attention-backend choice (`qerl_lib.trainer.training_attention`)."""
    from qerl_lib.trainer import policy_logprobs, training_attention

    with training_attention(batch.input_ids.device):
        logp, _ = policy_logprobs(model, batch, 1.0, False)
        loss = -(logp * batch.mask).sum() / batch.mask.sum()
        loss.backward()
    return float(loss.detach())


def set_logprobs(mode: str):
    """'chunked': `qerl_lib.head_logprobs` (the trainer's default); 'full': the [B, T, V] logits."""
    import os

    os.environ["QERL_LOGPROBS"] = mode


def time_steps(model, batch, warmup: int, repeats: int) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]
    for _ in range(warmup):
        logprob_step(model, batch)
        for p in params:
            p.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        losses.append(logprob_step(model, batch))
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        for p in params:
            p.grad = None
    times.sort()
    return {"ms_median": times[len(times) // 2], "ms_all": times, "peak_bytes": torch.cuda.max_memory_allocated(),
            "peak_gib": round(torch.cuda.max_memory_allocated() / GIB, 2), "loss": losses[-1],
            "loss_finite": all(math.isfinite(v) for v in losses)}


def mode_step(args, device) -> dict:
    from qerl_lib.checkpointing import enable_checkpointing

    cfg = qwen_config(args.shape, args.layers)
    seq = args.prompt + args.completion
    out = {"arms": {}, "config": {
        "shape": f"Qwen2.5-{args.shape.upper()}", "layers": cfg.num_hidden_layers, "sequence": seq,
        "prompt": args.prompt, "completion": args.completion, "micro_batches": args.micro_batches,
        "lora": "r16 alpha32 q,k,v,o,gate,up,down (float32 adapters, PEFT)", "gradient_checkpointing": args.grad_ckpt,
        "attention": "sdpa", "activations": "bf16", "warmup": args.warmup, "repeats": args.repeats,
        "step": "qerl_lib.trainer.policy_logprobs + token-mean loss + backward, under training_attention; "
                "arms without ':full' take the log-probs chunk by chunk from the hidden states "
                "(qerl_lib.head_logprobs), ':full' arms from the full logits (logits_to_keep = completion + 1)",
        "mlp_chunk": "':mlpchunkN' arms: every decoder layer's MLP over chunks of N tokens, recomputed chunk by "
                     "chunk in backward instead of in the layer recomputation (qerl_lib.chunked_mlp, "
                     "optim.mlp_chunk_tokens)"}}
    arms = list(args.arms)
    groups = []  # (quant, [arms sharing that model])
    for q in ("nvfp4", "bf16", "nf4"):
        group = [a for a in arms if arm_parts(a)[0] == q]
        if group:
            groups.append((q, group))
    for quant, group in groups:
        free_gpu()
        before = torch.cuda.memory_allocated()
        t0 = time.time()
        try:
            model = add_lora(build_model(args.shape, quant, args.layers, device), args.grad_ckpt)
        except Exception as e:  # noqa: BLE001 - e.g. bitsandbytes missing: record and go on
            for arm in group:
                out["arms"][arm] = {"error": f"{type(e).__name__}: {e}"}
            print(f"[{quant}] build failed: {e}", flush=True)
            continue
        built = {"build_s": round(time.time() - t0, 1), "base_weight_bytes": base_weight_bytes(model),
                 "lora_bytes": lora_bytes(model), "allocated_after_build": torch.cuda.memory_allocated() - before}
        for arm in group:
            _, backend, variant = arm_parts(arm)
            mlp_chunk = split_mlp_chunk(arm)[1]
            if mlp_chunk and not args.grad_ckpt:
                out["arms"][arm] = {"error": "':mlpchunk' needs gradient checkpointing (drop --no-grad-ckpt)"}
                continue
            if backend is not None:
                set_backend(backend)
            set_logprobs("full" if variant == "full" else "chunked")
            if args.grad_ckpt:
                enable_checkpointing(model, offload=variant == "offload", mlp_chunk_tokens=mlp_chunk)
            res = dict(built, micro_batch={}, mlp_chunk_tokens=mlp_chunk or None)
            for mb in args.micro_batches:
                batch = make_batch(mb, args.prompt, args.completion, cfg.vocab_size, device)
                try:
                    r = time_steps(model, batch, args.warmup, args.repeats)
                except torch.OutOfMemoryError as e:
                    r = {"error": f"OutOfMemoryError: {str(e)[:200]}"}
                    free_gpu()
                r["tokens"] = mb * seq
                res["micro_batch"][str(mb)] = r
                print(f"[{arm}] mb={mb}: {r.get('ms_median', r.get('error'))} ms, peak {r.get('peak_gib')} GiB", flush=True)
                del batch
            out["arms"][arm] = res
        del model
        free_gpu()
    out["summary"] = step_summary(out["arms"], args.micro_batches)
    try:
        from qerl_lib.kernels.nvfp4_triton import tuned_configs

        out["tuned_configs"] = tuned_configs()
    except Exception:  # noqa: BLE001
        pass
    return out


# ---------------------------------------------------------------------------------------
# mode: grpo32b
# ---------------------------------------------------------------------------------------


def mode_grpo32b(args, device) -> dict:
    from qerl_lib.config import AlgoConfig, OptimConfig
    from qerl_lib.losses import LOSSES, LossInputs, LossNorm
    from qerl_lib.optim import build_optimizer, clip_grad_norm
    from qerl_lib.trainer import policy_logprobs, training_attention

    shape = args.shape if args.shape != "7b" else "32b"
    cfg = qwen_config(shape, args.layers)
    free_gpu()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    model = add_lora(build_model(shape, "nvfp4", args.layers, device), True, offload=args.offload)
    build_s = time.time() - t0
    build_peak = torch.cuda.max_memory_allocated()
    weights, lora = base_weight_bytes(model), lora_bytes(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optim_cfg = OptimConfig()
    optimizer = build_optimizer(params, optim_cfg, device)
    algo = AlgoConfig()  # DAPO, eps 0.2/0.28, TIS cap 2, kl_metric on
    mb = args.micro_batches[0]
    steps = []
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for step in range(2):
        batch = make_batch(mb, args.prompt, args.completion, cfg.vocab_size, device, seed=step)
        norm = LossNorm.from_masks([batch.mask], max_len=args.completion)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t = time.time()
        optimizer.zero_grad(set_to_none=True)
        with training_attention(device):
            with torch.no_grad(), model.disable_adapter():  # the trainer's KL metric (reference = adapter off)
                ref = policy_logprobs(model, batch, 1.0, False)[0]
            peak_ref = torch.cuda.max_memory_allocated()
            logp, entropy = policy_logprobs(model, batch, 1.0, True)
            x = LossInputs(logp=logp, old_logp=logp.detach(), advantages=batch.advantages, mask=batch.mask,
                           norm=norm, rollout_logp=batch.rollout_logp, ref_logp=ref)
            loss, _ = LOSSES[algo.loss](x, algo)
            loss.backward()
        peak_bwd = torch.cuda.max_memory_allocated()
        grad_norm = clip_grad_norm(params, optim_cfg.grad_clip)
        optimizer.step()
        torch.cuda.synchronize()
        grads = tensor_bytes([p.grad for p in params])
        opt_state = tensor_bytes([v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)])
        steps.append({"seconds": round(time.time() - t, 2), "peak_bytes": torch.cuda.max_memory_allocated(),
                      "peak_gib": round(torch.cuda.max_memory_allocated() / GIB, 2),
                      "peak_ref_pass_gib": round(peak_ref / GIB, 2), "peak_through_backward_gib": round(peak_bwd / GIB, 2),
                      "loss": float(loss.detach()), "grad_norm": grad_norm, "grad_bytes": grads,
                      "optimizer_state_bytes": opt_state})
        print(f"[grpo32b] step {step}: {steps[-1]}", flush=True)
        del batch, ref, logp, entropy, loss
    from qerl_lib.nvfp4_linear import get_matmul_backend

    matmul_backend = get_matmul_backend(device).name  # the layer's own choice, settled by the steps above
    peak = max(s["peak_bytes"] for s in steps)
    last = steps[-1]
    fixed = weights + lora + last["grad_bytes"] + last["optimizer_state_bytes"]
    out = {
        "config": {"shape": f"Qwen2.5-{shape.upper()}", "layers": cfg.num_hidden_layers, "micro_batch": mb,
                   "prompt": args.prompt, "completion": args.completion, "sequence": args.prompt + args.completion,
                   "gradient_checkpointing": "reentrant, every decoder layer, inputs offloaded to pinned host memory"
                   if args.offload else "non-reentrant, every decoder layer",
                   "base": "packed NVFP4 (random codes/scales built on the GPU; embeddings and lm_head bf16)",
                   "matmul": matmul_backend,
                   "lora": "r16 alpha32, 7 projections, float32", "optimizer": type(optimizer).__module__ + "." + type(optimizer).__name__,
                   "loss": f"{algo.loss} (eps {algo.eps_low}/{algo.eps_high}, tis_cap {algo.tis_cap}) + KL-metric pass",
                   "rollout_engine": "not resident (asleep: vLLM sleep mode releases weights and KV cache); not measured here"},
        "build_seconds": round(build_s, 1), "build_peak_gib": round(build_peak / GIB, 2),
        "steps": steps,
        "peak_gib": round(peak / GIB, 2),
        "breakdown_gib": {
            "base_weights": round(weights / GIB, 2),
            "lora_params": round(lora / GIB, 3),
            "lora_grads": round(last["grad_bytes"] / GIB, 3),
            "optimizer_state": round(last["optimizer_state_bytes"] / GIB, 3),
            "activations_and_temporaries_at_peak": round((peak - fixed) / GIB, 2),
        },
        "fits_80GB": peak < 80e9,
    }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["step", "grpo32b", "linears"], default="step")
    ap.add_argument("--shape", choices=sorted(QWEN25), default="7b")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    ap.add_argument("--micro-batches", type=int, nargs="+", default=None, help="default: 2 8 (grpo32b: 2)")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--completion", type=int, default=2048)
    ap.add_argument("--arms", nargs="+", metavar="ARM", default=["nvfp4-triton", "nvfp4-torch", "bf16", "nf4"],
                    type=arm_name,
                    help=f"step: ARM[:full|:offload][:mlpchunk[N]], ARM one of {', '.join(ARM_NAMES)}; ':full' computes "
                         "the log-probs from the full logits (the old path), ':offload' keeps the checkpointed layer "
                         "inputs in host memory, ':mlpchunkN' runs the MLPs over chunks of N tokens")
    ap.add_argument("--mlp-chunk-tokens", type=int, default=1152,
                    help="tokens per MLP chunk of arms with a bare ':mlpchunk' (default 1152: a quarter of micro-batch "
                         "2 x 2304, above the 1024 rows up to which NVFP4 calls take the fused kernels)")
    ap.add_argument("--no-grad-ckpt", dest="grad_ckpt", action="store_false")
    ap.add_argument("--offload", action="store_true",
                    help="grpo32b: keep the checkpointed layer inputs in pinned host memory (optim.offload_activations)")
    ap.add_argument("--sweep", action="store_true", help="linears: also time every prefill configuration")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.mlp_chunk_tokens < 1:
        ap.error("--mlp-chunk-tokens must be positive")
    # a bare ':mlpchunk' names its size, so the JSON keys say what ran
    args.arms = [a + str(args.mlp_chunk_tokens) if a.endswith(MLP_CHUNK) else a for a in args.arms]
    if args.micro_batches is None:
        args.micro_batches = [2] if args.mode == "grpo32b" else [2, 8]
    if not torch.cuda.is_available():
        raise SystemExit("train_step needs a CUDA GPU")
    import logging

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    result = {"mode": args.mode,
              "command": "python " + " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
              "versions": versions()}
    if args.mode == "linears":
        from benchmarks.train_step_linears import mode_linears
    else:
        mode_linears = None
    result.update({"step": mode_step, "grpo32b": mode_grpo32b, "linears": mode_linears}[args.mode](args, device))
    result["wall_seconds"] = round(time.time() - t0, 1)
    from qerl_lib.io import atomic_write_text

    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(result, indent=2) + "\n")
    print(json.dumps(result.get("summary") or result.get("breakdown_gib") or
                     {k: v.get("layer_fwd_plus_grad_ms") for k, v in result.get("micro_batch", {}).items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
