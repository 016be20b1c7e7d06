"""The client of a rollout server: stock `vllm serve` with the project's worker extension, or the
project's CPU server (`qerl_lib.rollout.cpu_server`), through the same HTTP calls.

Per `generate` call:
1. `/collective_rpc qerl_set_logit_scale(1/T)`: the temperature is folded into the logits, and
   requests ask for temperature 1, so the recorded logprob is log softmax(logits / T) before
   top-p (the project's convention; `qerl_lib.rollout.vllm_engine` explains why).
2. One `/v1/completions` request per row, all in flight together (the engine schedules them),
   each with its token-id prompt, its own `seed`, `logprobs: 0`, `return_token_ids`, the stop
   token ids, and `vllm_xargs` naming the call, the row's index and the transformers backend's
   batch size (vLLM passes them on unread; the CPU server uses them to sample exactly the batches
   an in-process run samples, so the bytes agree).

Before it, `set_policy` makes the server hold adapter `version` (a fresh LoRA name per version
and adapter hash, `/v1/load_lora_adapter`; the previous one is unloaded), and `set_noise` writes
AQN's noise into the server's RMSNorm weights (`qerl_set_noise`). The server reports the hash of
the checkpoint it serves (`qerl_info`); `RemotePolicy` refuses a server that serves another one.

A server that stops answering fails the call with `RolloutServerError` (the stage writes
nothing; re-running it against a live server succeeds).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import httpx

from qerl_lib.rollout.service import (
    RolloutServerError,
    ServerMismatch,
    find_server,
    local_devices,
)
from qerl_lib.rollout.sampling import Completion, SamplingParams, logit_scale

log = logging.getLogger(__name__)

CONCURRENCY = int(os.environ.get("QERL_ROLLOUT_CONCURRENCY", "512"))
"""Requests in flight per `generate` call (at least the batch size)."""
TIMEOUT_S = float(os.environ.get("QERL_ROLLOUT_TIMEOUT", "3600"))
"""Seconds one request may take before the server is declared hung."""
CONNECT_TIMEOUT_S = 10.0
KEEPALIVE_EXPIRY_S = 1.0
"""Seconds an idle pooled connection may be reused. Servers close idle connections after 5 s
(uvicorn's and `vllm serve`'s default keep-alive); a client that keeps them as long (httpx's
default) can send on one the moment the server closes it and read a connection reset. A shorter
expiry makes the client open a fresh connection instead."""
LORA_PREFIX = "qerl-v"
NORMS_FILE = "norms.safetensors"


def lora_name(version: int, digest: str) -> str:
    """The server-side name of adapter `version` with weights hash `digest` (unique per bytes)."""
    return f"{LORA_PREFIX}{int(version)}-{digest[:12]}"


def request_body(model: str, prompt: list[int], seed: int, params: SamplingParams, stop_token_ids: list[int],
                 call: str, index: int, size: int, hints: dict[str, Any]) -> dict[str, Any]:
    """The `/v1/completions` body of one row (temperature folded into the logit scale: 1 or greedy 0)."""
    greedy = params.temperature <= 0
    return {
        "model": model,
        "prompt": [int(t) for t in prompt],
        "max_tokens": int(params.max_new_tokens),
        "temperature": 0.0 if greedy else 1.0,
        "top_p": 1.0 if greedy else float(params.top_p),
        "seed": int(seed),
        "n": 1,
        "logprobs": 0,
        "stop_token_ids": list(stop_token_ids),
        "skip_special_tokens": False,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "vllm_xargs": {"qerl_call": call, "qerl_index": int(index), "qerl_size": int(size),
                       "qerl_temperature": float(params.temperature), **hints},
    }


def parse_completion(data: dict, row: int) -> Completion:
    """A `Completion` from one `/v1/completions` response (one choice, token ids and logprobs)."""
    try:
        (choice,) = data["choices"]
        ids = [int(t) for t in choice["token_ids"]]
        lps = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        finish = choice["finish_reason"]
    except (KeyError, TypeError, ValueError) as e:
        raise RolloutServerError(f"row {row}: malformed completion from the server ({e}): {str(data)[:200]}") from None
    if len(lps) != len(ids):
        raise RolloutServerError(f"row {row}: the server returned {len(lps)} logprobs for {len(ids)} tokens")
    if finish not in ("stop", "length"):
        raise RolloutServerError(f"row {row}: request finished with {finish!r}")
    return Completion(ids, lps, finish)


class RemoteEngine:
    """One rollout server, by address (module doc). Stateless beyond a cache of its base name:
    every stage process makes its own and pushes the adapter and noise it needs."""

    def __init__(self, url: str, timeout: float = TIMEOUT_S):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S),
                                  limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S))
        self._info: dict | None = None
        self.adapter: str | None = None
        """Name of the adapter that `generate` requests (None: the base)."""
        self.stats = {"generate_calls": 0, "generate_seconds": 0.0, "tokens": 0, "adapter_swaps": 0,
                      "sleeps": 0, "sleep_seconds": 0.0, "wake_seconds": 0.0}

    # ------------------------------------------------------------------ HTTP

    def _request(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.TimeoutException as e:
            raise RolloutServerError(f"rollout server at {self.url} did not answer {path} within the timeout "
                                     f"({type(e).__name__})") from None
        except httpx.HTTPError as e:
            raise RolloutServerError(f"rollout server at {self.url} is not answering ({path}: {type(e).__name__}: "
                                     f"{e}); start it with `qerl serve` or name a live one in "
                                     "QERL_ROLLOUT_SERVER") from None
        if r.status_code >= 400:
            raise RolloutServerError(f"rollout server at {self.url}: {path} failed with HTTP {r.status_code}: "
                                     f"{_error_text(r)}")
        return r

    def rpc(self, method: str, *args) -> Any:
        """`/collective_rpc` of a worker-extension method on every worker; the first one's answer."""
        r = self._request("POST", "/collective_rpc", json={"method": method, "args": list(args)})
        if not r.content:
            return None
        return r.json()["results"][0]

    def health(self) -> bool:
        try:
            return self._http.get("/health", timeout=CONNECT_TIMEOUT_S).status_code == 200
        except httpx.HTTPError:
            return False

    def info(self) -> dict:
        """What the server serves: backend, checkpoint and its hash, devices, host, regimes."""
        if self._info is None:
            self._info = self.rpc("qerl_info")
        return self._info

    def models(self) -> list[dict]:
        return self._request("GET", "/v1/models").json()["data"]

    def base_name(self) -> str:
        roots = [m["id"] for m in self.models() if not m.get("parent")]
        if not roots:
            raise RolloutServerError(f"rollout server at {self.url} lists no base model")
        return roots[0]

    # ------------------------------------------------------------------ state pushed to the server

    def set_policy(self, adapter_dir: str | Path | None, version: int) -> str | None:
        """Make the server hold adapter `version` from `adapter_dir` (None: the base alone)."""
        from qerl_lib.hashing import adapter_hash

        loaded = [m["id"] for m in self.models() if m.get("parent") and str(m["id"]).startswith(LORA_PREFIX)]
        name = None
        if adapter_dir is not None:
            adapter_dir = Path(adapter_dir).resolve()
            name = lora_name(version, adapter_hash(adapter_dir))
        changed = False
        for old in loaded:
            if old != name:
                self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": old})
                changed = True
        if name is not None and name not in loaded:
            self._request("POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapter_dir)})
            changed = True
            self.stats["adapter_swaps"] += 1
        norms = adapter_dir / NORMS_FILE if adapter_dir is not None else None
        self.rpc("qerl_set_norm_overrides", str(norms) if norms is not None and norms.is_file() else None)
        if changed and self.info().get("merges_adapter"):
            self.rpc("qerl_merge_adapter", None if adapter_dir is None else str(adapter_dir))
        self._request("POST", "/reset_prefix_cache")
        self.adapter = name
        return name

    def set_noise(self, sigma: float, seed: int, step: int, mode: str = "absolute") -> dict:
        """AQN of (seed, step) at `sigma` in the server's norms (sigma 0: the clean weights);
        `mode`: `aqn.sigma_mode`."""
        state = (float(sigma), int(seed), int(step), mode) if sigma > 0 else (0.0, 0, 0, "absolute")
        out = self.rpc("qerl_set_noise", *state)
        self._request("POST", "/reset_prefix_cache")
        return out

    # ------------------------------------------------------------------ GPU hand-over

    def is_sleeping(self) -> bool:
        return bool(self._request("GET", "/is_sleeping").json().get("is_sleeping"))

    def sleep(self, level: int = 1) -> None:
        t0 = time.perf_counter()
        self._request("POST", "/sleep", params={"level": str(level)})
        self.stats["sleeps"] += 1
        self.stats["sleep_seconds"] += time.perf_counter() - t0

    def wake_up(self) -> None:
        if self.is_sleeping():
            t0 = time.perf_counter()
            self._request("POST", "/wake_up")
            self.stats["wake_seconds"] += time.perf_counter() - t0

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[list[int]], seeds: list[int], params: SamplingParams,
                 stop_token_ids: Iterable[int] = (), hints: dict[str, Any] | None = None,
                 progress: Callable[[int], None] | None = None) -> list[Completion]:
        """One completion per (prompt, seed), in order, with the adapter and noise in place.

        `hints` go to `vllm_xargs` (the CPU server reads `qerl_batch_size`, `qerl_dense_cache`)."""
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if not prompts:
            return []
        self.wake_up()
        self.rpc("qerl_set_logit_scale", logit_scale(params))
        model = self.adapter or self.base_name()
        call = uuid.uuid4().hex
        stops = sorted(int(t) for t in stop_token_ids)
        hints = dict(hints or {})
        bodies = [request_body(model, p, s, params, stops, call, i, len(prompts), hints)
                  for i, (p, s) in enumerate(zip(prompts, seeds))]
        concurrency = max(CONCURRENCY, int(hints.get("qerl_batch_size", 1)))
        t0 = time.perf_counter()
        comps = asyncio.run(self._complete_all(bodies, concurrency, progress))
        self.stats["generate_calls"] += 1
        self.stats["generate_seconds"] += time.perf_counter() - t0
        self.stats["tokens"] += sum(len(c.token_ids) for c in comps)
        return comps

    async def _complete_all(self, bodies: list[dict], concurrency: int,
                            progress: Callable[[int], None] | None) -> list[Completion]:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency,
                              keepalive_expiry=KEEPALIVE_EXPIRY_S)
        timeout = httpx.Timeout(self.timeout, connect=CONNECT_TIMEOUT_S)
        sem = asyncio.Semaphore(concurrency)
        done = 0
        out: list[Completion | None] = [None] * len(bodies)
        async with httpx.AsyncClient(base_url=self.url, timeout=timeout, limits=limits) as http:

            async def one(i: int) -> None:
                nonlocal done
                async with sem:
                    try:
                        r = await http.post("/v1/completions", json=bodies[i])
                    except httpx.HTTPError as e:
                        raise RolloutServerError(
                            f"rollout server at {self.url} stopped answering during generation ({done} of "
                            f"{len(bodies)} rows done; {type(e).__name__}: {e}); nothing was written: run the "
                            "stage again once a server answers (`qerl serve`)") from None
                if r.status_code >= 400:
                    raise RolloutServerError(f"rollout server at {self.url}: row {i} failed with HTTP "
                                             f"{r.status_code}: {_error_text(r)}")
                out[i] = parse_completion(r.json(), i)
                done += 1
                if progress is not None:
                    progress(done)

            tasks = [asyncio.ensure_future(one(i)) for i in range(len(bodies))]
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        return out  # type: ignore[return-value]

    def stats_dict(self) -> dict:
        out = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.stats.items()}
        out.update(server=self.url, adapter=self.adapter)
        return out

    def close(self) -> None:
        self._http.close()


def _error_text(r: httpx.Response) -> str:
    try:
        data = r.json()
    except ValueError:
        return r.text[:300]
    if isinstance(data, dict):
        err = data.get("error") if isinstance(data.get("error"), dict) else data
        return str(err.get("message") or err.get("detail") or data)[:300]
    return str(data)[:300]


# ============================================================================ the stage side


def expected_checkpoint_hash(layout, quant: str) -> str:
    from qerl_lib.io import read_json

    report = layout.convert_report(quant)
    if not report.is_file():
        raise FileNotFoundError(f"{report} not found: run the convert stage before using a rollout server")
    return read_json(report)["checkpoint_hash"]


def checkpoint_eos_ids(checkpoint: Path, tokenizer) -> set[int]:
    """The stop tokens an in-process policy of `checkpoint` uses: the generation config's EOS ids
    (as transformers loads it with the model) and the tokenizer's."""
    from transformers import AutoConfig, GenerationConfig

    try:
        gen = GenerationConfig.from_pretrained(str(checkpoint))
    except OSError:
        gen = GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(checkpoint)))
    ids = set()
    eos = gen.eos_token_id
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class RemotePolicy:
    """The rollout side of a policy when a server samples: the tokenizer, the stop tokens and the
    adapter / noise bookkeeping of `qerl_lib.policy.Policy`, with generation on the server. It
    loads no model weights, so a rollout or eval stage starts in seconds."""

    def __init__(self, cfg, layout, url: str):
        from qerl_lib.model import load_tokenizer

        self.cfg = cfg
        self.layout = layout
        self.checkpoint = layout.checkpoint(cfg.model.quant)
        self.engine = RemoteEngine(url)
        check_server(self.engine, cfg, layout)
        self.tokenizer = load_tokenizer(self.checkpoint)
        self.eos_ids = checkpoint_eos_ids(self.checkpoint, self.tokenizer)
        self.version: int | None = None
        self.adapter_hash = ""
        self.adapter_dir: Path | None = None
        self.noise: tuple[float, int, int] = (0.0, 0, 0)

    def load_adapter(self, adapter_dir: Path, version: int) -> None:
        from qerl_lib.hashing import adapter_hash
        from qerl_lib.paths import ADAPTER_WEIGHTS
        from qerl_lib.tensor_files import read_safetensors

        # A damaged or non-finite adapter is bad input (exit 2), refused here by name before the
        # server's load fails on it as a server error.
        read_safetensors(Path(adapter_dir) / ADAPTER_WEIGHTS)
        self.engine.set_policy(adapter_dir, version)
        self.version = version
        self.adapter_hash = adapter_hash(adapter_dir)
        self.adapter_dir = Path(adapter_dir)
        self.noise = (0.0, 0, 0)
        self.engine.set_noise(0.0, 0, 0)

    def set_noise(self, sigma: float, seed: int, step: int, mode: str = "absolute") -> None:
        self.engine.set_noise(sigma, seed, step, mode)
        self.noise = (float(sigma), int(seed), int(step))

    def generate(self, prompts, seeds, params, batch_size: int, progress=None):
        hints = {"qerl_batch_size": int(batch_size), "qerl_dense_cache": int(bool(self.cfg.rollout.dense_cache))}
        comps = self.engine.generate(prompts, seeds, params, self.eos_ids, hints, progress)
        _write_client_stats(self.layout, self.engine)
        return comps


def check_server(engine: RemoteEngine, cfg, layout) -> dict:
    """Refuse a server that serves another checkpoint or backend than this workspace's."""
    info = engine.info()
    want = expected_checkpoint_hash(layout, cfg.model.quant)
    if info.get("checkpoint_hash") != want:
        raise ServerMismatch(
            f"rollout server at {engine.url} serves checkpoint {info.get('checkpoint')} (sha256 "
            f"{str(info.get('checkpoint_hash'))[:16]}...), but this workspace's {layout.checkpoint(cfg.model.quant)} "
            f"is {want[:16]}...: start `qerl serve` for this workspace, or unset QERL_ROLLOUT_SERVER")
    if info.get("backend") != cfg.rollout.backend:
        raise ServerMismatch(
            f"rollout server at {engine.url} samples with the {info.get('backend')} backend, but this "
            f"workspace's config says rollout.backend={cfg.rollout.backend}")
    if info.get("backend") == "transformers":
        settings = server_settings(cfg)
        theirs = info.get("settings") or {}
        diff = sorted(k for k in settings if settings[k] != theirs.get(k))
        if diff:
            raise ServerMismatch(f"rollout server at {engine.url} was started with other settings than this "
                                 f"workspace's config ({', '.join(diff)}): restart `qerl serve` with this config")
    return info


def server_settings(cfg) -> dict[str, Any]:
    """Config values that change what a transformers server samples (besides the request)."""
    return {"model.quant": cfg.model.quant, "model.device": cfg.model.device,
            "model.compute_dtype": cfg.model.compute_dtype, "lora": json.loads(cfg.lora.model_dump_json())}


def remote_policy(cfg, layout) -> RemotePolicy | None:
    """A `RemotePolicy` on the workspace's rollout server, or None when there is none
    (`qerl_lib.rollout.service.find_server`). Kept per process (`qerl run` asks every stage)."""
    addr = find_server(layout.root)
    if addr is None:
        return None
    key = (addr.url, str(Path(layout.root).resolve()), cfg.model.quant)
    pol = _REMOTE.get(key)
    if pol is None:
        _REMOTE.clear()
        pol = _REMOTE[key] = RemotePolicy(cfg, layout, addr.url)
        log.info("rollouts on the server at %s (%s)", addr.url, addr.source)
    pol.cfg = cfg
    return pol


_REMOTE: dict[tuple, RemotePolicy] = {}


@contextmanager
def server_asleep(root: str | Path) -> Iterator[bool]:
    """Around training: put the workspace's rollout server to sleep when it shares this process's
    devices (colocated), and wake it after, also on failure. Yields whether it slept. A server on
    other devices or another machine is left alone; one that does not answer is only warned about
    (it holds no memory then)."""
    addr = find_server(root)
    if addr is None:
        yield False
        return
    engine = RemoteEngine(addr.url, timeout=600)
    try:
        devices = set(engine.info().get("devices") or [])
    except RolloutServerError as e:
        log.warning("not putting the rollout server to sleep: %s", e)
        yield False
        return
    if not devices & set(local_devices()):
        yield False
        return
    engine.sleep()
    try:
        yield True
    finally:
        try:
            engine.wake_up()
        except RolloutServerError as e:
            log.warning("could not wake the rollout server after training: %s", e)
        engine.close()


def _write_client_stats(layout, engine: RemoteEngine) -> None:
    from qerl_lib.io import atomic_write_json

    try:
        atomic_write_json(layout.rollout_client_stats, engine.stats_dict())
    except OSError as e:  # statistics only: never fail a stage for them
        log.warning("could not write rollout_client.json: %s", e)
