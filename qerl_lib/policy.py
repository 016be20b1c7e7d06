"""The policy: frozen base (packed NVFP4 or dense) + PEFT LoRA + an AQN injector.

One `Policy` object serves rollout, update and evaluation. In `qerl run` it stays loaded
across steps and stages, so the per-step start-up cost is the adapter swap only; each
stage run alone (`qerl stage ...`, `dvc repro`) builds its own.

Rollout backends (`rollout.backend`):

- `transformers` (default): `generate` samples from the in-process PEFT model
  (`qerl_lib.rollout.sampling.sample_batch`).
- `vllm`: `generate` goes to a `qerl_lib.rollout.vllm_engine.VLLMEngine` that holds the same
  checkpoint. The engine is started on the first `generate` (an update-only process never
  starts one) and is kept per process (`_ENGINES`), so every later step and evaluation of
  `qerl run` pays only the adapter swap and the AQN write. Before each `generate` the
  engine receives the adapter and the noise this policy holds (`load_adapter`,
  `set_noise`); after it, the engine sleeps (weights to CPU, KV cache dropped) so the
  trainer has the GPU, unless `QERL_VLLM_SLEEP=0`. The trainer's model stays the
  transformers one. Start-up and hand-over timings go to `<run.root>/vllm_engine.json`.
  NVFP4 engines run the regime of `rollout.vllm_dense_above` (`qerl_lib.rollout.vllm_worker`): by
  default, dense copies with the adapter merged in above 48 sequences per step when those
  copies take at most a quarter of the engine's memory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

import torch

from qerl_lib.config import QerlConfig
from qerl_lib.paths import Layout

log = logging.getLogger(__name__)


class Policy:
    def __init__(self, cfg: QerlConfig, layout: Layout):
        from qerl_lib.aqn import NoiseInjector
        from qerl_lib.lora import apply_lora
        from qerl_lib.model import load_base, load_tokenizer, resolve_device, resolve_dtype

        self.cfg = cfg
        self.device = resolve_device(cfg.model.device)
        self.dtype = resolve_dtype(cfg.model.compute_dtype, self.device)
        self.checkpoint = layout.checkpoint(cfg.model.quant)
        base = load_base(self.checkpoint, cfg.model.quant, self.dtype, self.device)
        self.tokenizer = load_tokenizer(self.checkpoint)
        self.model = apply_lora(base, cfg.lora)
        self.injector = NoiseInjector(self.model)
        self.version: int | None = None
        self.adapter_hash = ""
        self.adapter_dir: Path | None = None
        self.noise: tuple[float, int, int] = (0.0, 0, 0)
        self.layout = layout

    @property
    def backend(self) -> str:
        """`rollout.backend` of the config this policy serves now (`get_policy` may swap the config)."""
        return self.cfg.rollout.backend

    def load_adapter(self, adapter_dir: Path, version: int) -> None:
        """Put adapter `version` in place (LoRA weights, and norms when they train)."""
        from qerl_lib.lora import adapter_hash, load_adapter_weights

        # Norm weights may be trainable: never load them under noise.
        self.injector.reset()
        load_adapter_weights(self.model, adapter_dir)
        self.version = version
        self.adapter_hash = adapter_hash(adapter_dir)
        self.adapter_dir = Path(adapter_dir)
        self.noise = (0.0, 0, 0)

    def set_noise(self, sigma: float, seed: int, step: int, mode: str = "absolute") -> None:
        """Make the RMSNorm weights clean + noise(seed, step) (`aqn.sigma_mode` `mode`); sigma 0
        restores them."""
        self.injector.reset()
        if sigma > 0:
            self.injector.apply(sigma, seed, step, mode)
        self.noise = (float(sigma), int(seed), int(step))
        self.noise_mode = mode

    @property
    def eos_ids(self) -> set[int]:
        ids = set()
        gen_cfg = getattr(self.model, "generation_config", None)
        eos = getattr(gen_cfg, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def generate(self, prompts: list[list[int]], seeds: list[int], params, batch_size: int, progress=None):
        """Sample one completion per (prompt, seed), in order.

        transformers backend: `batch_size` rows at a time. vLLM backend: all rows at once (the
        engine schedules them), with this policy's adapter and noise pushed first.
        """
        if self.backend == "vllm":
            return self._generate_vllm(prompts, seeds, params, progress)
        from qerl_lib.rollout.sampling import sample_batch

        from qerl_lib.nvfp4_linear import dense_inference_cache

        self.model.eval()
        out = []
        cache = dense_inference_cache(self.model, self.dtype) if self.cfg.rollout.dense_cache \
            else contextlib.nullcontext()
        with cache:
            for start in range(0, len(prompts), batch_size):
                chunk = prompts[start:start + batch_size]
                out.extend(
                    sample_batch(
                        self.model, chunk, seeds[start:start + batch_size], params,
                        self.eos_ids, self.tokenizer.pad_token_id, on_step=_in_flight(progress, len(out), len(chunk),
                                                                                    params.max_new_tokens),
                    )
                )
                if progress is not None:
                    progress(len(out))
        return out

    # ------------------------------------------------------------------ vLLM backend

    def rollout_engine(self):
        """The process's vLLM engine for this policy's checkpoint (started on first use)."""
        return get_engine(self.cfg, self.checkpoint)

    def _generate_vllm(self, prompts, seeds, params, progress=None):
        engine = self.rollout_engine()
        engine.set_policy(self.adapter_dir, self.version if self.version is not None else 0)
        engine.set_noise(*self.noise, mode=getattr(self, "noise_mode", "absolute"))
        comps = engine.generate(prompts, seeds, params, stop_token_ids=self.eos_ids)
        if os.environ.get("QERL_VLLM_SLEEP", "1") != "0":
            engine.sleep()
        if progress is not None:
            progress(len(comps))
        _write_engine_stats(self.layout, engine)
        return comps


def _in_flight(progress, before: int, rows: int, cap: int):
    """`sample_batch`'s per-decode-step callback for a progress counter: finished rows count whole,
    rows still decoding count by their share of the token cap (so the count moves within a batch)."""
    if progress is None:
        return None

    def on_step(tokens: int, finished: int) -> None:
        progress(before + finished, inflight=(rows - finished) * tokens / max(cap, 1))

    return on_step


_CACHE: dict[tuple, Policy] = {}
_ENGINES: dict[tuple, object] = {}
DEFAULT_DENSE_ABOVE = 48
"""Rows (sequences in a decode step) above which an NVFP4 engine runs its linears on dense
copies, when memory allows (`qerl_lib.rollout.dense_regime`): the Marlin-vs-cuBLAS
crossover measured on the H200 for the 7B shape (Marlin faster up to 48 rows, slower from 64;
`benchmarks/results/rollout_throughput.json`, `gemm_profile`)."""


def _engine_key(cfg: QerlConfig, checkpoint: Path) -> tuple:
    rc = cfg.rollout
    return (str(Path(checkpoint).resolve()), cfg.model.quant, rc.vllm_max_lora_rank, rc.vllm_gpu_memory_utilization,
            rc.vllm_enforce_eager, cfg.run.seed, rc.vllm_dense_above, rc.vllm_lora_dual_stream, gemv_rows_for(cfg),
            rc.vllm_gemv_kernel, rc.vllm_gemv_pdl, rc.vllm_gemv_repack,
            rc.vllm_kv_cache_gib, rc.vllm_max_model_len,
            cfg.parallel.rollout_tensor_parallel, cfg.parallel.rollout_replicas)


def vllm_memory_kwargs(rc) -> dict:
    """`vllm.LLM` arguments of `rollout.vllm_kv_cache_gib` (none when unset)."""
    return {} if rc.vllm_kv_cache_gib is None else {"kv_cache_memory_bytes": int(rc.vllm_kv_cache_gib * 2**30)}


def dense_above_for(cfg: QerlConfig, checkpoint: Path) -> int | None:
    """`rollout.vllm_dense_above` resolved for `checkpoint`: rows, or None (Marlin at every batch)."""
    from qerl_lib.rollout.dense_regime import auto_dense_above, dense_declined_note

    rc = cfg.rollout
    if rc.vllm_dense_above == "off" or cfg.parallel.rollout_tensor_parallel > 1:
        return None  # the dense copies of a tensor-parallel engine are not wired (vllm_worker)
    if rc.vllm_dense_above == "auto":
        total = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0
        rows = auto_dense_above(checkpoint, rc.vllm_gpu_memory_utilization * total, DEFAULT_DENSE_ABOVE)
        if rows is None and (note := dense_declined_note(checkpoint, total, rc.vllm_gpu_memory_utilization)):
            log.warning(note)  # silent, it hid a rollout slower than BF16 on 80 GB cards (docs/gpu.md)
        return rows
    return int(rc.vllm_dense_above)


def gemv_rows_for(cfg: QerlConfig, quant: str | None = None) -> int | None:
    """`rollout.vllm_gemv_rows` where it applies (an NVFP4 base: `quant`, default `model.quant`), else
    None: the decode GEMM reads NVFP4 codes, and an engine without it keeps vLLM's compile cache."""
    rows = cfg.rollout.vllm_gemv_rows
    return int(rows) if rows and (quant or cfg.model.quant) == "nvfp4" else None


def get_engine(cfg: QerlConfig, checkpoint: Path):
    """The `VLLMEngine` of this process for `checkpoint` and the rollout config (one at a time)."""
    from qerl_lib.rollout.vllm_engine import VLLMEngine, vllm_quantization

    key = _engine_key(cfg, checkpoint)
    if key not in _ENGINES:
        close_engines()
        rc = cfg.rollout
        par = cfg.parallel
        tp, reps = par.rollout_tensor_parallel, par.rollout_replicas
        groups = None
        if tp > 1 or reps > 1:
            from qerl_lib.distributed import placement

            config = json.loads((Path(checkpoint) / "config.json").read_text())
            # refuses what does not fit, and says why
            groups = placement(par, torch.cuda.device_count(), config)["rollout"]
        kwargs = dict(max_lora_rank=rc.vllm_max_lora_rank, gpu_memory_utilization=rc.vllm_gpu_memory_utilization,
                      enforce_eager=rc.vllm_enforce_eager, seed=cfg.run.seed,
                      dense_above=dense_above_for(cfg, checkpoint), lora_dual_stream=rc.vllm_lora_dual_stream,
                      gemv_rows=gemv_rows_for(cfg), gemv_kernel=rc.vllm_gemv_kernel, gemv_pdl=rc.vllm_gemv_pdl,
                      gemv_repack=rc.vllm_gemv_repack,
                      tensor_parallel_size=tp, max_model_len=rc.vllm_max_model_len,
                      quantization=vllm_quantization(cfg.model.quant), engine_kwargs=vllm_memory_kwargs(rc))
        if reps > 1:
            from qerl_lib.rollout.replicas import ReplicaPool, vllm_replica

            _ENGINES[key] = ReplicaPool(reps, vllm_replica, (str(checkpoint), kwargs), gpu_groups=groups)
        else:
            _ENGINES[key] = VLLMEngine(checkpoint, **kwargs)
    return _ENGINES[key]


def close_engines() -> None:
    for engine in _ENGINES.values():
        engine.close()
    _ENGINES.clear()


def _write_engine_stats(layout: Layout, engine) -> None:
    from qerl_lib.io import atomic_write_json

    try:
        atomic_write_json(layout.vllm_engine_stats, engine.stats_dict())
    except OSError as e:  # statistics only: never fail a stage for them
        log.warning("could not write vllm_engine.json: %s", e)


def get_policy(cfg: QerlConfig, layout: Layout, reuse: bool) -> Policy:
    """A loaded policy; with `reuse`, the one this process loaded before for the same base."""
    if not reuse:
        return Policy(cfg, layout)
    key = (str(layout.root.resolve()), cfg.model.quant, cfg.model.device, cfg.model.compute_dtype,
           cfg.lora.model_dump_json())
    if key not in _CACHE:
        _CACHE.clear()
        _CACHE[key] = Policy(cfg, layout)
    policy = _CACHE[key]
    policy.cfg = cfg
    return policy


def clear_policy_cache() -> None:
    _CACHE.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
