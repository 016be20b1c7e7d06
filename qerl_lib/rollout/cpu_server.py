"""The project's rollout server on the transformers backend: the endpoints of `vllm serve` that
the client uses, over one in-process `qerl_lib.policy.Policy`, so that CPU machines and CI run the
same client code as the GPU.

Endpoints (vLLM's names and shapes): `GET /health`, `GET /v1/models`, `POST /v1/completions`
(token-id prompt, one choice, `token_ids` and `logprobs.token_logprobs`), `POST
/v1/load_lora_adapter` / `/v1/unload_lora_adapter`, `POST /collective_rpc` (`qerl_info`,
`qerl_set_noise`, `qerl_set_logit_scale`, `qerl_set_norm_overrides`, `qerl_merge_adapter`,
`qerl_norm_info`), `POST /sleep`, `POST /wake_up`, `GET /is_sleeping`, `POST /reset_prefix_cache`.

**Same bytes as an in-process run.** The transformers sampler's rows depend on the batch they are
sampled in (floating-point rounding of padded batches). The client names each row's call, index,
call size and batch size in `vllm_xargs`; this server collects the rows of a call and samples
exactly the batches an in-process `Policy.generate` samples (rows [k*B, (k+1)*B)), each once
complete, on one worker thread, with the temperature the client sampled at. A request without
those hints is sampled alone.

One adapter at a time, as the client uses it: `load_lora_adapter` loads the weights into the
model at once (trained norms too), so the noise set after it stays in place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from qerl_lib.rollout.sampling import SamplingParams

log = logging.getLogger(__name__)

BASE_NAME = "qerl-base"
"""The base model's name in `/v1/models` and `model` of requests."""


@dataclass
class _Call:
    """The rows of one client `generate` call that have arrived, by index."""

    size: int
    batch_size: int
    params: SamplingParams
    stops: tuple[int, ...]
    model: str
    dense_cache: bool
    rows: dict[int, tuple[list[int], int, asyncio.Future]] = field(default_factory=dict)
    submitted: set[int] = field(default_factory=set)
    """Batches handed to the worker thread."""
    finished: int = 0
    cache: contextlib.ExitStack | None = None


class CPUEngine:
    """A `Policy` behind the server: adapter, noise and sampling state (one worker thread)."""

    def __init__(self, cfg, layout):
        from qerl_lib.convert import checkpoint_hash
        from qerl_lib.io import read_json
        from qerl_lib.policy import Policy
        from qerl_lib.rollout.client import server_settings

        self.cfg = cfg
        self.policy = Policy(cfg, layout)
        ckpt = self.policy.checkpoint
        report = ckpt / "convert_report.json"
        digest = read_json(report)["checkpoint_hash"] if report.is_file() else checkpoint_hash(ckpt)
        self.adapters: dict[str, str] = {}
        self.active: str | None = None
        self.asleep = False
        self.sleeps = 0
        self.logit_scale = 1.0
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qerl-sampler")
        self.calls: dict[str, _Call] = {}
        self.info = {
            "backend": "transformers", "checkpoint": str(Path(ckpt).resolve()), "checkpoint_hash": digest,
            "devices": [f"cpu@{socket.gethostname()}"] if self.policy.device.type == "cpu"
            else _cuda_uuids(), "host": socket.gethostname(), "pid": os.getpid(), "merges_adapter": False,
            "settings": server_settings(cfg),
        }
        self.requests = 0

    # ------------------------------------------------------------------ state (worker thread)

    def _load_adapter(self, name: str, path: str) -> None:
        self.policy.load_adapter(Path(path), 0)
        self.adapters[name] = path
        self.active = name

    def _unload_adapter(self, name: str) -> None:
        self.adapters.pop(name, None)
        if self.active == name:
            self.active = None

    def rpc(self, method: str, args: list) -> Any:
        if method == "qerl_info":
            return {**self.info, "sleeps": self.sleeps}
        if method == "qerl_set_noise":
            sigma, seed, step, *mode = args
            self.policy.set_noise(float(sigma), int(seed), int(step), *(mode or ["absolute"]))
            return {"state": [float(sigma), int(seed), int(step)], "fingerprint": self.policy.injector.fingerprint()}
        if method == "qerl_norm_info":
            return {"state": list(self.policy.noise), "fingerprint": self.policy.injector.fingerprint()}
        if method == "qerl_set_logit_scale":
            self.logit_scale = float(args[0])
            return 1
        if method == "qerl_set_norm_overrides":
            return 0  # trained norms come with the adapter's weights (`lora.load_adapter_weights`)
        if method == "qerl_merge_adapter":
            return {}
        raise KeyError(f"unknown method {method!r}")

    def _sample(self, call: _Call, rows: list[tuple[list[int], int]]) -> list:
        from qerl_lib.nvfp4_linear import dense_inference_cache
        from qerl_lib.rollout.sampling import sample_batch

        pol = self.policy
        if call.model != BASE_NAME and call.model != self.active:
            raise ValueError(f"adapter {call.model!r} is not the loaded one ({self.active!r}); load it first")
        if call.cache is None:
            call.cache = contextlib.ExitStack()
            if call.dense_cache:
                call.cache.enter_context(dense_inference_cache(pol.model, pol.dtype))
            if call.model == BASE_NAME and self.active is not None:
                call.cache.enter_context(pol.model.disable_adapter())
        pol.model.eval()
        return sample_batch(pol.model, [r[0] for r in rows], [r[1] for r in rows], call.params, set(call.stops),
                            pol.tokenizer.pad_token_id)

    # ------------------------------------------------------------------ completions (event loop)

    async def complete(self, body: dict) -> dict:
        if self.asleep:
            raise _HTTPError(503, "the rollout server is asleep (POST /wake_up first)")
        loop = asyncio.get_running_loop()
        prompt = body.get("prompt")
        if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            raise _HTTPError(400, "prompt must be a list of token ids (this server has no tokenizer endpoint)")
        hints = body.get("vllm_xargs") or {}
        model = body.get("model") or BASE_NAME
        if model != BASE_NAME and model not in self.adapters:
            raise _HTTPError(404, f"The model `{model}` does not exist.")
        temperature = float(body.get("temperature") or 0.0)
        if "qerl_temperature" in hints:
            temperature = float(hints["qerl_temperature"])
        elif temperature > 0:
            temperature = temperature / self.logit_scale
        params = SamplingParams(temperature, float(body.get("top_p") or 1.0), int(body.get("max_tokens") or 16))
        stops = tuple(sorted(int(t) for t in body.get("stop_token_ids") or ()))
        seed = int(body.get("seed") or 0)
        call_id = str(hints.get("qerl_call") or f"single-{self.requests}")
        self.requests += 1
        if "qerl_call" in hints:
            size, index = int(hints["qerl_size"]), int(hints["qerl_index"])
            batch = max(1, int(hints.get("qerl_batch_size", 1)))
        else:
            size, index, batch = 1, 0, 1
        call = self.calls.get(call_id)
        if call is None:
            self._drop_stale(keep=call_id)
            call = self.calls[call_id] = _Call(size, batch, params, stops, model, bool(int(hints.get("qerl_dense_cache", 1))))
        fut = loop.create_future()
        call.rows[index] = (prompt, seed, fut)
        self._submit_ready(call_id, call, loop)
        comp = await fut
        return _completion_json(model, comp)

    def _submit_ready(self, call_id: str, call: _Call, loop) -> None:
        for k in range((call.size + call.batch_size - 1) // call.batch_size):
            lo, hi = k * call.batch_size, min((k + 1) * call.batch_size, call.size)
            if k in call.submitted or any(i not in call.rows for i in range(lo, hi)):
                continue
            call.submitted.add(k)
            rows = [call.rows[i][:2] for i in range(lo, hi)]
            futs = [call.rows[i][2] for i in range(lo, hi)]
            job = loop.run_in_executor(self.worker, self._sample, call, rows)
            job.add_done_callback(lambda j, futs=futs, cid=call_id, c=call: self._finish(j, futs, cid, c))

    def _finish(self, job, futs, call_id: str, call: _Call) -> None:
        err = job.exception()
        for i, fut in enumerate(futs):
            if fut.done():
                continue
            if err is not None:
                fut.set_exception(_HTTPError(400 if isinstance(err, ValueError) else 500, f"{type(err).__name__}: {err}"))
            else:
                fut.set_result(job.result()[i])
        call.finished += len(futs)
        if call.finished >= call.size and self.calls.get(call_id) is call:
            del self.calls[call_id]
            if call.cache is not None:
                self.worker.submit(call.cache.close)

    def _drop_stale(self, keep: str) -> None:
        """A new call while another one is incomplete: its client is gone (one client at a time)."""
        for cid, call in list(self.calls.items()):
            if cid == keep:
                continue
            for _, _, fut in call.rows.values():
                if not fut.done():
                    fut.set_exception(_HTTPError(409, "superseded by a newer call"))
            del self.calls[cid]
            if call.cache is not None:
                self.worker.submit(call.cache.close)


class _HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def _completion_json(model: str, comp) -> dict:
    return {
        "id": f"cmpl-{time.time_ns()}", "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{
            "index": 0, "text": "", "finish_reason": comp.finish_reason, "token_ids": comp.token_ids,
            "logprobs": {"tokens": [f"token_id:{t}" for t in comp.token_ids], "token_logprobs": comp.logprobs,
                         "top_logprobs": None, "text_offset": []},
        }],
        "usage": {"completion_tokens": len(comp.token_ids)},
    }


def _cuda_uuids() -> list[str]:
    import torch

    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def make_app(engine: CPUEngine):
    """The FastAPI app of `engine` (module doc)."""
    app = FastAPI(title="qerl rollout server (transformers backend)")
    lock = asyncio.Lock()  # state changes and generation calls never interleave mid-change

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)

    async def on_worker(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(engine.worker, fn, *args)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        data = [{"id": BASE_NAME, "object": "model", "root": engine.info["checkpoint"], "parent": None}]
        data += [{"id": n, "object": "model", "root": p, "parent": BASE_NAME} for n, p in engine.adapters.items()]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            return await engine.complete(await request.json())
        except _HTTPError as e:
            return error(e.status, e.message)

    @app.post("/v1/load_lora_adapter")
    async def load_lora(request: Request):
        body = await request.json()
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return error(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name in engine.adapters and not body.get("load_inplace"):
            return error(400, f"The lora adapter '{name}' has already been loaded.")
        if not Path(path).is_dir():
            return error(404, f"Loading lora {name} failed: No adapter found for {path}")
        async with lock:
            try:
                await on_worker(engine._load_adapter, name, path)
            except (ValueError, KeyError, FileNotFoundError, RuntimeError) as e:
                return error(400, f"Loading lora {name} failed: {e}")
        return Response(f"Success: LoRA adapter '{name}' added successfully.", status_code=200)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request):
        name = (await request.json()).get("lora_name")
        if name not in engine.adapters:
            return error(404, f"The lora adapter '{name}' cannot be found.")
        async with lock:
            await on_worker(engine._unload_adapter, name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", status_code=200)

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request):
        body = await request.json()
        if not body.get("method"):
            return error(400, "Missing 'method' in request body")
        async with lock:
            try:
                result = await on_worker(engine.rpc, body["method"], list(body.get("args") or []))
            except KeyError as e:
                return error(400, str(e))
        return {"results": [result]}

    @app.post("/sleep")
    async def sleep():
        engine.sleeps += not engine.asleep
        engine.asleep = True
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up():
        engine.asleep = False
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": engine.asleep}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        return Response(status_code=200)

    return app


def run(app, sock: socket.socket, ready: threading.Event | None = None) -> None:
    """Serve `app` on the bound socket `sock` until SIGINT / SIGTERM (uvicorn's handlers)."""
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    if ready is not None:
        def watch():
            while not server.started and not server.should_exit:
                time.sleep(0.05)
            ready.set()

        threading.Thread(target=watch, daemon=True).start()
    server.run(sockets=[sock])
