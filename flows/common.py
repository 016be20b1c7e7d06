"""What the three flows share: the workspace, its lock, params.yaml (checked before Prefect
starts, put back when a flow run fails), the stage list and running the stages; the artifacts
shown in the Prefect UI are made by `flows.artifacts` (re-exported here).

A workspace is a git + DVC repository holding `dvc.yaml` and `params.yaml` (the project's
repository root is one; the tests make temporary ones). Flows write params.yaml through
`qerl plan` (so its `plan` lists match `run.steps` / `eval.every`) and run DVC stages in
the order of `qerl_lib.run.plan`, one Prefect task per stage (`tasks.stage.run_stage`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

FLOW_LOCK = ".dvc/tmp/qerl-flow.lock"  # inside .dvc/tmp: ignored by git and by DVC


class WorkspaceError(RuntimeError):
    """The workspace cannot be used (not a DVC repository, busy, bad params)."""


# ----------------------------------------------------------------------------- workspace


def resolve_workspace(workspace: str | os.PathLike) -> Path:
    ws = Path(workspace).expanduser().resolve()
    if not ws.is_dir():
        raise WorkspaceError(f"workspace {ws} does not exist")
    missing = [name for name in ("dvc.yaml", ".dvc") if not (ws / name).exists()]
    if missing:
        raise WorkspaceError(
            f"workspace {ws} is not a qerl DVC workspace (no {', '.join(missing)}): use the qerl repository "
            "root, or make one with `git init && dvc init` and a copy of qerl's dvc.yaml"
        )
    return ws


@contextmanager
def flow_lock(ws: Path, label: str) -> Iterator[None]:
    """One flow per workspace, and no `qerl run` beside it.

    - an exclusive `flock` on `.dvc/tmp/qerl-flow.lock`: a second flow in the same workspace
      is refused at once, with the holder named;
    - a shared `flock` on `.qerl.lock` for the whole flow, the lock `qerl stage` shares and
      `qerl run` takes exclusively: a whole-run `qerl run` is refused while the flow runs
      (and the flow is refused while one runs).
    The kernel drops both when the holder dies (SIGKILL included): a killed flow never
    blocks the next one.
    """
    from qerl_lib import locks

    note = f"{label} (pid {os.getpid()})"
    try:
        fd = locks.acquire(ws / FLOW_LOCK, True, note)
    except locks.Busy as e:
        raise WorkspaceError(
            f"workspace {ws} is in use by {e.holder}: a second run was not started. Wait for it to finish "
            "(or kill it; running this again then resumes where it stopped), or use another workspace."
        ) from None
    try:
        try:
            run_fd = locks.acquire(locks.workspace_lock_path(ws), False, note)
        except locks.Busy as e:
            raise WorkspaceError(
                f"workspace {ws} is in use by {e.holder} (a whole `qerl run`): the flow was not started"
            ) from None
        try:
            yield
        finally:
            locks.release(run_fd)
    finally:
        locks.release(fd)


def _qerl() -> list[str]:
    return [sys.executable, "-m", "qerl_lib"]


def dump_value(value: Any) -> str:
    """A value for `--set key=VALUE` (parsed as YAML there; JSON is YAML)."""
    return json.dumps(value)


def flatten(tree: dict, prefix: str = "") -> list[str]:
    """{"rollout": {"group_size": 8}} -> ["rollout.group_size=8"]."""
    out = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out += flatten(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={dump_value(value)}")
    return out


def write_params(ws: Path, config: str | None, overrides: list[str] | None, settings: dict | None, log) -> Path:
    """Write `ws/params.yaml` with `qerl plan` from `config` (a YAML path, relative to the
    workspace; None or params.yaml itself: the current params.yaml), `overrides`
    (`section.key=value`) and `settings` (a nested dict, applied last). Returns its path."""
    cmd = [*_qerl(), "plan", "--params", "params.yaml"]
    if config:
        src = Path(config).expanduser()
        src = src if src.is_absolute() else ws / src
        if not src.is_file():
            raise WorkspaceError(f"config file not found: {src}")
        cmd += ["--config", str(src)]
    for pair in [*(overrides or []), *flatten(settings or {})]:
        cmd += ["--set", pair]
    from tasks.stage import stage_env

    out = subprocess.run(cmd, cwd=ws, env=stage_env(), capture_output=True, text=True, timeout=300)
    for line in (out.stdout + out.stderr).splitlines():
        if line.strip():
            log.info(line)
    if out.returncode != 0:
        why = (out.stderr.strip() or out.stdout.strip()).replace("qerl: error: ", "")
        raise WorkspaceError(f"qerl plan refused the config: {why}")
    return ws / "params.yaml"


def load_params(ws: Path):
    from qerl_lib.config import load_config

    return load_config(ws / "params.yaml")


_WATCHED: set[int] = set()


def watch_temporary_server() -> list[int]:
    """Tie the temporary Prefect server that this process started (no PREFECT_API_URL) to this
    process's life: Prefect stops it at exit, which a SIGKILL never reaches. One watchdog per
    server (`tasks/_guard.py --reap PID`) ends the server when this process dies. Returns the
    pids of the servers now watched (none with a real Prefect server)."""
    server_mod = sys.modules.get("prefect.server.api.server")
    instances = getattr(getattr(server_mod, "SubprocessASGIServer", None), "_instances", {}) if server_mod else {}
    pids = []
    for inst in list(instances.values()):
        proc = getattr(inst, "server_process", None)
        if proc is None or proc.poll() is not None:
            continue
        pids.append(proc.pid)
        if proc.pid in _WATCHED:
            continue
        guard = Path(__file__).resolve().parents[1] / "tasks" / "_guard.py"
        subprocess.Popen([sys.executable, str(guard), "--reap", str(proc.pid)], stdin=subprocess.DEVNULL,
                         env={**os.environ, "QERL_GUARD_PARENT": str(os.getpid())}, start_new_session=True)
        _WATCHED.add(proc.pid)
    return pids


def check_config(workspace: str | os.PathLike, config: str | None, overrides: list[str] | None,
                 settings: dict | None = None) -> None:
    """Validate (config, overrides, settings) as `qerl plan` will, in this process and before any
    Prefect flow run starts: a bad key or value is one `ConfigError` line (the CLI's message,
    with "did you mean" for a mistyped key), not a flow run's traceback. The workspace must be
    a qerl DVC workspace (`WorkspaceError` otherwise)."""
    import yaml

    from qerl_lib.config import ConfigError, _merge, load_config, parse_overrides, yaml_error

    ws = resolve_workspace(workspace)
    src = Path(config).expanduser() if config else ws / "params.yaml"
    src = src if src.is_absolute() else ws / src
    tree: dict = {}
    if config and not src.is_file():
        raise WorkspaceError(f"config file not found: {src}")
    if src.is_file():
        try:
            tree = yaml.safe_load(src.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {src} is not valid YAML: {yaml_error(e)}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {src} must hold a mapping at the top level")
    tree.pop("plan", None)  # `qerl plan` recomputes it
    extra = parse_overrides([*(overrides or []), *flatten(settings or {})])
    extra.setdefault("run", {})["root"] = "."  # as `qerl plan` writes it
    load_config(None, _merge(tree, extra))


def refuse_bad_config(name: str, workspace: str, config: str | None, overrides: list[str] | None) -> int | None:
    """A flow script's `main()` check before Prefect starts: on a bad config or workspace, print
    `NAME: <one line>` to stderr and return 2 (bad input, as the qerl CLI); None when it is valid."""
    from qerl_lib.config import ConfigError

    try:
        check_config(workspace, config, overrides)
    except (ConfigError, WorkspaceError) as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    return None


def restore_file(path: Path, before: bytes | None, log) -> bool:
    """Put `path` back to `before` (its bytes before this flow run; None: it did not exist), atomically.
    Returns whether anything changed."""
    from qerl_lib.io import atomic_path

    now_bytes = path.read_bytes() if path.is_file() else None
    if now_bytes == before:
        return False
    if before is None:
        path.unlink()
    else:
        with atomic_path(path) as tmp:
            tmp.write_bytes(before)
    log.warning("%s restored to what it was before this flow run (the run failed); run the flow again with "
                "the same settings to resume", path.name)
    return True


@contextmanager
def workspace_run(workspace: str, config: str | None, overrides: list[str] | None, settings: dict | None,
                  log) -> Iterator[tuple[Path, Any]]:
    """The preamble of every flow: the workspace resolved and locked for this flow run, its
    params.yaml written from (config, overrides, settings); yields (workspace, resolved config).

    A flow run that fails (an exception or a cancellation, here or in the body) leaves params.yaml
    as it found it: the workspace's config is the last one a flow run finished with, and a plain
    `dvc repro` there does not pick up half-tried settings. (A SIGKILL of the flow process leaves
    the new params.yaml: nothing runs after it.)"""
    from prefect.runtime import flow_run

    ws = resolve_workspace(workspace)
    watch_temporary_server()
    with flow_lock(ws, f"Prefect flow run {flow_run.name!r} ({flow_run.id})"):
        params = ws / "params.yaml"
        before = params.read_bytes() if params.is_file() else None
        try:
            write_params(ws, config, overrides, settings, log)
            yield ws, load_params(ws)
        except BaseException:
            restore_file(params, before, log)
            raise


def stage_list(cfg, ws: Path) -> list[str]:
    """DVC stage names in the order `qerl run` runs them (topological: `--single-item` runs
    no upstream stage, so the order carries the dependencies)."""
    from qerl_lib.paths import Layout
    from qerl_lib.run import plan

    return [call.label for call in plan(cfg, Layout(ws))]


def dvc_stage_names(ws: Path) -> set[str]:
    from tasks.stage import _sibling, stage_env

    out = subprocess.run([_sibling("dvc"), "stage", "list", "--name-only"], cwd=ws, env=stage_env(),
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise WorkspaceError(f"`dvc stage list` failed in {ws}: {(out.stderr or out.stdout).strip()[-800:]}")
    return {line.strip() for line in out.stdout.splitlines() if line.strip()}


def dvc_changed(ws: Path, log=None) -> set[str] | None:
    """Names of the stages `dvc status` reports as changed (None if it could not tell)."""
    from tasks.stage import _sibling, stage_env

    t0 = time.perf_counter()
    out = subprocess.run([_sibling("dvc"), "status", "--json"], cwd=ws, env=stage_env(), capture_output=True,
                         text=True, timeout=600)
    try:
        changed = set(json.loads(out.stdout or "{}")) if out.returncode == 0 else None
    except ValueError:
        changed = None
    if log is not None:
        log.info("dvc status: %s changed stage(s) (%.1fs)", "?" if changed is None else len(changed),
                 time.perf_counter() - t0)
    return changed


def check_stages(ws: Path, stages: list[str]) -> None:
    known = dvc_stage_names(ws)
    missing = [s for s in stages if s not in known]
    if missing:
        raise WorkspaceError(
            f"dvc.yaml of {ws} has no stage {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; "
            "is params.yaml's plan current (`qerl plan`) and dvc.yaml qerl's?"
        )


# ----------------------------------------------------------------------------- artifacts
# (flows/artifacts.py; the names stay importable from here)

from flows.artifacts import (  # noqa: E402,F401
    EVAL_TABLE_COLUMNS, STEP_CORE_COLUMNS, STEP_DETAIL_COLUMNS, STEP_TABLE_COLUMNS, curves_markdown, eval_rows,
    overhead_summary, png_data_uri, sparkline, step_artifact, step_rows, timing_markdown,
)


def now() -> float:
    return time.perf_counter()


# ----------------------------------------------------------------------------- running stages


def run_stages(ws: Path, stages: list[str], log, retries: int, progress_key: str, title: str,
               on_done=None, fast_skip: bool = True, before=None) -> list[dict]:
    """Run `stages` in order, one Prefect task each, with a progress artifact updated after
    every stage. `on_done(stage, record)` runs after each stage (artifacts). Returns the
    records; a failing stage fails the flow after the progress artifact says where.

    `fast_skip`: one `dvc status` first; the leading stages it reports unchanged are marked
    up to date without a `dvc repro` each (about 1 s apiece: on resuming a long run, most of
    the wait). From the first stage that DVC reports changed on, every stage goes through
    `dvc repro --single-item`, since a stage that runs can make later ones stale.
    `before(stage)` runs before each stage that goes to DVC (the rollout server starts there).
    """
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    from contextlib import nullcontext

    from tasks.gpu import gpu_slot
    from tasks.stage import is_gpu_stage, run_stage

    task = run_stage.with_options(retries=retries)
    n = len(stages)
    progress_id = create_progress_artifact(0.0, key=progress_key, description=f"{title}: 0/{n} stages")
    records: list[dict] = []
    changed = dvc_changed(ws, log) if fast_skip else None
    leading = changed is not None
    t_prev = time.perf_counter()
    for i, stage in enumerate(stages):
        if leading and stage not in changed and stage != "report":
            records.append({"stage": stage, "status": "skipped", "via": "dvc status", "task_s": None, "dvc_s": None,
                            "cmd_s": None, "work_s": None, "slot_wait_s": 0.0})
            continue
        if leading and i:
            log.info("%d leading stage(s) up to date per `dvc status` (%s ... %s): not run again",
                     i, stages[0], stages[i - 1])
            update_progress_artifact(progress_id, 100.0 * i / n, description=f"{title}: {i}/{n} stages up to date")
        leading = False
        if before is not None:
            before(stage)
        t0 = time.perf_counter()
        try:
            # GPU stages hold the qerl-gpu slot from here, around the task run (the task sees it
            # held and does not take it again): taken inside the task, the slot request races the
            # task run's own state writes in a SQLite-backed server and loses ~2 s to its retry.
            with (gpu_slot(log) if is_gpu_stage(stage) else nullcontext({"wait_s": 0.0})) as slot:
                rec = task(str(ws), stage, {"id": str(progress_id), "index": i, "total": n, "title": title})
            rec["slot_wait_s"] = slot["wait_s"]
        except BaseException as e:
            update_progress_artifact(progress_id, 100.0 * i / n,
                                     description=f"{title}: FAILED at {stage} ({type(e).__name__}) after {i}/{n} "
                                                 "stages; run the flow again to resume")
            raise
        t_end = time.perf_counter()
        rec["task_s"] = round(t_end - t0, 3)
        rec["gap_s"] = round(t0 - t_prev, 3)  # flow-side work since the previous stage (artifacts, ...)
        records.append(rec)
        done = sum(r["status"] == "ran" for r in records)
        update_progress_artifact(progress_id, 100.0 * (i + 1) / n,
                                 description=f"{title}: {i + 1}/{n} stages ({done} ran, {i + 1 - done} up to date); "
                                             f"last {stage}")
        if on_done is not None:
            on_done(stage, rec)
        t_prev = t_end
    return records
