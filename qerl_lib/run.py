"""A whole local training run: every stage in order, in one process, resumable.

The plan is a flat list of stage calls. A call is done when its last-written output
exists (every output is written atomically, so existence means complete); a run that
is started again skips done calls and continues at the first missing one. The
policy model stays loaded across calls (`policy.get_policy(reuse=True)`), so a step
pays no model start-up.

One run at a time per workspace: an exclusive `flock` on `<root>/.qerl.lock` refuses a
second one with a clear message (the kernel drops the lock if the holder is killed).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import yaml

from qerl_lib.config import QerlConfig, config_to_dict, save_config
from qerl_lib.paths import TRAINER_STATE, Layout


class WorkspaceBusy(RuntimeError):
    pass


class ConfigMismatch(RuntimeError):
    pass


@dataclass(frozen=True)
class StageCall:
    name: str
    step: int | None
    done_marker: Path

    @property
    def label(self) -> str:
        return self.name if self.step is None else f"{self.name}@{self.step}"


def eval_steps(cfg: QerlConfig) -> list[int]:
    """Adapters to evaluate: 0 (the base), every `eval.every` steps, and the last."""
    steps = {0, cfg.run.steps}
    if cfg.eval.every:
        steps.update(range(cfg.eval.every, cfg.run.steps, cfg.eval.every))
    return sorted(steps)


def plan(cfg: QerlConfig, layout: Layout) -> list[StageCall]:
    calls = [
        StageCall("prepare", None, layout.prepared("test")),
        StageCall("convert", None, layout.convert_report(cfg.model.quant)),
        StageCall("init_adapter", None, layout.adapter(0) / TRAINER_STATE),
    ]
    evals = set(eval_steps(cfg))
    for i in range(cfg.run.steps):
        if i in evals:
            calls.append(StageCall("eval", i, layout.eval_metrics(i)))
        calls += [
            StageCall("rollout", i, layout.rollouts(i)),
            StageCall("reward", i, layout.reward_metrics(i)),
            StageCall("update", i, layout.update_metrics(i)),
        ]
    calls.append(StageCall("eval", cfg.run.steps, layout.eval_metrics(cfg.run.steps)))
    calls.append(StageCall("report", None, layout.report_metrics))
    return calls


def run_call(call: StageCall, cfg: QerlConfig, layout: Layout, reuse_policy: bool = False):
    from qerl_lib import stages
    from qerl_lib.policy import get_policy

    def pol():
        return get_policy(cfg, layout, reuse=True) if reuse_policy else None

    if call.name == "prepare":
        return stages.prepare_stage(cfg, layout)
    if call.name == "convert":
        return stages.convert_stage(cfg, layout)
    if call.name == "init_adapter":
        return stages.init_adapter_stage(cfg, layout)
    if call.name == "rollout":
        return stages.rollout_stage(cfg, layout, call.step, pol())
    if call.name == "reward":
        return stages.reward_stage(cfg, layout, call.step)
    if call.name == "update":
        return stages.update_stage(cfg, layout, call.step, pol())
    if call.name == "eval":
        return stages.eval_stage(cfg, layout, call.step, pol())
    if call.name == "report":
        return stages.report_stage(cfg, layout)
    raise ValueError(f"unknown stage {call.name!r}")


@contextmanager
def workspace_lock(layout: Layout) -> Iterator[None]:
    layout.root.mkdir(parents=True, exist_ok=True)
    path = layout.root / ".qerl.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = Path(path).read_text().strip() or "another process"
            raise WorkspaceBusy(
                f"workspace {layout.root} is in use by {holder}; wait for it to finish or use another run.root"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}".encode())
        yield
    finally:
        os.close(fd)


def check_config(cfg: QerlConfig, layout: Layout) -> None:
    """Refuse to continue a workspace that was started with another config."""
    if not layout.config.is_file():
        return
    old = yaml.safe_load(layout.config.read_text()) or {}
    new = config_to_dict(cfg)
    # The run length and eval cadence may grow on resume; everything else must match.
    for d in (old, new):
        d.get("run", {}).pop("steps", None)
        d.get("run", {}).pop("threads", None)
        d.get("eval", {}).pop("every", None)
    if json.dumps(old, sort_keys=True) != json.dumps(new, sort_keys=True):
        diffs = _diff(old, new)
        raise ConfigMismatch(
            f"workspace {layout.root} was started with another config ({', '.join(diffs[:5])}); "
            "use a new run.root or delete the workspace"
        )


def _diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}: {va!r} -> {vb!r}")
    return out


def run_all(cfg: QerlConfig, on_event: Callable[[str, StageCall, dict], None] | None = None) -> list[dict]:
    """Run (or resume) the whole plan. Returns one timing record per executed call."""
    layout = Layout(cfg.run.root)
    records = []
    with workspace_lock(layout):
        check_config(cfg, layout)
        save_config(cfg, layout.config)
        for call in plan(cfg, layout):
            if call.name != "report" and call.done_marker.exists():
                if on_event:
                    on_event("skip", call, {})
                continue
            if on_event:
                on_event("start", call, {})
            t0 = time.perf_counter()
            result = run_call(call, cfg, layout, reuse_policy=True)
            rec = {"stage": call.name, "step": call.step, "seconds": round(time.perf_counter() - t0, 3)}
            records.append(rec)
            layout.stage_times.parent.mkdir(parents=True, exist_ok=True)
            with open(layout.stage_times, "a") as f:
                f.write(json.dumps(rec) + "\n")
            if on_event:
                on_event("done", call, {"seconds": rec["seconds"], "result": result})
    return records
