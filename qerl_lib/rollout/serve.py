"""`qerl serve`: one long-lived rollout server for a workspace's checkpoint.

    qerl serve [-c CONFIG] [--root WS] [--host 127.0.0.1] [--port 0]

- `rollout.backend: vllm`: stock `vllm serve` (`python -m vllm.entrypoints.openai.api_server`,
  no fork, no patch) with the project's worker extension and the flags the client needs:
  `--enable-lora --enable-sleep-mode --skip-tokenizer-init --logprobs-mode raw_logprobs
  --generation-config vllm`, with `VLLM_SERVER_DEV_MODE=1` (for `/collective_rpc`, `/sleep`) and
  `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`. The engine settings come from the `rollout` section
  (`vllm_max_lora_rank`, `vllm_gpu_memory_utilization`, `vllm_enforce_eager`,
  `vllm_dense_above`, `vllm_lora_dual_stream`).
- `rollout.backend: transformers`: the project's CPU server (`qerl_lib.rollout.cpu_server`).

Once the server answers, its address goes to `<run.root>/rollout_server.json` (where stages find
it) and is printed; the file is removed when the server stops (SIGINT, SIGTERM, or the vLLM
child dying). The vLLM child gets the parent-death signal, so a killed `qerl serve` takes it
along.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from qerl_lib.rollout.service import remove_address, write_address

log = logging.getLogger(__name__)

READY_TIMEOUT_S = float(os.environ.get("QERL_SERVE_READY_TIMEOUT", "900"))
"""Seconds to wait for the server to answer /health (vLLM: model load, compile, CUDA graphs)."""


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _announce(cfg, layout, url: str, backend: str, pid: int, started: float) -> dict:
    info = {"url": url, "pid": pid, "host": socket.gethostname(), "backend": backend,
            "checkpoint": str(layout.checkpoint(cfg.model.quant).resolve()),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "startup_seconds": round(time.time() - started, 3)}
    path = write_address(layout.root, info)
    print(f"rollout server ({backend}) ready at {url} after {info['startup_seconds']:.1f}s; "
          f"stages of {layout.root} use it (address in {path})", flush=True)
    return info


def vllm_command(cfg, checkpoint: Path, host: str, port: int) -> tuple[list[str], dict[str, str]]:
    """argv and extra environment of stock `vllm serve` for this config (module doc)."""
    from qerl_lib.env import child_env
    from qerl_lib.policy import dense_above_for, gemv_rows_for
    from qerl_lib.rollout.vllm_engine import EXTENSION, LOGPROBS_MODE, vllm_quantization
    from qerl_lib.rollout.vllm_gemv import gemv_env
    from qerl_lib.rollout.vllm_worker import DENSE_ABOVE_ENV

    rc = cfg.rollout
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
            "--host", host, "--port", str(port), "--served-model-name", "qerl-base",
            "--enable-lora", "--max-lora-rank", str(rc.vllm_max_lora_rank), "--max-loras", "1",
            "--max-cpu-loras", "1", "--enable-sleep-mode", "--skip-tokenizer-init",
            "--logprobs-mode", LOGPROBS_MODE, "--worker-extension-cls", EXTENSION,
            "--generation-config", "vllm", "--seed", str(cfg.run.seed),
            "--gpu-memory-utilization", str(rc.vllm_gpu_memory_utilization),
            "--tensor-parallel-size", str(cfg.parallel.rollout_tensor_parallel), "--disable-log-stats"]
    if rc.vllm_enforce_eager:
        argv.append("--enforce-eager")
    if rc.vllm_kv_cache_gib is not None:
        argv += ["--kv-cache-memory-bytes", str(int(rc.vllm_kv_cache_gib * 2**30))]
    if rc.vllm_max_model_len is not None:
        argv += ["--max-model-len", str(rc.vllm_max_model_len)]
    if vllm_quantization(cfg.model.quant):
        argv += ["--quantization", vllm_quantization(cfg.model.quant)]
    extra = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
             "VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0"),
             "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "VLLM_CONFIGURE_LOGGING": "1"}
    dense = dense_above_for(cfg, checkpoint)
    env = child_env(extra)
    env.pop(DENSE_ABOVE_ENV, None)
    env.pop("VLLM_LORA_ENABLE_DUAL_STREAM", None)
    if dense is not None:
        env[DENSE_ABOVE_ENV] = str(int(dense))
        env["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    if rc.vllm_lora_dual_stream:
        env["VLLM_LORA_ENABLE_DUAL_STREAM"] = "1"
    gemv_rows = gemv_rows_for(cfg)
    for name, value in gemv_env(gemv_rows, rc.vllm_gemv_kernel, rc.vllm_gemv_pdl, rc.vllm_gemv_repack).items():
        env.pop(name, None)
        if value is not None:
            env[name] = value
    if gemv_rows:
        env["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    if cfg.parallel.rollout_tensor_parallel > 1:
        env.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})
    # The project's worker extension must be importable by vLLM's workers.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([p for p in (root, env.get("PYTHONPATH", "")) if p])
    return argv, env


def _parent_death_signal() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def serve_vllm(cfg, layout, host: str, port: int) -> int:
    from qerl_lib.rollout.client import RemoteEngine

    checkpoint = layout.checkpoint(cfg.model.quant)
    port = port or _free_port(host)
    url = f"http://{host}:{port}"
    argv, env = vllm_command(cfg, checkpoint, host, port)
    started = time.time()
    print(f"starting vLLM for {checkpoint}: {' '.join(argv[1:])}", flush=True)
    child = subprocess.Popen(argv, env=env, preexec_fn=_parent_death_signal, start_new_session=True)
    stop = {"sig": 0}

    def on_signal(signum, _frame):
        stop["sig"] = signum

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    engine = RemoteEngine(url, timeout=30)
    announced = False
    try:
        while child.poll() is None and not stop["sig"]:
            if not announced:
                if engine.health():
                    _announce(cfg, layout, url, "vllm", os.getpid(), started)
                    announced = True
                elif time.time() - started > READY_TIMEOUT_S:
                    print(f"qerl: error: vLLM did not answer /health within {READY_TIMEOUT_S:.0f}s", file=sys.stderr)
                    break
            time.sleep(0.5)
    finally:
        remove_address(layout.root, url)
        if child.poll() is None:
            try:
                os.killpg(child.pid, signal.SIGTERM)
                child.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        engine.close()
    if stop["sig"]:
        return 0
    rc = child.returncode if child.returncode is not None else 1
    print(f"qerl: error: the vLLM server exited with {rc}", file=sys.stderr)
    return 1 if rc == 0 else rc


def serve_cpu(cfg, layout, host: str, port: int) -> int:
    from qerl_lib.rollout.cpu_server import CPUEngine, make_app, run

    started = time.time()
    engine = CPUEngine(cfg, layout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    url = f"http://{host}:{sock.getsockname()[1]}"
    ready = threading.Event()

    def announce():
        ready.wait()
        _announce(cfg, layout, url, "transformers", os.getpid(), started)

    threading.Thread(target=announce, daemon=True).start()

    def stop(signum, _frame):
        # uvicorn shuts down on the signal, then raises it again with the handler it found: this
        # one, so the address file is removed instead of the process dying on the spot.
        raise SystemExit(0)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    try:
        run(make_app(engine), sock, ready)
    except SystemExit:
        pass
    finally:
        remove_address(layout.root, url)
    return 0


def serve(cfg, layout, host: str = "127.0.0.1", port: int = 0) -> int:
    """Start the rollout server of `cfg.rollout.backend` for the workspace; returns when it stops."""
    report = layout.convert_report(cfg.model.quant)
    if not report.is_file():
        raise FileNotFoundError(f"{report} not found: the server serves the converted checkpoint, so run the "
                                "convert stage first (`qerl stage convert`, or `dvc repro convert`)")
    existing = layout.rollout_server_file
    if existing.is_file():
        try:
            other = json.loads(existing.read_text())
        except (OSError, ValueError):
            other = {}
        from qerl_lib.rollout.client import RemoteEngine

        if other.get("url") and RemoteEngine(other["url"], timeout=5).health():
            raise ValueError(f"a rollout server already serves {layout.root} at {other['url']} "
                             f"(pid {other.get('pid')}); stop it first or use another run.root")
    if cfg.rollout.backend == "vllm":
        return serve_vllm(cfg, layout, host, port)
    return serve_cpu(cfg, layout, host, port)
