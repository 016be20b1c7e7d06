"""The vLLM rollout backend: one long-lived `vllm.LLM` behind the same rollout interface as
the transformers backend (`Policy.load_adapter / set_noise / generate`).

vLLM is a GPU-only, optional dependency (`pip install -e ".[gpu]"`, or the carried wheel set
of `scripts/device_vllm.sh` on the lent H200). This module imports it lazily: the pure parts
(sampling translation, adapter bookkeeping) import and are tested without it; the code that runs
inside vLLM's worker lives in `qerl_lib.rollout.vllm_worker`.

What the engine does, and why:

- **Checkpoint.** The compressed-tensors NVFP4A16 checkpoint of the convert stage (vLLM picks
  `MarlinNvFp4LinearKernel` on Hopper by itself; no flags) or the BF16 base, loaded as is. For
  `model.quant=nf4` the engine loads the 16-bit copy with `quantization="bitsandbytes"`: vLLM's
  loader quantizes each checkpoint weight as it reads it with `bitsandbytes.functional.quantize_4bit`
  (NF4, block 64, `compress_statistics=True`), which is what transformers' `BitsAndBytesConfig`
  (`nf4`, double quant) does to the trainer's copy, so both hold the same 4-bit weights.

- **Adapters, explicitly versioned.** `set_policy(adapter_dir, version)` removes the previous
  `LoRARequest` by id (`llm_engine.remove_lora`) and then adds a new one whose integer id is
  fresh for this engine (a counter, so re-loading the same version with different bytes can
  never hit vLLM's adapter cache); its name is `qerl-v<version>-<adapter hash>`. Generation
  passes that request explicitly. Nothing relies on LRU eviction (`max_loras=1`,
  `max_cpu_loras=1`, and the old id is gone before the new one arrives). Trained norm weights
  (`norms.safetensors` beside the adapter, `lora.train_norms`) are written into vLLM's norms
  by the worker extension, since a PEFT LoRA cannot carry them.

- **AQN that really reaches vLLM.** The worker extension (`qerl_lib.rollout.vllm_worker`, mixed into
  vLLM's GPU worker through `worker_extension_cls`) writes clean + noise(seed, step) in place
  into vLLM's own `RMSNorm` weights with the trainer's arithmetic, so the bits equal the
  trainer's; each call starts from the clean copy and sigma 0 restores it exactly. The prefix
  cache is reset after every change of noise or adapter (cached KV blocks were computed by the
  old weights).

- **Sampling logprobs = log softmax(logits / T) of the sampled token, before top-p** (the
  project's convention, `qerl_lib.rollout.sampling`). vLLM 0.26 offers `logprobs_mode`
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

- **Regimes of an NVFP4 engine** (`dense_above`, `lora_dual_stream`; the reasons and the memory
  cost are in `qerl_lib.rollout.vllm_worker`). `dense_above=None`: Marlin at every batch, as vLLM
  ships it. `dense_above=M*`: Marlin + vLLM's LoRA kernels up to M* sequences per decode step,
  and above that one dense BF16 GEMM per linear with the current adapter merged in
  (`set_policy` re-merges it on every adapter change), which needs no LoRA kernel.
  `lora_dual_stream` sets vLLM's `VLLM_LORA_ENABLE_DUAL_STREAM`, which runs the LoRA kernels
  on a second CUDA stream beside the base GEMM (the small-batch regime's LoRA cost is launch
  latency, which the overlap hides). `gemv_rows=M_g` (off here; `rollout.vllm_gemv_rows`, 8 by
  default, passes it for NVFP4 bases): steps of at most M_g rows run the project's NVFP4 decode GEMM
  with the LoRA fused in (`qerl_lib.kernels.nvfp4_gemv_cuda` or `nvfp4_gemv`) instead of Marlin +
  vLLM's LoRA kernels.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from qerl_lib.rollout.sampling import Completion, SamplingParams, logit_scale  # noqa: F401  (re-exported)
from qerl_lib.rollout.vllm_gemv import GEMV_KERNELS, gemv_env
from qerl_lib.rollout.vllm_worker import DENSE_ABOVE_ENV

log = logging.getLogger(__name__)

EXTENSION = "qerl_lib.rollout.vllm_worker.AQNWorkerExtension"
"""Qualified name passed to `vllm.LLM(worker_extension_cls=...)`."""
LOGPROBS_MODE = "raw_logprobs"
"""vLLM logprobs mode used with the temperature folded into the logits scale (module doc)."""
NORMS_FILE = "norms.safetensors"
SLEEP_RACE = "Memory usage increased after sleeping"
"""vLLM's assertion after a sleep when the device's free memory shrank meanwhile (`VLLMEngine.sleep`)."""
VALID_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
"""`max_lora_rank` values vLLM 0.26 accepts."""


# ============================================================================ pure helpers


def vllm_quantization(quant: str) -> str | None:
    """vLLM's `quantization` argument for `model.quant`: `bitsandbytes` (in-flight NF4) for `nf4`,
    None otherwise (an NVFP4 checkpoint says what it is in its config.json; BF16 is plain)."""
    return "bitsandbytes" if quant == "nf4" else None


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


def to_completion(output) -> Completion:
    """A `qerl_lib.rollout.sampling.Completion` from one vLLM `RequestOutput` (n = 1).

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


# ============================================================================ the engine


@dataclass
class EngineStats:
    startup_seconds: float = 0.0
    generate_calls: int = 0
    generate_seconds: float = 0.0
    tokens: int = 0
    adapter_swaps: int = 0
    adapter_seconds: float = 0.0
    merge_seconds: float = 0.0
    noise_sets: int = 0
    noise_seconds: float = 0.0
    sleeps: int = 0
    sleep_races: int = 0
    sleep_seconds: float = 0.0
    wake_seconds: float = 0.0
    extra: dict = field(default_factory=dict)


class VLLMEngine:
    """One `vllm.LLM` that serves every rollout and evaluation of a process (module doc).

    `llm` may be given (tests pass a fake); otherwise it is built from `checkpoint` with
    `enable_lora`, `max_lora_rank`, `max_loras=1`, `enable_sleep_mode`, the AQN worker
    extension, `logprobs_mode="raw_logprobs"` and token-id prompts (no tokenizer in vLLM).
    `dense_above`: sequences per decode step above which NVFP4 linears run dense with the adapter
    merged in (None: never; module doc). `lora_dual_stream`: vLLM's LoRA kernels on a second
    CUDA stream (`VLLM_LORA_ENABLE_DUAL_STREAM`). `gemv_rows`: sequences per decode step up to which
    NVFP4 linears run `qerl_lib.kernels.nvfp4_gemv` (None/0: never); `gemv_kernel`: `triton`, `cuda`
    (`qerl_lib.kernels.nvfp4_gemv_cuda` for steps of at most 16 rows) or `auto` (`cuda` when it builds
    in the worker, else none: `qerl_lib.rollout.vllm_gemv.resolve_kernel`); `gemv_pdl`: the CUDA kernel as a
    programmatic dependent launch (`rollout.vllm_gemv_pdl`); `gemv_repack`: the CUDA kernel on repacked
    codes (`rollout.vllm_gemv_repack`, `vllm_gemv.GEMV_REPACK_ENV`). `tensor_parallel_size`: GPUs the engine spans
    (vLLM's own tensor parallelism over NCCL, NVLink multicast off); every worker then holds the
    same norms, so AQN and trained norms are written by each. `quantization`: vLLM's in-flight
    quantization of a 16-bit checkpoint (`vllm_quantization`: `bitsandbytes` for NF4), or None.
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
        lora_dual_stream: bool = False,
        gemv_rows: int | None = None,
        gemv_kernel: str = "triton",
        gemv_pdl: bool = False,
        gemv_repack: bool = False,
        tensor_parallel_size: int = 1,
        quantization: str | None = None,
        sleep_mode: bool = True,
        engine_kwargs: dict | None = None,
        llm=None,
    ):
        if enable_lora and max_lora_rank not in VALID_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {VALID_LORA_RANKS}, got {max_lora_rank}")
        self.checkpoint = Path(checkpoint)
        self.max_lora_rank = max_lora_rank
        self.dense_above = dense_above
        self.lora_dual_stream = lora_dual_stream
        self.gemv_rows = gemv_rows or None
        if gemv_kernel not in GEMV_KERNELS:
            raise ValueError(f"gemv_kernel must be one of {GEMV_KERNELS}, got {gemv_kernel!r}")
        self.gemv_kernel = gemv_kernel
        self.gemv_pdl = bool(gemv_pdl and self.gemv_rows)
        self.gemv_repack = bool(gemv_repack and self.gemv_rows)
        self.merges_adapter = enable_lora and dense_above is not None
        """Whether the workers hold dense weights with the adapter merged in (re-merged on every swap)."""
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
            for name, value in gemv_env(self.gemv_rows, self.gemv_kernel, self.gemv_pdl, self.gemv_repack).items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            if dense_above is not None or self.gemv_rows is not None:
                # The op changes the traced graph but not vLLM's config hash: keep its compiled
                # artifacts apart from those of a plain engine of the same model.
                os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
            # A fresh worker process: vLLM reads VLLM_LORA_ENABLE_DUAL_STREAM when its LoRA layers are
            # first imported, and a forked worker inherits whatever this process imported before
            # (measured: a forked worker had no `lora_linear_async` op and failed to start).
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
            if lora_dual_stream:
                os.environ["VLLM_LORA_ENABLE_DUAL_STREAM"] = "1"
            else:
                os.environ.pop("VLLM_LORA_ENABLE_DUAL_STREAM", None)
            from vllm import LLM

            if tensor_parallel_size > 1:
                from qerl_lib.distributed import multicast_off

                multicast_off()
            kwargs = dict(
                model=str(self.checkpoint),
                tensor_parallel_size=tensor_parallel_size,
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
            if quantization is not None:
                kwargs["quantization"] = quantization
            kwargs.update(engine_kwargs or {})
            llm = LLM(**kwargs)
        self.llm = llm
        self.stats.startup_seconds = round(time.perf_counter() - t0, 3)
        self.asleep = False
        self._scale = 1.0
        self._noise: tuple = (0.0, 0, 0, "absolute")
        self._norms_path: str | None = None
        self.slots = AdapterSlots(self.llm.llm_engine.add_lora, self.llm.llm_engine.remove_lora,
                                  self.llm.llm_engine.list_loras, _make_lora_request)
        log.info("vLLM engine for %s started in %.1f s", self.checkpoint, self.stats.startup_seconds)

    # ------------------------------------------------------------------ state pushed to the workers

    def rpc(self, method: str, *args):
        """`collective_rpc` of one worker-extension method on every worker; the first one's answer."""
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
        if changed and self.merges_adapter:
            t1 = time.perf_counter()
            self.rpc("qerl_merge_adapter", None if adapter_dir is None else str(adapter_dir.resolve()))
            self.stats.merge_seconds += time.perf_counter() - t1
        norms = None
        if adapter_dir is not None and (Path(adapter_dir) / NORMS_FILE).is_file():
            norms = str((Path(adapter_dir) / NORMS_FILE).resolve())
        if norms != self._norms_path or (changed and norms is not None):
            self.rpc("qerl_set_norm_overrides", norms)
            self._norms_path = norms
            self._noise = (0.0, 0, 0, "absolute")
            changed = True
        if changed:
            self.set_noise(0.0, 0, 0, force=True)
            self.llm.reset_prefix_cache()
            self.stats.adapter_swaps += 1
            self.stats.adapter_seconds += time.perf_counter() - t0

    @property
    def lora_request(self):
        return self.slots.request

    def set_noise(self, sigma: float, seed: int, step: int, force: bool = False, mode: str = "absolute") -> dict | None:
        """AQN of (seed, step) at `sigma` in vLLM's norms (sigma 0: the clean weights); `mode`:
        `aqn.sigma_mode`."""
        state = (float(sigma), int(seed), int(step), mode) if sigma > 0 else (0.0, 0, 0, "absolute")
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
        try:
            self.llm.sleep(level=level)
        except Exception as e:
            # vLLM 0.26 checks, after the weights are already offloaded, that the *device's* free memory
            # grew; another process on the same GPU that allocates meanwhile fails that check (measured:
            # one of 8 runs side by side on the H200, session 9). The worker is asleep by then.
            if SLEEP_RACE not in str(e):
                raise
            log.warning("vLLM's sleep check failed (%s): another process allocated GPU memory while this "
                        "engine slept; its weights are offloaded, continuing", SLEEP_RACE)
            self.stats.sleep_races += 1
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
                   gemv_rows=self.gemv_rows, gemv_kernel=self.gemv_kernel, gemv_pdl=self.gemv_pdl,
                   gemv_repack=self.gemv_repack, lora_dual_stream=self.lora_dual_stream,
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
