"""Data-parallel rollout replicas: R engines, each in its own process on its own GPUs, that
share the rows of every `generate` call.

`ReplicaPool` has the engine interface the policy drives (`set_policy`, `set_noise`,
`generate`, `sleep`, `wake_up`, `stats_dict`, `close`). State changes go to every replica;
`generate` gives replica r the r-th contiguous share of the rows (`share_bounds`), runs the
replicas at once and returns the completions in the callers' row order. Rows carry their own
seeds (per-request seeds), so which replica samples a row does not choose its random stream.

Each replica is a spawned process with `CUDA_VISIBLE_DEVICES` set to its GPU group (from
`qerl_lib.distributed.placement`) before anything imports CUDA, holding one long-lived engine
built by a picklable factory (`vllm_replica`: a `VLLMEngine` with the pool's keyword
arguments). For a dense model the replicas need no communication, which is why they are
independent vLLM engines rather than vLLM's coordinated data parallelism (whose lock-step
exists for expert-parallel MoE layers).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from typing import Any, Callable, Iterable

from qerl_lib.rollout.sampling import Completion, SamplingParams


def share_bounds(n_rows: int, replicas: int) -> list[tuple[int, int]]:
    """[start, end) of each replica's contiguous share; sizes differ by at most one row."""
    base, extra = divmod(n_rows, replicas)
    out, start = [], 0
    for r in range(replicas):
        end = start + base + (1 if r < extra else 0)
        out.append((start, end))
        start = end
    return out


def vllm_replica(checkpoint: str, kwargs: dict):
    """Factory of one replica's engine (runs inside the replica process)."""
    from qerl_lib.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(checkpoint, **kwargs)


def _serve(conn, gpus: list[int] | None, factory: Callable, args: tuple) -> None:
    if gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    try:
        engine = factory(*args)
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        method, call_args = conn.recv()
        if method == "__close__":
            try:
                engine.close()
            finally:
                conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(engine, method)(*call_args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class ReplicaPool:
    """R replica processes, each serving one engine made by `factory(*args)` (module doc)."""

    def __init__(self, replicas: int, factory: Callable, args: tuple = (),
                 gpu_groups: list[list[int]] | None = None):
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if gpu_groups is not None and len(gpu_groups) != replicas:
            raise ValueError(f"{replicas} replicas but {len(gpu_groups)} GPU groups")
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        for r in range(replicas):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, None if gpu_groups is None else gpu_groups[r], factory, args),
                               daemon=True, name=f"qerl-rollout-replica-{r}")
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        try:
            self._gather(range(replicas), "start")
        except Exception:
            self.close()
            raise

    @property
    def replicas(self) -> int:
        return len(self._conns)

    def _gather(self, which: Iterable[int], what: str) -> list:
        results, errors = [], []
        for r in which:
            status, value = self._conns[r].recv()
            if status == "error":
                errors.append(f"replica {r} ({what}):\n{value}")
            results.append(value)
        if errors:
            raise RuntimeError("\n".join(errors))
        return results

    def _broadcast(self, method: str, *args) -> list:
        for conn in self._conns:
            conn.send((method, args))
        return self._gather(range(self.replicas), method)

    def set_policy(self, adapter_dir, version: int) -> None:
        self._broadcast("set_policy", adapter_dir, version)

    def set_noise(self, sigma: float, seed: int, step: int, force: bool = False, mode: str = "absolute") -> None:
        self._broadcast("set_noise", sigma, seed, step, force, mode)

    def sleep(self, level: int = 1) -> None:
        self._broadcast("sleep", level)

    def wake_up(self) -> None:
        self._broadcast("wake_up")

    def generate(self, prompts: list[list[int]], seeds: list[int], params: SamplingParams,
                 stop_token_ids: Iterable[int] = ()) -> list[Completion]:
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        stops = list(stop_token_ids)
        busy = []
        for r, (a, b) in enumerate(share_bounds(len(prompts), self.replicas)):
            if a < b:
                self._conns[r].send(("generate", (prompts[a:b], seeds[a:b], params, stops)))
                busy.append(r)
        out: list[Completion] = []
        for part in self._gather(busy, "generate"):
            out.extend(part)
        return out

    def stats_dict(self) -> dict[str, Any]:
        return {"replicas": self._broadcast("stats_dict")}

    def close(self) -> None:
        for conn, proc in zip(self._conns, self._procs):
            try:
                if proc.is_alive():
                    conn.send(("__close__", ()))
                    if conn.poll(120):
                        conn.recv()
            except (OSError, EOFError):
                pass
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        self._conns, self._procs = [], []
