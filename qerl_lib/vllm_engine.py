"""The vLLM rollout backend: one long-lived `vllm.LLM` behind the same rollout interface as
the transformers backend (`Policy.load_adapter / set_noise / generate`).

vLLM is a GPU-only, optional dependency (`pip install -e ".[gpu]"`, or the carried wheel set
of `scripts/device_vllm.sh` on the lent H200). This module imports it lazily: the pure parts
(sampling translation, adapter bookkeeping, the norm-noise writer, the NVFP4 checkpoint writer)
import and are tested without it.

What the engine does, and why:

- **Checkpoint.** The compressed-tensors NVFP4A16 checkpoint of the convert stage (vLLM picks
  `MarlinNvFp4LinearKernel` on Hopper by itself; no flags) or the BF16 base, loaded as is.

- **Adapters, explicitly versioned.** `set_policy(adapter_dir, version)` removes the previous
  `LoRARequest` by id (`llm_engine.remove_lora`) and then adds a new one whose integer id is
  fresh for this engine (a counter, so re-loading the same version with different bytes can
  never hit vLLM's adapter cache); its name is `qerl-v<version>-<adapter hash>`. Generation
  passes that request explicitly. Nothing relies on LRU eviction (`max_loras=1`,
  `max_cpu_loras=1`, and the old id is gone before the new one arrives). Trained norm weights
  (`norms.safetensors` beside the adapter, `lora.train_norms`) are written into vLLM's norms
  by the worker extension, since a PEFT LoRA cannot carry them.

- **AQN that really reaches vLLM.** `AQNWorkerExtension` is mixed into vLLM's GPU worker
  (`worker_extension_cls`); `collective_rpc("qerl_set_noise", ...)` finds the targets by
  module *name* (vLLM's own `RMSNorm` class, not transformers'), keeps a clean copy of each,
  and writes `clean + qerl_lib.aqn.noise_vector(key, ...)` in place with `copy_` (never a
  rebind, so CUDA graphs see it). The noise is drawn on a CPU generator from (seed, step,
  key), so it is bit-identical to what the trainer's `NoiseInjector` writes; each call starts
  from the clean copy (no random walk) and sigma 0 restores it exactly. The prefix cache is
  reset after every change of noise or adapter (cached KV blocks were computed by the old
  weights).

- **Sampling logprobs = log softmax(logits / T) of the sampled token, before top-p** (the
  project's convention, `qerl_lib.sampling`). vLLM 0.26 offers `logprobs_mode`
  `raw_logprobs` (log_softmax of the logits before temperature, penalties and top-p/top-k)
  and `processed_logprobs` (after temperature *and* after the top-k/top-p mask, i.e.
  renormalised over the nucleus: `v1/worker/gpu/sample/sampler.py` and
  `v1/sample/sampler.py` both return the masked logits as "processed"). Neither is the
  convention when top_p < 1. So the engine runs in `raw_logprobs` mode and folds the
  temperature into the logits instead: the worker sets `LogitsProcessor.scale = 1 / T`
  (applied eagerly in `compute_logits`, outside CUDA graphs) and requests ask for
  temperature 1. The raw logprob is then log_softmax(logits / T), and the sampled
  distribution (softmax(logits / T), then top-p) is the same as sampling at temperature T.
  Greedy requests (T = 0) use scale 1 and record the untempered log softmax, as the
  transformers backend does. All requests of one `generate` call share one temperature.

- **Per-request seeds** (`SamplingParams(seed=...)`): a row is a function of its seed.

- **Sleep and wake** (`enable_sleep_mode=True`): `sleep()` (level 1) offloads the weights to
  CPU memory and drops the KV cache so training can use the GPU; `wake_up()` restores them.

- **Dense fallback for large batches (optional, `dense_above`).** Marlin's W4A16 GEMM reads a
  quarter of the bytes of a BF16 GEMM, which wins when decode is bound by reading weights
  (small batches), and loses to cuBLAS once the batch makes the GEMM compute-bound. With
  `dense_above=M*` every NVFP4 linear layer also keeps its dequantized BF16 weight (made once
  at load time by `qerl_lib.nvfp4.dequantize_nvfp4`, the project's bit-exact
  compressed-tensors dequantization) and runs a custom op `qerl::nvfp4_hybrid_linear` that
  takes the Marlin kernel for M <= M* rows and `F.linear` on the dense copy above. The op is
  opaque to torch.compile, so the branch is taken per captured CUDA-graph size. Memory cost:
  2 bytes per quantized weight on top of the packed 0.5625 (for a 7B model about +13 GB).
  Both paths compute with the same NVFP4 weights; they differ by bf16 accumulation order only.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from qerl_lib.aqn import aqn_norms, noise_vector, norm_key
from qerl_lib.sampling import Completion, SamplingParams

log = logging.getLogger(__name__)

EXTENSION = "qerl_lib.vllm_engine.AQNWorkerExtension"
"""Qualified name passed to `vllm.LLM(worker_extension_cls=...)`."""
LOGPROBS_MODE = "raw_logprobs"
"""vLLM logprobs mode used with the temperature folded into the logits scale (module doc)."""
DENSE_ABOVE_ENV = "QERL_VLLM_DENSE_ABOVE"
"""Environment variable read by the engine's worker: rows above which NVFP4 linears run dense."""
NORMS_FILE = "norms.safetensors"
VALID_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
"""`max_lora_rank` values vLLM 0.26 accepts."""


# ============================================================================ pure helpers


def vllm_sampling_kwargs(params: SamplingParams, seed: int, stop_token_ids: Iterable[int]) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` for one row (temperature folded into the logit scale).

    Greedy (temperature <= 0): temperature 0, top_p 1. Sampled: temperature 1 (the engine
    scales the logits by 1/T, see `logit_scale`), the row's top_p. One sample, the row's own
    seed, the sampled token's logprob only (`logprobs=0`), no detokenization (the stages
    decode), and the policy's EOS ids as stop tokens (the token is kept in the output, as the
    transformers backend keeps it).
    """
    greedy = params.temperature <= 0
    return {
        "n": 1,
        "seed": int(seed),
        "temperature": 0.0 if greedy else 1.0,
        "top_p": 1.0 if greedy else float(params.top_p),
        "max_tokens": int(params.max_new_tokens),
        "logprobs": 0,
        "stop_token_ids": sorted(int(t) for t in stop_token_ids),
        "detokenize": False,
    }


def logit_scale(params: SamplingParams) -> float:
    """Multiplier of the logits for one `generate` call: 1/T when sampling, 1 when greedy."""
    return 1.0 if params.temperature <= 0 else 1.0 / float(params.temperature)


def to_completion(output) -> Completion:
    """A `qerl_lib.sampling.Completion` from one vLLM `RequestOutput` (n = 1).

    `finish_reason` "stop" (a stop token, kept as the last token) or "length"; anything else
    (an aborted request) is an error. Logprobs are the sampled tokens' own (one per token).
    """
    (out,) = output.outputs
    ids = [int(t) for t in out.token_ids]
    lps_src = out.logprobs
    if lps_src is None or len(lps_src) != len(ids):
        raise RuntimeError(f"vLLM returned {0 if lps_src is None else len(lps_src)} logprobs for {len(ids)} tokens")
    lps = [float(lps_src[i][tok].logprob) for i, tok in enumerate(ids)]
    if out.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM request finished with {out.finish_reason!r}")
    return Completion(ids, lps, out.finish_reason)


class AdapterSlots:
    """The one LoRA adapter an engine holds, with an explicit id per policy version.

    `set(path, version, digest)` is a no-op when (version, digest) is already in place;
    otherwise it removes the previous id (and checks that vLLM no longer lists it), then adds
    a request with a fresh id (a counter starting at 1; ids are never reused). `make_request`
    builds the request (`vllm.lora.request.LoRARequest` on a real engine).
    """

    def __init__(self, add: Callable, remove: Callable, list_ids: Callable, make_request: Callable):
        self._add, self._remove, self._list, self._make = add, remove, list_ids, make_request
        self._next_id = 1
        self.request = None
        self.version: int | None = None
        self.digest: str | None = None
        self.swaps = 0

    def set(self, path: str | Path, version: int, digest: str):
        if self.request is not None and self.version == version and self.digest == digest:
            return self.request
        if self.request is not None:
            old = self.request.lora_int_id
            self._remove(old)
            if old in set(self._list()):
                raise RuntimeError(f"vLLM still lists adapter id {old} after remove_lora")
            self.request = None
        lora_id = self._next_id
        self._next_id += 1
        request = self._make(f"qerl-v{version}-{digest[:12]}", lora_id, str(path))
        if self._add(request) is False:
            raise RuntimeError(f"vLLM refused adapter {path} (id {lora_id})")
        self.request, self.version, self.digest = request, version, digest
        self.swaps += 1
        return request

    def clear(self) -> None:
        if self.request is not None:
            self._remove(self.request.lora_int_id)
        self.request, self.version, self.digest = None, None, None


class NormNoise:
    """Clean copies of a model's AQN targets and the in-place writer of clean + noise.

    The same arithmetic as `qerl_lib.aqn.NoiseInjector.apply` (float32 sum, one cast to the
    weight's dtype, `copy_` into the existing storage), on any model whose modules are named
    `...layers.<i>.input_layernorm` / `post_attention_layernorm` (HF, PEFT or vLLM), so the
    noised weights are bit-identical to the trainer's for the same clean weights.
    `base` holds the checkpoint's norms; `clean` is `base` overridden by trained norms that
    came with the adapter (`set_overrides`).
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.targets = aqn_norms(model)
        if not self.targets:
            raise ValueError("no AQN targets (input_layernorm / post_attention_layernorm) in the model")
        self.base = {k: m.weight.detach().clone() for k, m in self.targets}
        self.clean = {k: v.clone() for k, v in self.base.items()}
        self._others: dict[str, tuple[torch.nn.Module, torch.Tensor]] = {}
        """Other norms overridden by an adapter (e.g. the final `model.norm`): module and checkpoint weight."""
        self.state: tuple[float, int, int] = (0.0, 0, 0)

    @torch.no_grad()
    def set_overrides(self, tensors: dict[str, torch.Tensor] | None) -> int:
        """Clean weights = checkpoint norms with `tensors` (trained norms by parameter name) on top.

        AQN targets are matched by `norm_key`; any other name (the final norm) by module name.
        Writes the clean weights (noise off) and returns how many tensors were applied; a later
        call without a tensor restores the checkpoint's weight.
        """
        self.clean = {k: v.clone() for k, v in self.base.items()}
        for module, base in self._others.values():
            module.weight.copy_(base)
        modules = None
        n = 0
        for name, value in (tensors or {}).items():
            mod_name = name.removesuffix(".weight")
            key = norm_key(mod_name)
            if key in self.clean:
                self.clean[key].copy_(value.to(self.clean[key].dtype))
                n += 1
                continue
            if modules is None:
                modules = dict(self.model.named_modules())
            module = modules.get(mod_name)
            if module is None or getattr(module, "weight", None) is None or module.weight.shape != value.shape:
                raise KeyError(f"trained norm {name!r} has no matching module in the engine's model")
            if mod_name not in self._others:
                self._others[mod_name] = (module, module.weight.detach().clone())
            module.weight.copy_(value.to(module.weight.dtype))
            n += 1
        self.apply(0.0, 0, 0)
        return n

    @torch.no_grad()
    def apply(self, sigma: float, seed: int, step: int) -> None:
        for key, mod in self.targets:
            w = mod.weight
            clean = self.clean[key]
            if sigma == 0:
                w.copy_(clean)
                continue
            z = noise_vector(key, w.shape[0], sigma, seed, step).to(w.device)
            w.copy_((clean.float() + z).to(w.dtype))
        self.state = (float(sigma), int(seed), int(step))

    def fingerprint(self) -> str:
        from qerl_lib.aqn import _fingerprint

        return _fingerprint(self.targets)

    def describe(self) -> dict[str, Any]:
        classes = sorted({f"{type(m).__module__}.{type(m).__name__}" for _, m in self.targets})
        return {"targets": len(self.targets), "classes": classes, "state": list(self.state),
                "dtype": str(self.targets[0][1].weight.dtype), "fingerprint": self.fingerprint()}


def dequantize_partitions(
    packed: torch.Tensor, scale: torch.Tensor, global_scales: torch.Tensor, widths: list[int],
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Dense weight [N, K] of a (possibly fused) NVFP4 layer in vLLM's loaded layout.

    vLLM stacks fused projections (q|k|v, gate|up) along the output rows and keeps one
    compressed-tensors global scale per partition; each partition is dequantized with its
    own scale by `qerl_lib.nvfp4.dequantize_nvfp4` (bit-identical to compressed-tensors).
    """
    from qerl_lib.nvfp4 import dequantize_nvfp4

    if sum(widths) != packed.shape[0] or global_scales.numel() != len(widths):
        raise ValueError(f"partitions {widths} / {global_scales.numel()} scales do not match {tuple(packed.shape)}")
    out = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=dtype, device=packed.device)
    row = 0
    for i, w in enumerate(widths):
        out[row:row + w] = dequantize_nvfp4(packed[row:row + w], scale[row:row + w],
                                            global_scales.reshape(-1)[i:i + 1], dtype)
        row += w
    return out


def dense_above_from_env() -> int | None:
    """`QERL_VLLM_DENSE_ABOVE` as an int (rows above which NVFP4 linears run dense), None if unset/off."""
    raw = os.environ.get(DENSE_ABOVE_ENV, "").strip().lower()
    if raw in ("", "off", "none", "false"):
        return None
    return int(raw)


# ============================================================================ checkpoint writer

_LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def nvfp4a16_quantization_config() -> dict[str, Any]:
    """config.json's `quantization_config` as llm-compressor writes it for NVFP4A16, lm_head ignored."""
    return {
        "config_groups": {
            "group_0": {
                "format": "nvfp4-pack-quantized",
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": None, "block_structure": None, "dynamic": False, "group_size": 16,
                    "num_bits": 4, "observer": "memoryless_minmax", "observer_kwargs": {},
                    "scale_dtype": "torch.float8_e4m3fn", "strategy": "tensor_group", "symmetric": True,
                    "type": "float", "zp_dtype": None,
                },
            }
        },
        "format": "nvfp4-pack-quantized",
        "global_compression_ratio": None,
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.19.0",
    }


def write_nvfp4_checkpoint(dense_dir: str | Path, out_dir: str | Path) -> Path:
    """NVFP4A16 compressed-tensors checkpoint of a dense Llama/Qwen2 dir, without llm-compressor.

    The same tensors as `oneshot(QuantizationModifier(targets="Linear", scheme="NVFP4A16",
    ignore=["lm_head"]))` writes (bit for bit; a CPU test compares them): every decoder linear
    becomes weight_packed / weight_scale / weight_global_scale through
    `qerl_lib.nvfp4.quantize_nvfp4`, with q/k/v and gate/up sharing one global scale; all other
    tensors are copied. For machines without llm-compressor (the GPU machine) and for tests.
    """
    import shutil

    from safetensors.torch import load_file, save_file

    from qerl_lib.nvfp4 import nvfp4_global_scale, quantize_nvfp4

    dense_dir, out_dir = Path(dense_dir), Path(out_dir)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(dense_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    groups = {"q_proj": ("q_proj", "k_proj", "v_proj"), "k_proj": ("q_proj", "k_proj", "v_proj"),
              "v_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj"),
              "up_proj": ("gate_proj", "up_proj")}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if len(parts) >= 3 and parts[-1] == "weight" and parts[-2] in _LINEAR_SUFFIXES and ".layers." in name:
            prefix = ".".join(parts[:-2])
            members = groups.get(parts[-2], (parts[-2],))
            gs = nvfp4_global_scale(*[tensors[f"{prefix}.{m}.weight"] for m in members])
            packed, scale, gs = quantize_nvfp4(t, gs)
            base = name.removesuffix(".weight")
            out[f"{base}.weight_packed"] = packed.contiguous()
            out[f"{base}.weight_scale"] = scale.contiguous()
            out[f"{base}.weight_global_scale"] = gs.contiguous()
        else:
            out[name] = t
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dense_dir / "config.json").read_text())
    config["quantization_config"] = nvfp4a16_quantization_config()
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for p in dense_dir.iterdir():
        if p.name not in ("config.json", "model.safetensors.index.json") and p.suffix != ".safetensors" and p.is_file():
            shutil.copy(p, out_dir / p.name)
    return out_dir


# ============================================================================ dense fallback (worker side)

_HYBRID: dict[str, Any] = {"installed": False, "layers": [], "threshold": None, "orig_apply": None}


def _is_nvfp4_a16(layer) -> bool:
    scheme = getattr(layer, "scheme", None)
    return (type(scheme).__name__ == "CompressedTensorsW4A4Fp4" and bool(getattr(scheme, "use_a16", False))
            and hasattr(layer, "weight_packed"))


def install_hybrid_patch() -> bool:
    """Wrap vLLM's compressed-tensors linear method so NVFP4 layers can also run dense (module doc).

    Installed once per process (at import of this module in vLLM's worker, which imports it
    to resolve the worker extension, before the model loads). Inactive unless
    `QERL_VLLM_DENSE_ABOVE` is set when the model loads. Returns whether vLLM was found.
    """
    if _HYBRID["installed"]:
        return True
    try:
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
            CompressedTensorsLinearMethod,
        )
    except Exception:  # vLLM absent (CPU) or a layout we do not know
        return False
    import torch.nn.functional as F

    orig_process = CompressedTensorsLinearMethod.process_weights_after_loading
    orig_apply = CompressedTensorsLinearMethod.apply
    _HYBRID["orig_apply"] = orig_apply

    @torch.library.custom_op("qerl::nvfp4_hybrid_linear", mutates_args=())
    def nvfp4_hybrid_linear(x: torch.Tensor, index: int, with_bias: bool) -> torch.Tensor:
        method, layer = _HYBRID["layers"][index]
        rows = x.numel() // x.shape[-1]
        if rows <= _HYBRID["threshold"]:
            return orig_apply(method, layer, x, layer.bias if with_bias else None)
        return F.linear(x, layer.qerl_dense_weight, layer.qerl_dense_bias if with_bias else None)

    @nvfp4_hybrid_linear.register_fake
    def _(x: torch.Tensor, index: int, with_bias: bool) -> torch.Tensor:
        _, layer = _HYBRID["layers"][index]
        return x.new_empty((*x.shape[:-1], layer.output_size_per_partition))

    def process_weights_after_loading(self, layer):
        threshold = dense_above_from_env()
        dense = bias = None
        if threshold is not None and _is_nvfp4_a16(layer):
            widths = list(getattr(layer, "logical_widths", None) or [layer.weight_packed.shape[0]])
            dense = dequantize_partitions(layer.weight_packed.data, layer.weight_scale.data,
                                          layer.weight_global_scale.data.float(), widths,
                                          getattr(layer, "params_dtype", torch.bfloat16))
            b = getattr(layer, "bias", None)
            bias = None if b is None else b.detach().clone()  # Marlin permutes layer.bias in place
        orig_process(self, layer)
        if dense is not None:
            layer.qerl_dense_weight = dense
            layer.qerl_dense_bias = bias
            layer.qerl_hybrid_index = len(_HYBRID["layers"])
            _HYBRID["layers"].append((self, layer))
            _HYBRID["threshold"] = threshold

    def apply(self, layer, x, bias=None):
        index = getattr(layer, "qerl_hybrid_index", None)
        if index is None:
            return orig_apply(self, layer, x, bias)
        return torch.ops.qerl.nvfp4_hybrid_linear(x, index, bias is not None)

    CompressedTensorsLinearMethod.process_weights_after_loading = process_weights_after_loading
    CompressedTensorsLinearMethod.apply = apply
    _HYBRID["installed"] = True
    return True


def _worker_side_import() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return
    install_hybrid_patch()


_worker_side_import()


# ============================================================================ worker extension


class AQNWorkerExtension:
    """Methods added to vLLM's GPU worker (`worker_extension_cls`), called by name through
    `LLM.collective_rpc("qerl_...", args=...)`. Names carry the `qerl_` prefix: vLLM refuses
    an extension whose attributes collide with the worker's."""

    def _qerl_model(self):
        return self.model_runner.get_model()

    def _qerl_norms(self) -> NormNoise:
        noise = getattr(self, "_qerl_norm_noise", None)
        if noise is None:
            noise = self._qerl_norm_noise = NormNoise(self._qerl_model())
        return noise

    def qerl_set_noise(self, sigma: float, seed: int, step: int) -> dict:
        """Norm weights <- clean + noise(seed, step) in place (sigma 0: clean); returns `describe()`."""
        noise = self._qerl_norms()
        noise.apply(float(sigma), int(seed), int(step))
        torch.cuda.synchronize()
        return noise.describe()

    def qerl_norm_info(self) -> dict:
        return self._qerl_norms().describe()

    def qerl_set_norm_overrides(self, path: str | None) -> int:
        """Clean norms = checkpoint norms with the trained ones of `path` (a safetensors file) on top."""
        tensors = None
        if path:
            from safetensors.torch import load_file

            tensors = load_file(path)
        n = self._qerl_norms().set_overrides(tensors)
        torch.cuda.synchronize()
        return n

    def qerl_set_logit_scale(self, scale: float) -> int:
        """Every `LogitsProcessor.scale` <- its original value * `scale`; returns how many were set."""
        from vllm.model_executor.layers.logits_processor import LogitsProcessor

        n = 0
        for module in self._qerl_model().modules():
            if isinstance(module, LogitsProcessor):
                if not hasattr(module, "_qerl_base_scale"):
                    module._qerl_base_scale = float(module.scale)
                module.scale = module._qerl_base_scale * float(scale)
                n += 1
        if n == 0:
            raise RuntimeError("no vLLM LogitsProcessor found: cannot fold the temperature into the logits")
        return n

    def qerl_linear_info(self) -> dict:
        """Which linear kernels the model runs (class names) and the dense-fallback state."""
        kernels: dict[str, int] = {}
        for module in self._qerl_model().modules():
            scheme = getattr(module, "scheme", None)
            kernel = getattr(scheme, "kernel", None)
            if kernel is not None:
                name = type(kernel).__name__
                kernels[name] = kernels.get(name, 0) + 1
        dense_bytes = sum(layer.qerl_dense_weight.numel() * layer.qerl_dense_weight.element_size()
                          for _, layer in _HYBRID["layers"])
        return {"kernels": kernels, "hybrid_layers": len(_HYBRID["layers"]), "threshold": _HYBRID["threshold"],
                "dense_bytes": dense_bytes}

    def qerl_check_hybrid(self, rows: int = 16) -> dict:
        """Largest relative difference between the Marlin and dense paths of every hybrid layer."""
        worst = 0.0
        g = torch.Generator(device="cuda")
        g.manual_seed(0)
        for method, layer in _HYBRID["layers"]:
            k = layer.qerl_dense_weight.shape[1]
            x = torch.randn(rows, k, device="cuda", dtype=layer.qerl_dense_weight.dtype, generator=g)
            a = _HYBRID["orig_apply"](method, layer, x, None).float()
            b = torch.nn.functional.linear(x, layer.qerl_dense_weight).float()
            worst = max(worst, float((a - b).norm() / b.norm().clamp_min(1e-12)))
        return {"layers": len(_HYBRID["layers"]), "max_rel_diff": worst}


# ============================================================================ the engine


@dataclass
class EngineStats:
    startup_seconds: float = 0.0
    generate_calls: int = 0
    generate_seconds: float = 0.0
    tokens: int = 0
    adapter_swaps: int = 0
    adapter_seconds: float = 0.0
    noise_sets: int = 0
    noise_seconds: float = 0.0
    sleeps: int = 0
    sleep_seconds: float = 0.0
    wake_seconds: float = 0.0
    extra: dict = field(default_factory=dict)


class VLLMEngine:
    """One `vllm.LLM` that serves every rollout and evaluation of a process (module doc).

    `llm` may be given (tests pass a fake); otherwise it is built from `checkpoint` with
    `enable_lora`, `max_lora_rank`, `max_loras=1`, `enable_sleep_mode`, the AQN worker
    extension, `logprobs_mode="raw_logprobs"` and token-id prompts (no tokenizer in vLLM).
    `dense_above`: rows above which NVFP4 linears use their dense copy (None: never; module doc).
    `engine_kwargs` go to `vllm.LLM` unchanged (e.g. `compilation_config`, `max_num_seqs`).
    """

    def __init__(
        self,
        checkpoint: str | Path,
        *,
        max_lora_rank: int = 16,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = False,
        seed: int = 0,
        max_model_len: int | None = None,
        dense_above: int | None = None,
        enable_lora: bool = True,
        sleep_mode: bool = True,
        engine_kwargs: dict | None = None,
        llm=None,
    ):
        if enable_lora and max_lora_rank not in VALID_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {VALID_LORA_RANKS}, got {max_lora_rank}")
        self.checkpoint = Path(checkpoint)
        self.max_lora_rank = max_lora_rank
        self.dense_above = dense_above
        self.sleep_mode = sleep_mode
        self.stats = EngineStats()
        t0 = time.perf_counter()
        if llm is None:
            os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
            os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
            if dense_above is None:
                os.environ.pop(DENSE_ABOVE_ENV, None)
            else:
                os.environ[DENSE_ABOVE_ENV] = str(int(dense_above))
                # The op changes the traced graph but not vLLM's config hash: keep its compiled
                # artifacts apart from those of a plain engine of the same model.
                os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
            from vllm import LLM

            kwargs = dict(
                model=str(self.checkpoint),
                seed=seed,
                gpu_memory_utilization=gpu_memory_utilization,
                enforce_eager=enforce_eager,
                enable_sleep_mode=sleep_mode,
                worker_extension_cls=EXTENSION,
                logprobs_mode=LOGPROBS_MODE,
                skip_tokenizer_init=True,
                generation_config="vllm",
            )
            if enable_lora:
                kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1, max_cpu_loras=1)
            if max_model_len is not None:
                kwargs["max_model_len"] = max_model_len
            kwargs.update(engine_kwargs or {})
            llm = LLM(**kwargs)
        self.llm = llm
        self.stats.startup_seconds = round(time.perf_counter() - t0, 3)
        self.asleep = False
        self._scale = 1.0
        self._noise: tuple[float, int, int] = (0.0, 0, 0)
        self._norms_path: str | None = None
        self.slots = AdapterSlots(self.llm.llm_engine.add_lora, self.llm.llm_engine.remove_lora,
                                  self.llm.llm_engine.list_loras, _make_lora_request)
        log.info("vLLM engine for %s started in %.1f s", self.checkpoint, self.stats.startup_seconds)

    # ------------------------------------------------------------------ state pushed to the workers

    def rpc(self, method: str, *args):
        """`collective_rpc` of one worker-extension method; the first worker's answer (one GPU)."""
        return self.llm.collective_rpc(method, args=tuple(args))[0]

    def set_policy(self, adapter_dir: str | Path | None, version: int) -> None:
        """Serve adapter `version` from `adapter_dir` (None: the base alone); resets the noise to 0."""
        from qerl_lib.lora import adapter_hash

        self.wake_up()
        t0 = time.perf_counter()
        changed = False
        if adapter_dir is None:
            if self.slots.request is not None:
                self.slots.clear()
                changed = True
        else:
            adapter_dir = Path(adapter_dir)
            before = self.slots.request
            self.slots.set(adapter_dir.resolve(), int(version), adapter_hash(adapter_dir))
            changed = self.slots.request is not before
        norms = None
        if adapter_dir is not None and (Path(adapter_dir) / NORMS_FILE).is_file():
            norms = str((Path(adapter_dir) / NORMS_FILE).resolve())
        if norms != self._norms_path or (changed and norms is not None):
            self.rpc("qerl_set_norm_overrides", norms)
            self._norms_path = norms
            self._noise = (0.0, 0, 0)
            changed = True
        if changed:
            self.set_noise(0.0, 0, 0, force=True)
            self.llm.reset_prefix_cache()
            self.stats.adapter_swaps += 1
            self.stats.adapter_seconds += time.perf_counter() - t0

    @property
    def lora_request(self):
        return self.slots.request

    def set_noise(self, sigma: float, seed: int, step: int, force: bool = False) -> dict | None:
        """AQN of (seed, step) at `sigma` in vLLM's norms (sigma 0: the clean weights)."""
        state = (float(sigma), int(seed), int(step)) if sigma > 0 else (0.0, 0, 0)
        if state == self._noise and not force:
            return None
        self.wake_up()
        t0 = time.perf_counter()
        info = self.rpc("qerl_set_noise", *state)
        self.llm.reset_prefix_cache()
        self._noise = state
        self.stats.noise_sets += 1
        self.stats.noise_seconds += time.perf_counter() - t0
        return info

    def norm_info(self) -> dict:
        return self.rpc("qerl_norm_info")

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[list[int]], seeds: list[int], params: SamplingParams,
                 stop_token_ids: Iterable[int] = ()) -> list[Completion]:
        """One completion per (prompt, seed), in order, with the adapter and noise in place."""
        from vllm import SamplingParams as VSamplingParams

        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if not prompts:
            return []
        self.wake_up()
        scale = logit_scale(params)
        if scale != self._scale:
            self.rpc("qerl_set_logit_scale", scale)
            self._scale = scale
        stops = list(stop_token_ids)
        sps = [VSamplingParams(**vllm_sampling_kwargs(params, s, stops)) for s in seeds]
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sps,
                                 lora_request=self.lora_request, use_tqdm=False)
        comps = [to_completion(o) for o in outs]
        self.stats.generate_calls += 1
        self.stats.generate_seconds += time.perf_counter() - t0
        self.stats.tokens += sum(len(c.token_ids) for c in comps)
        return comps

    # ------------------------------------------------------------------ GPU hand-over

    def sleep(self, level: int = 1) -> None:
        """Free the GPU for training (level 1: weights to CPU memory, KV cache dropped)."""
        if self.asleep or not self.sleep_mode:
            return
        t0 = time.perf_counter()
        self.llm.sleep(level=level)
        self.asleep = True
        self.stats.sleeps += 1
        self.stats.sleep_seconds += time.perf_counter() - t0

    def wake_up(self) -> None:
        if not self.asleep:
            return
        t0 = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand the trainer's cached blocks back before vLLM re-maps
        self.llm.wake_up()
        self.asleep = False
        self.stats.wake_seconds += time.perf_counter() - t0

    def stats_dict(self) -> dict:
        s = self.stats
        out = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.__dict__.items()}
        out.update(checkpoint=str(self.checkpoint), max_lora_rank=self.max_lora_rank, dense_above=self.dense_above,
                   adapter_id=None if self.lora_request is None else self.lora_request.lora_int_id,
                   adapter_version=self.slots.version, noise=list(self._noise))
        return out

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # older/newer layouts: dropping the object shuts it down too
                pass
            del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _make_lora_request(name: str, lora_id: int, path: str):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, lora_id, path)


# ============================================================================ choosing the regime


def linear_param_count(config: dict) -> int:
    """Weights of the decoder linears (q, k, v, o, gate, up, down) of a Llama/Qwen2 config."""
    h = config["hidden_size"]
    inter = config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or h // heads
    per_layer = h * heads * head_dim * 2 + 2 * h * kv * head_dim + 3 * h * inter
    return per_layer * config["num_hidden_layers"]


def auto_dense_above(checkpoint: str | Path, budget_bytes: float, threshold: int, share: float = 0.25) -> int | None:
    """`threshold` when the checkpoint is NVFP4 and its dense copies (2 bytes per quantized
    weight) take at most `share` of the engine's memory budget; else None (Marlin only)."""
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    if "quantization_config" not in config:
        return None
    dense = 2 * linear_param_count(config)
    return threshold if dense <= share * budget_bytes else None
