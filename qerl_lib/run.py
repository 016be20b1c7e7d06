"""A whole local training run: every stage in order, in one process, resumable.

The plan is a flat list of stage calls. A call is done when its last-written output
exists (every output is written atomically, so existence means complete); a run that
is started again skips done calls and continues at the first missing one. A step's
rollout and reward also count as done once its update is (`trained`): their outputs
were consumed, and a workspace may drop them (`resume_state`: the files another
machine needs to continue the run). The policy model stays loaded across calls
(`policy.get_policy(reuse=True)`), so a step pays no model start-up.

One run at a time per workspace: an exclusive `flock` on `<root>/.qerl.lock` refuses a
second one with a clear message (the kernel drops the lock if the holder is killed).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import yaml

from qerl_lib.config import QerlConfig, config_to_dict, save_config
from qerl_lib.env import release_memory
from qerl_lib.paths import TRAINER_STATE, Layout
from qerl_lib.stages import registry


class WorkspaceBusy(RuntimeError):
    pass


class ConfigMismatch(RuntimeError):
    pass


def eval_steps(cfg: QerlConfig) -> list[int]:
    """Adapters to evaluate: 0 (the base, with `eval.base`), every `eval.every` steps, and the last."""
    return registry.eval_steps(cfg.run.steps, cfg.eval.every, cfg.eval.base)


def plan(cfg: QerlConfig, layout: Layout) -> list[registry.Call]:
    """Every stage call of the run, in order (`qerl_lib.stages.registry.plan`)."""
    return registry.plan(cfg.run.steps, cfg.eval.every, cfg.model.quant, layout, cfg.eval.base)


def run_call(call: registry.Call, cfg: QerlConfig, layout: Layout, reuse_policy: bool = False):
    """Run one stage call; with `reuse_policy`, the stage gets the policy this process keeps loaded."""
    policy = None
    if reuse_policy and call.stage.uses_policy:
        from qerl_lib.policy import get_policy

        policy = get_policy(cfg, layout, reuse=True)
    return call.stage.run(cfg, layout, call.step, policy)


@contextmanager
def workspace_lock(layout: Layout) -> Iterator[None]:
    """The workspace's lock, exclusively: no stage, flow or other run works here meanwhile; in a
    DVC workspace also DVC's repository lock, so no `dvc repro` starts meanwhile."""
    from qerl_lib import locks

    try:
        # DVC's lock too, in a DVC workspace: `dvc repro` removes a stage's outputs before its
        # command could find this run's lock, so it must be refused before it starts.
        with locks.held(locks.workspace_lock_path(layout.root), True, f"pid {os.getpid()}"), \
                locks.dvc_repo_lock(layout.root, f"qerl run (pid {os.getpid()})"):
            yield
    except locks.Busy as e:
        raise WorkspaceBusy(
            f"workspace {layout.root} is in use by {e.holder}; wait for it to finish or use another run.root"
        ) from None


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


def trained(call: registry.Call, layout: Layout) -> bool:
    """Whether `call` is a rollout or reward of a step whose update is done: its outputs were
    consumed by that update, so the call is not run again even when they are gone."""
    return call.name in ("rollout", "reward") and layout.update_metrics(call.step).is_file()


def steps_trained(layout: Layout) -> int:
    """N: updates 0..N-1 are done (each `update.json` there) and adapter N exists, so the run
    continues at step N from adapter N and its optimizer state alone."""
    n = 0
    while layout.update_metrics(n).is_file():
        n += 1
    return n if (layout.adapter(n) / TRAINER_STATE).is_file() else 0


def resume_state(layout: Layout) -> list[Path]:
    """The files of a workspace from which `qerl run` continues it on another machine, where
    `prepare` and `convert` remake `data/` and `models/` (both deterministic; or they are placed
    there): the config, adapter N with its optimizer and trainer state (N = `steps_trained`), the
    metric files of steps 0..N-1 (they mark those steps done and feed the report), the
    evaluations of adapters 0..N and the stage times. Rollouts and scored rows, the bulk of a
    workspace, are left out: `trained` skips the steps that made them. Per-step files of step N
    and later are left out too, so the resumed run redoes that step whole. Sorted, existing."""
    n = steps_trained(layout)
    files = [layout.config, layout.stage_times, *sorted(layout.adapter(n).glob("*"))]
    for i in range(n):
        files += [layout.update_metrics(i), layout.reward_metrics(i), layout.rollout_provenance(i)]
    for k in range(n + 1):
        files += [layout.eval_metrics(k), layout.eval_provenance(k)]
    return sorted(f for f in files if f.is_file())


def run_all(cfg: QerlConfig, on_event: Callable[[str, registry.Call, dict], None] | None = None) -> list[dict]:
    """Run (or resume) the whole plan. Returns one timing record per executed call."""
    layout = Layout(cfg.run.root)
    records = []
    with workspace_lock(layout):
        check_config(cfg, layout)
        save_config(cfg, layout.config)
        for call in plan(cfg, layout):
            if call.name != "report" and (call.done_marker.exists() or trained(call, layout)):
                if on_event:
                    on_event("skip", call, {})
                continue
            if on_event:
                on_event("start", call, {})
            t0 = time.perf_counter()
            result = run_call(call, cfg, layout, reuse_policy=True)
            release_memory()  # the stage's freed tensors back to the OS before the next one starts
            rec = {"stage": call.name, "step": call.step, "seconds": round(time.perf_counter() - t0, 3)}
            records.append(rec)
            layout.stage_times.parent.mkdir(parents=True, exist_ok=True)
            with open(layout.stage_times, "a") as f:
                f.write(json.dumps(rec) + "\n")
            if on_event:
                on_event("done", call, {"seconds": rec["seconds"], "result": result})
    return records
