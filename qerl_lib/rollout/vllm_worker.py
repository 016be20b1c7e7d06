"""The worker side of the vLLM backend: code that runs inside vLLM's GPU worker process.

vLLM imports this module in every worker to resolve `worker_extension_cls`
(`qerl_lib.rollout.vllm_worker.AQNWorkerExtension`) before the model loads; the import installs the
NVFP4 regime patches (`install_patches`), inert unless `QERL_VLLM_DENSE_ABOVE` is set. The
driver side (`qerl_lib.rollout.vllm_engine.VLLMEngine`) calls the extension's `qerl_*` methods through
`LLM.collective_rpc`. Nothing here imports vLLM at module level; the weight arithmetic it runs
(`NormNoise`, `dequantize_partitions`, `merge_partitions`, `adapter_deltas`) lives in
`qerl_lib.rollout.vllm_weights`, tested on the CPU.

**AQN in vLLM's own RMSNorm.** `NormNoise` finds the targets by module *name* (vLLM's `RMSNorm`
class, not transformers'), keeps a clean copy of each and writes clean + noise(seed, step) in
place with the trainer's arithmetic (`qerl_lib.aqn.write_noise`), so CUDA graphs see it and the
bits equal the trainer's.

**Regimes of an NVFP4 engine.** Marlin's W4A16 GEMM reads a quarter of the bytes of a BF16
GEMM: it wins while a decode step is bound by reading weights (small batches) and loses to
cuBLAS once the batch makes the GEMM compute-bound (from about 48 rows for the 7B shape on the
H200). vLLM's LoRA adds a memset and two Triton launches per linear per step, about 1.5 ms
per step on the 7B shape, which at batch 1 costs 30% of NVFP4's speed.
- `QERL_VLLM_DENSE_ABOVE` unset: Marlin for every batch, vLLM's LoRA kernels (vLLM as shipped).
- `QERL_VLLM_DENSE_ABOVE=M*`: every NVFP4 linear also keeps a dense BF16 weight (made at load
  by `dequantize_partitions`, the bit-exact compressed-tensors dequantization) and a host copy
  of its packed tensors. Decode steps of at most M* rows run as vLLM ships them (Marlin, then
  the LoRA kernels); steps above M* run one `F.linear` on the dense weight, into which the
  engine has *merged the current adapter* (`merge_adapter`: W + s * B @ A, float32 sum, one
  cast to bf16, redone from the host copy on every adapter change), so no LoRA kernel runs at
  all. The branch lives in opaque custom ops (`qerl::nvfp4_hybrid_linear`,
  `qerl::lora_hybrid_linear`): torch.compile keeps it, and each captured CUDA-graph size takes
  its own branch. Memory: +2 bytes per quantized weight on the GPU (about +13 GB for 7B),
  +0.5625 on the host. A merged engine serves one adapter at a time: every request must carry
  the current adapter (`VLLMEngine.generate` passes it), and tensor parallelism keeps the
  unmerged dense path (base dense + LoRA kernels).
- `QERL_VLLM_GEMV_ROWS=M_g` (off unless set; `rollout.vllm_gemv_rows`, default 8): steps of at most M_g rows run
  the project's NVFP4 decode GEMM (`qerl_lib.kernels.nvfp4_gemv`: the codes read once, dequantized in
  registers, the LoRA of the linear in the same launch with vLLM's own slot-0 LoRA buffers and per-token
  slots) instead of Marlin + the LoRA kernels, inside the same opaque ops, so CUDA graphs capture it.
  Costs a GPU copy of the packed codes and scales in compressed-tensors layout (+0.5625 bytes per
  weight; Marlin keeps its own permuted copy). Engines with `max_loras` > 1 keep vLLM's LoRA path.
  `QERL_VLLM_GEMV_KERNEL=cuda` (`rollout.vllm_gemv_kernel`; `triton` when unset) runs steps of at most
  16 rows on the CUDA C++ kernel (`qerl_lib.kernels.nvfp4_gemv_cuda`, same call, LoRA shrink + GEMV: two
  launches), built when the model loads, before CUDA graphs are captured; larger steps up to M_g keep
  the Triton kernel. `auto` (the config's default) is `cuda` for at most 16 rows when the extension
  builds, and no decode GEMM at all (Marlin, with a warning and `gemv_fallback` in
  `qerl_linear_info`) when it does not (`vllm_gemv.resolve_kernel`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from qerl_lib.rollout.vllm_gemv import (GEMV_KERNEL_ENV, _gemv_lora, gemv_function, gemv_kernel_from_env,
                                        gemv_repack_from_env, gemv_rows_from_env, max_lora_rank, partition_scales,
                                        resolve_kernel)
from qerl_lib.rollout.vllm_weights import NormNoise, adapter_deltas, dequantize_partitions, merge_partitions

logger = logging.getLogger(__name__)

DENSE_ABOVE_ENV = "QERL_VLLM_DENSE_ABOVE"
"""Environment variable read in the worker at load: rows above which NVFP4 linears run dense."""
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""vLLM's fused projections and their HF/PEFT parts (used when the model lists none)."""


def dense_above_from_env() -> int | None:
    """`QERL_VLLM_DENSE_ABOVE` as an int (rows above which NVFP4 linears run dense), None if unset/off."""
    raw = os.environ.get(DENSE_ABOVE_ENV, "").strip().lower()
    if raw in ("", "off", "none", "false"):
        return None
    return int(raw)


# ============================================================================ NVFP4 regimes (patches)

_STATE: dict[str, Any] = {"installed": False, "layers": [], "lora": {}, "threshold": None, "orig_apply": None,
                          "adapter": None, "gemv_rows": 0, "gemv_kernel": "triton", "gemv_repacked": False}
"""Worker-process state: hybrid layers (method, layer) by index, LoRA wrappers by the same index,
the row threshold (dense above it), vLLM's original `CompressedTensorsLinearMethod.apply`, the merged
adapter, the rows up to which the decode GEMM runs (0: never) and which one; `gemv_resolved`: what
`resolve_kernel` gave for `QERL_VLLM_GEMV_KERNEL` (kernel, rows, why `auto` turned it off), once set;
`gemv_repacked`: the decode GEMM's codes are in the CUDA kernel's repacked layout (`QERL_VLLM_GEMV_REPACK`)."""


class _Reentry:
    """Set while `qerl::lora_hybrid_linear` runs vLLM's own LoRA path (which calls `apply` again)."""

    active = False


def _is_nvfp4_a16(layer) -> bool:
    scheme = getattr(layer, "scheme", None)
    return (type(scheme).__name__ == "CompressedTensorsW4A4Fp4" and bool(getattr(scheme, "use_a16", False))
            and hasattr(layer, "weight_packed"))


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=torch.cuda.is_available())
    return out.copy_(t.detach())


def _resolved_gemv(kernel: str, rows: int) -> tuple[str | None, int | None]:
    """(kernel, rows) this worker's decode GEMM runs (rows None: off), resolved once by `resolve_kernel`
    at the first NVFP4 layer, before any CUDA-graph capture; a fallback is logged with its reason."""
    if "gemv_resolved" not in _STATE:
        _STATE["gemv_resolved"] = resolve_kernel(kernel, rows)
        if _STATE["gemv_resolved"][2] is not None:
            logger.warning("NVFP4 decode GEMM off (%s=auto; Marlin serves every row count): %s",
                           GEMV_KERNEL_ENV, _STATE["gemv_resolved"][2])
    kernel, rows, _ = _STATE["gemv_resolved"]
    return kernel, rows or None


def install_patches() -> bool:
    """Patch vLLM's compressed-tensors linear method and LoRA linear layers for the regimes (module doc).

    Installed once per process, at import of this module in vLLM's worker, before the model
    loads. Inert unless `QERL_VLLM_DENSE_ABOVE` is set when the model loads. Returns whether
    vLLM was found.
    """
    if _STATE["installed"]:
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
    _STATE["orig_apply"] = orig_apply

    @torch.library.custom_op("qerl::nvfp4_hybrid_linear", mutates_args=())
    def nvfp4_hybrid_linear(x: torch.Tensor, index: int, with_bias: bool) -> torch.Tensor:
        method, layer = _STATE["layers"][index]
        rows = x.numel() // x.shape[-1]
        if rows <= _STATE["gemv_rows"] and x.dtype in (torch.bfloat16, torch.float16):
            packed, scale, gs, bias = layer.qerl_gemv
            return gemv_function(rows, _STATE["gemv_kernel"], _STATE["gemv_repacked"])(
                x, packed, scale, gs, bias if with_bias else None)
        if rows <= _STATE["threshold"]:
            return orig_apply(method, layer, x, layer.bias if with_bias else None)
        return F.linear(x, layer.qerl_dense_weight, layer.qerl_dense_bias if with_bias else None)

    @nvfp4_hybrid_linear.register_fake
    def _(x: torch.Tensor, index: int, with_bias: bool) -> torch.Tensor:
        _, layer = _STATE["layers"][index]
        return x.new_empty((*x.shape[:-1], layer.output_size_per_partition))

    @torch.library.custom_op("qerl::lora_hybrid_linear", mutates_args=())
    def lora_hybrid_linear(x: torch.Tensor, index: int, with_bias: bool) -> torch.Tensor:
        wrapper = _STATE["lora"][index]
        base = wrapper.base_layer
        rows = x.numel() // x.shape[-1]
        lora = None
        if rows <= _STATE["gemv_rows"] and x.dtype == base.params_dtype:
            lora = _gemv_lora(wrapper, max_lora_rank(_STATE["gemv_kernel"]))
        if lora is not None:  # base + LoRA in one launch; rows whose token carries no adapter get none
            packed, scale, gs, bias = base.qerl_gemv
            a, b, slots = lora
            return gemv_function(rows, _STATE["gemv_kernel"], _STATE["gemv_repacked"])(
                x, packed, scale, gs, bias if with_bias else None, a, b, 1.0, slots, 0)
        if rows <= _STATE["threshold"]:
            _Reentry.active = True
            try:  # vLLM's own LoRA layer: Marlin (through the op above) + LoRA kernels
                return type(wrapper).apply(wrapper, x, base.bias if with_bias else None)
            finally:
                _Reentry.active = False
        return F.linear(x, base.qerl_dense_weight, base.qerl_dense_bias if with_bias else None)

    @lora_hybrid_linear.register_fake
    def _(x: torch.Tensor, index: int, with_bias: bool) -> torch.Tensor:
        base = _STATE["lora"][index].base_layer
        return x.new_empty((*x.shape[:-1], base.output_size_per_partition))

    def process_weights_after_loading(self, layer):
        threshold = dense_above_from_env()
        gemv_rows = gemv_rows_from_env()
        gemv_kernel = gemv_kernel_from_env()
        nvfp4 = _is_nvfp4_a16(layer)
        if gemv_rows is not None and nvfp4:
            gemv_kernel, gemv_rows = _resolved_gemv(gemv_kernel, gemv_rows)
        dense = bias = host = gemv = None
        repack = False
        if gemv_rows is not None and nvfp4:
            from qerl_lib.kernels.nvfp4_gemv import counters
            from qerl_lib.kernels.nvfp4_gemv_cuda import MAX_ROWS, repack_codes

            # the CUDA kernel's repacked codes: only where it serves every decode-GEMM step
            repack = gemv_kernel == "cuda" and gemv_rows <= MAX_ROWS and gemv_repack_from_env()

            widths = list(getattr(layer, "logical_widths", None) or [layer.weight_packed.shape[0]])
            b = getattr(layer, "bias", None)
            codes = layer.weight_packed.data
            gemv = (repack_codes(codes) if repack else codes.clone(), layer.weight_scale.data.clone(),
                    partition_scales(layer.weight_global_scale.data, widths),
                    None if b is None else b.detach().clone())  # copied before Marlin repacks the layer's own
            counters(layer.weight_packed.device)  # allocated now, eagerly: CUDA-graph capture comes later
        if threshold is not None and nvfp4:
            widths = list(getattr(layer, "logical_widths", None) or [layer.weight_packed.shape[0]])
            host = (_host_copy(layer.weight_packed.data), _host_copy(layer.weight_scale.data),
                    _host_copy(layer.weight_global_scale.data.float()), widths)
            dense = dequantize_partitions(layer.weight_packed.data, layer.weight_scale.data,
                                          layer.weight_global_scale.data.float(), widths,
                                          getattr(layer, "params_dtype", torch.bfloat16))
            b = getattr(layer, "bias", None)
            bias = None if b is None else b.detach().clone()  # Marlin permutes layer.bias in place
        orig_process(self, layer)
        if dense is not None or gemv is not None:
            layer.qerl_dense_weight = dense
            layer.qerl_dense_bias = bias
            layer.qerl_host_packed = host
            layer.qerl_gemv = gemv
            layer.qerl_hybrid_index = len(_STATE["layers"])
            _STATE["layers"].append((self, layer))
            _STATE["threshold"] = threshold if threshold is not None else sys.maxsize  # None: never dense
            _STATE["gemv_rows"] = gemv_rows or 0
            _STATE["gemv_kernel"] = gemv_kernel or "off"
            _STATE["gemv_repacked"] = bool(repack)

    def apply(self, layer, x, bias=None):
        index = getattr(layer, "qerl_hybrid_index", None)
        if index is None:
            return orig_apply(self, layer, x, bias)
        return torch.ops.qerl.nvfp4_hybrid_linear(x, index, bias is not None)

    CompressedTensorsLinearMethod.process_weights_after_loading = process_weights_after_loading
    CompressedTensorsLinearMethod.apply = apply
    _patch_lora_layers()
    _STATE["installed"] = True
    return True


def _patch_lora_layers() -> None:
    """LoRA wrappers of hybrid layers (tensor parallel 1) route `apply` through `qerl::lora_hybrid_linear`."""
    try:
        import vllm.lora.layers as lora_layers
        from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    except Exception:
        return
    orig_init = BaseLinearLayerWithLoRA.__init__

    def __init__(self, base_layer, *args, **kwargs):
        orig_init(self, base_layer, *args, **kwargs)
        index = getattr(base_layer, "qerl_hybrid_index", None)
        if index is not None and getattr(self, "tp_size", 1) == 1:
            self.qerl_lora_index = index
            _STATE["lora"][index] = self

    def wrap(orig):
        def apply(self, x, bias=None):
            index = getattr(self, "qerl_lora_index", None)
            if index is None or _Reentry.active:
                return orig(self, x, bias)
            return torch.ops.qerl.lora_hybrid_linear(x, index, bias is not None)

        apply.__wrapped__ = orig
        return apply

    BaseLinearLayerWithLoRA.__init__ = __init__
    classes = {BaseLinearLayerWithLoRA}
    for name in dir(lora_layers):
        obj = getattr(lora_layers, name)
        if isinstance(obj, type) and issubclass(obj, BaseLinearLayerWithLoRA):
            classes.add(obj)
    for cls in classes:
        if "apply" in cls.__dict__:
            cls.apply = wrap(cls.__dict__["apply"])


@torch.no_grad()
def merge_adapter(model: torch.nn.Module, adapter_dir: str | None) -> dict:
    """Dense weight of every hybrid LoRA layer <- dequantized base + the adapter's s * B @ A (None: the base).

    Starts from the host copy of the packed tensors each time (no drift across adapters).
    Every adapter module must land in a layer of the engine, else KeyError naming it.
    """
    t0 = time.perf_counter()
    if not _STATE["lora"] or all(w.base_layer.qerl_dense_weight is None for w in _STATE["lora"].values()):
        return {"layers": 0, "modules": 0, "seconds": 0.0}
    pairs, scaling = ({}, 1.0) if adapter_dir is None else adapter_deltas(adapter_dir)[:2]
    names = {id(m): n for n, m in model.named_modules()}
    packed = {**PACKED, **{k: tuple(v) for k, v in (getattr(model, "packed_modules_mapping", None) or {}).items()}}
    used = set()
    for index, wrapper in sorted(_STATE["lora"].items()):
        base = wrapper.base_layer
        name = names.get(id(wrapper))
        if name is None:
            raise RuntimeError(f"LoRA layer {index} is not in the served model")
        prefix, leaf = name.rsplit(".", 1)
        packed_w, scale, gs, widths = base.qerl_host_packed
        device = base.qerl_dense_weight.device
        dense = dequantize_partitions(packed_w.to(device, non_blocking=True), scale.to(device, non_blocking=True),
                                      gs.to(device), widths, base.qerl_dense_weight.dtype)
        parts = packed.get(leaf, (leaf,))
        if len(parts) != len(widths):
            raise RuntimeError(f"{name}: {len(widths)} partitions but packed mapping {parts}")
        deltas = []
        for part in parts:
            pair = pairs.get(f"{prefix}.{part}")
            if pair is None:
                deltas.append(None)
                continue
            used.add(f"{prefix}.{part}")
            a = pair["lora_A"].to(device, torch.float32)
            b = pair["lora_B"].to(device, torch.float32)
            deltas.append((b @ a) * scaling)
        base.qerl_dense_weight.copy_(merge_partitions(dense, widths, deltas))
    missing = sorted(set(pairs) - used)
    if missing:
        raise KeyError(f"{adapter_dir}: adapter modules with no layer in the engine: {missing[:4]}")
    torch.cuda.synchronize()
    _STATE["adapter"] = adapter_dir
    return {"layers": len(_STATE["lora"]), "modules": len(used), "seconds": round(time.perf_counter() - t0, 3)}


def _worker_side_import() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return
    install_patches()


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

    def qerl_info(self) -> dict:
        """What this worker serves, for a rollout client (`qerl_lib.rollout.client`): the checkpoint
        and its hash (the convert report's, else hashed here once), this GPU's UUID, host and
        whether linears run the merged dense regime."""
        info = getattr(self, "_qerl_info", None)
        if info is None:
            import socket

            from qerl_lib.convert import checkpoint_hash

            ckpt = Path(self.vllm_config.model_config.model).resolve()
            report = ckpt / "convert_report.json"
            digest = json.loads(report.read_text())["checkpoint_hash"] if report.is_file() else checkpoint_hash(ckpt)
            info = self._qerl_info = {
                "backend": "vllm", "checkpoint": str(ckpt), "checkpoint_hash": digest,
                "devices": [str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)],
                "host": socket.gethostname(), "pid": os.getpid(), "merges_adapter": dense_above_from_env() is not None,
            }
        return info

    def qerl_set_noise(self, sigma: float, seed: int, step: int, mode: str = "absolute") -> dict:
        """Norm weights <- clean + noise(seed, step) in place (sigma 0: clean; `mode`:
        `aqn.sigma_mode`); returns `describe()`."""
        noise = self._qerl_norms()
        noise.apply(float(sigma), int(seed), int(step), str(mode))
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
        """Which linear kernels the model runs (class names) and the state of the regimes."""
        kernels: dict[str, int] = {}
        for module in self._qerl_model().modules():
            scheme = getattr(module, "scheme", None)
            kernel = getattr(scheme, "kernel", None)
            if kernel is not None:
                name = type(kernel).__name__
                kernels[name] = kernels.get(name, 0) + 1
        layers = [layer for _, layer in _STATE["layers"]]
        dense_bytes = sum(layer.qerl_dense_weight.numel() * layer.qerl_dense_weight.element_size()
                          for layer in layers if layer.qerl_dense_weight is not None)
        host_bytes = sum(t.numel() * t.element_size() for layer in layers if layer.qerl_host_packed is not None
                         for t in layer.qerl_host_packed[:3])
        gemv_bytes = sum(t.numel() * t.element_size() for layer in layers if layer.qerl_gemv is not None
                         for t in layer.qerl_gemv[:3])
        threshold = _STATE["threshold"]
        return {"kernels": kernels, "hybrid_layers": len(_STATE["layers"]), "merged_lora_layers": len(_STATE["lora"]),
                "threshold": None if threshold == sys.maxsize else threshold, "dense_bytes": dense_bytes,
                "host_bytes": host_bytes, "gemv_rows": _STATE["gemv_rows"], "gemv_bytes": gemv_bytes,
                "gemv_kernel": _STATE["gemv_kernel"], "gemv_fallback": _STATE.get("gemv_resolved", (None, 0, None))[2],
                "gemv_repacked": _STATE["gemv_repacked"],
                "merged_adapter": _STATE["adapter"],
                "lora_dual_stream": os.environ.get("VLLM_LORA_ENABLE_DUAL_STREAM", "0") == "1"}

    def qerl_merge_adapter(self, adapter_dir: str | None) -> dict:
        """Merge the adapter of `adapter_dir` (None: none) into the dense weights (`merge_adapter`)."""
        return merge_adapter(self._qerl_model(), adapter_dir)

    def qerl_check_hybrid(self, rows: int = 16) -> dict:
        """Largest relative difference between Marlin (and the decode GEMM, when on) and the dequantized
        base, over every hybrid layer."""
        worst = worst_gemv = 0.0
        g = torch.Generator(device="cuda")
        g.manual_seed(0)
        for method, layer in _STATE["layers"]:
            if layer.qerl_host_packed is not None:
                packed, scale, gs, widths = layer.qerl_host_packed
                dense = dequantize_partitions(packed.cuda(), scale.cuda(), gs.cuda(), widths,
                                              layer.qerl_dense_weight.dtype)
            else:
                from qerl_lib.nvfp4 import dequantize_nvfp4

                packed, scale, gs_rows, _ = layer.qerl_gemv
                if _STATE["gemv_repacked"]:
                    from qerl_lib.kernels.nvfp4_gemv_cuda import unrepack_codes

                    packed = unrepack_codes(packed)
                dense = (dequantize_nvfp4(packed, scale, torch.ones(1, device=packed.device), torch.float32)
                         / gs_rows[:, None]).to(getattr(layer, "params_dtype", torch.bfloat16))
            x = torch.randn(rows, dense.shape[1], device="cuda", dtype=dense.dtype, generator=g)
            a = _STATE["orig_apply"](method, layer, x, None).float()
            b = torch.nn.functional.linear(x, dense).float()
            worst = max(worst, float((a - b).norm() / b.norm().clamp_min(1e-12)))
            if layer.qerl_gemv is not None:
                c = gemv_function(rows, _STATE["gemv_kernel"], _STATE["gemv_repacked"])(
                    x[: min(rows, 64)], *layer.qerl_gemv[:3]).float()
                ref = b[: c.shape[0]]
                worst_gemv = max(worst_gemv, float((c - ref).norm() / ref.norm().clamp_min(1e-12)))
        return {"layers": len(_STATE["layers"]), "max_rel_diff": worst, "max_rel_diff_gemv": worst_gemv}
