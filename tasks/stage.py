"""The one Prefect task: run one DVC stage of a qerl workspace.

    run_stage(workspace, "rollout@3")  ->  dvc repro --single-item rollout@3   (in workspace)

The task runs exactly the entry that `dvc repro` uses (dvc.yaml's `qerl stage ...`
command, through DVC), so both doors give the same bytes, and DVC alone decides whether
the stage is up to date (it prints "didn't change, skipping" and returns at once). The
task keeps no cache and persists no result of its own (`NO_CACHE`, `persist_result=False`):
there is one cache, DVC's.

Failures:
- the qerl CLI exits 2 on bad input (unknown config key, missing or malformed file): the
  task raises `StageInputError` and is NOT retried (running it again cannot help);
- DVC refusing the stage for a reason that a retry cannot change (missing dependency,
  unknown stage) is a `StageInputError` too;
- anything else (a crash, an out-of-memory kill, a busy DVC lock, the GPU slot not free
  in time) is a `StageFailed` / `GpuBusy` and is retried with exponential backoff
  (`RETRIES` times, `BACKOFF_SECONDS` * 2**n, with jitter).

GPU stages (convert, rollout, update, eval) hold a slot of the `qerl-gpu` global
concurrency limit while they run (`tasks.gpu`).

The stage's output (DVC's and the stage's own) streams line by line into the task run's
log, so the Prefect UI shows, per stage, what ran and what it printed. The stage's heartbeat
lines (`qerl-progress LABEL: done/total unit (p%), s elapsed, ETA s`, `qerl_lib.progress`) also
move the flow's progress artifact while the stage runs (`ArtifactProgress`, at most every 5 s). The command runs
under a small guard (`tasks/_guard.py`) that kills the stage's whole process tree when the
flow process dies, even by SIGKILL.

The task returns a timing record (seconds of the task's phases, used to measure the
orchestration overhead): `dvc_s` (the `dvc repro` process), `cmd_s` (the stage's own
command as seen from DVC's output), `work_s` (the seconds the stage logged in its own
metrics / provenance file, where it does), `slot_wait_s`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from tasks.gpu import GpuBusy, gpu_slot

from qerl_lib.paths import Layout  # noqa: E402
from qerl_lib.progress import parse_heartbeat  # noqa: E402  (light: no torch)
from qerl_lib.stages import registry  # noqa: E402  (light: paths only)

GPU_STAGES = frozenset(s.name for s in registry.STAGES if s.gpu)
RETRIES = 2
BACKOFF_SECONDS = 10.0
INPUT_ERROR_EXIT = 2  # the qerl CLI's exit status for bad input

from qerl_lib.env import TELEMETRY_OFF  # noqa: E402  (re-exported)

# DVC refusals that a retry cannot change.
_DVC_INPUT_ERRORS = (
    re.compile(r"missing (data source|dependencies|deps)", re.I),
    re.compile(r"does not (exist|contain)", re.I),
    re.compile(r"is not a (valid|known)", re.I),
    re.compile(r"'dvc\.yaml' (validation|is invalid)|failed to parse", re.I),
    re.compile(r"not a (git|dvc) repository|you are not inside of a DVC repository", re.I),
)
_EXITED = re.compile(r"exited with (-?\d+)")
_GUARD = str(Path(__file__).with_name("_guard.py"))


class StageFailed(RuntimeError):
    """A stage failed for a reason that may pass (retried)."""

    def __init__(self, stage: str, message: str, returncode: int | None = None, cmd_returncode: int | None = None):
        super().__init__(message)
        self.stage = stage
        self.returncode = returncode
        self.cmd_returncode = cmd_returncode


class StageInputError(StageFailed):
    """A stage failed on its input (qerl exit 2, or DVC refused the stage): not retried."""


def telemetry_off() -> None:
    for key, value in TELEMETRY_OFF.items():
        os.environ.setdefault(key, value)


def base_name(stage: str) -> str:
    return stage.split("@", 1)[0]


def is_gpu_stage(stage: str) -> bool:
    return base_name(stage) in GPU_STAGES


def retry_transient(task, task_run, state) -> bool:
    """`retry_condition_fn`: retry unless the failure was deterministic (bad input)."""
    try:
        state.result(raise_on_failure=True)
    except StageInputError:
        return False
    except Exception:
        return True
    return True


def _set_parent_death_signal() -> None:  # runs in the child between fork and exec
    # The guard leaves the flow's process group: a SIGKILL of that group must not take the
    # guard with it, or nobody is left to end the stage (tasks/_guard.py).
    os.setpgid(0, 0)
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: the guard checks its parent pid instead
        pass


def _flow_run_id() -> str:
    try:
        from prefect.runtime import flow_run

        return str(flow_run.id or "")
    except Exception:
        return ""


def stage_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    for key, value in TELEMETRY_OFF.items():
        env.setdefault(key, value)
    # `qerl` and `dvc` of this environment, even when it was not activated
    bindir = str(Path(sys.executable).parent)
    if bindir not in env.get("PATH", "").split(os.pathsep):
        env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    env["PYTHONUNBUFFERED"] = "1"  # DVC's and the stage's lines arrive as they are printed
    env["QERL_FLOW_RUN_ID"] = _flow_run_id()
    env["QERL_GUARD_PARENT"] = str(os.getpid())
    env.update(extra or {})
    return env


def classify(stage: str, returncode: int, lines: list[str]) -> StageFailed:
    """The exception for a failed `dvc repro`: input error (no retry) or transient."""
    text = "\n".join(lines)
    m = None
    for m in _EXITED.finditer(text):
        pass
    cmd_rc = int(m.group(1)) if m else None
    tail = "\n".join(lines[-15:])
    if cmd_rc == INPUT_ERROR_EXIT:
        why = _qerl_error(lines) or "bad input"
        return StageInputError(stage, f"{stage}: input error (qerl exited 2, not retried): {why}", returncode, cmd_rc)
    if cmd_rc is None and any(p.search(text) for p in _DVC_INPUT_ERRORS):
        errs = [ln for ln in lines if ln.startswith("ERROR")] or lines[-3:]
        return StageInputError(stage, f"{stage}: DVC refused the stage (not retried): {' '.join(errs)[:800]}",
                               returncode)
    what = f"command exited with {cmd_rc}" if cmd_rc is not None else f"dvc exited with {returncode}"
    return StageFailed(stage, f"{stage}: {what}; last lines:\n{tail}", returncode, cmd_rc)


def _qerl_error(lines: list[str]) -> str:
    """The qerl CLI's error message: its `qerl: error:` line and the indented lines after it."""
    idx = [i for i, ln in enumerate(lines) if "qerl: error:" in ln]
    if not idx:
        return ""
    i = idx[-1]
    parts = [lines[i].split("qerl: error:", 1)[1].strip()]
    for ln in lines[i + 1:i + 8]:
        if not ln.startswith((" ", "\t")):
            break
        parts.append(ln.strip())
    return " ".join(p for p in parts if p)


def work_seconds(workspace: Path, stage: str) -> float | None:
    """Seconds the stage measured for its own work, from the file it writes them to
    (the registry's `seconds_file`; convert: its report's materialize + convert seconds)."""
    st, step = registry.parse_label(stage)
    lay = Layout(Path(workspace))
    for p in st.seconds_file(lay, "", step) if st.seconds_file else []:
        try:
            value = json.loads(p.read_text()).get("seconds")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, (int, float)):
            return float(value)
    if st.name == "convert":
        for p in sorted(lay.root.glob(f"{lay.checkpoint('*').relative_to(lay.root)}/convert_report.json")):
            try:
                rep = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            parts = [rep.get(k) for k in ("seconds_materialize", "seconds_convert")]
            if all(isinstance(v, (int, float)) for v in parts):
                return float(sum(parts))
    return None


DVC_HINTS = ("To track the changes with git, run:", "git add ", "To enable auto staging, run:",
             "dvc config core.autostage true", "Use `dvc push` to send your updates to remote storage.")
"""Starts of the lines `dvc repro` ends with for a person at a terminal: logged at DEBUG (every
stage would repeat them; the flow neither stages files in git nor pushes)."""


def run_dvc_stage(workspace: str | Path, stage: str, log, dvc: str | None = None,
                  extra_env: dict[str, str] | None = None, on_progress=None) -> dict:
    """`dvc repro --single-item STAGE` in `workspace`, its output streamed into `log`; each of the
    stage's heartbeat lines (`qerl_lib.progress`) also goes, parsed, to `on_progress(fields)`.

    Returns the timing record; raises `StageInputError` / `StageFailed` on failure.
    """
    workspace = Path(workspace).resolve()
    dvc = dvc or os.environ.get("QERL_DVC") or _sibling("dvc")
    cmd = [sys.executable, _GUARD, "--", dvc, "repro", "--single-item", stage]
    t0 = time.perf_counter()
    t_cmd0 = t_cmd1 = None
    status = "unknown"
    lines: deque[str] = deque(maxlen=400)
    after_running = False
    proc = subprocess.Popen(cmd, cwd=workspace, env=stage_env(extra_env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, errors="replace",
                            bufsize=1, preexec_fn=_set_parent_death_signal)
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            now = time.perf_counter()
            line = raw.rstrip("\n").rstrip("\r")
            if not line.strip():
                continue
            lines.append(line)
            if line.startswith("Running stage"):
                status = "ran"
                after_running = True
            elif after_running and line.startswith("> ") and t_cmd0 is None:
                t_cmd0 = now
            elif t_cmd0 is not None and t_cmd1 is None and (
                    line.startswith(("Updating lock file", "Generating lock file", "ERROR: failed to reproduce"))):
                t_cmd1 = now
            elif "didn't change, skipping" in line:
                status = "skipped"
            elif "is cached - skipping run" in line:
                status = "restored"
            elif on_progress is not None and (hb := parse_heartbeat(line)) is not None:
                on_progress(hb)
            if line.strip().startswith(DVC_HINTS):
                log.debug(line)  # DVC's advice to the person at a terminal (git add, autostage, dvc push)
            elif line.startswith("ERROR"):
                log.error(line)
            elif line.startswith("WARNING"):
                log.warning(line)
            else:
                log.info(line)
        rc = proc.wait()
    except BaseException:
        proc.terminate()  # the guard kills the stage's process tree
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    dvc_s = time.perf_counter() - t0
    if rc != 0:
        raise classify(stage, rc, list(lines))
    record = {
        "stage": stage,
        "status": status,
        "dvc_s": round(dvc_s, 3),
        "cmd_s": round(t_cmd1 - t_cmd0, 3) if (t_cmd0 is not None and t_cmd1 is not None) else None,
        "work_s": work_seconds(workspace, stage) if status == "ran" else None,
    }
    return record


PROGRESS_MIN_SECONDS = 5.0
"""Least seconds between two updates of the flow's progress artifact from inside one stage (the
stage's heartbeat lines come every 20 s or so; the start and end lines may come in a burst)."""


def progress_within(hb: dict, index: int, total: int, title: str) -> tuple[float, str]:
    """(percent, description) of the flow's progress artifact while stage number `index` (0-based) of
    `total` reports the heartbeat `hb` (`qerl_lib.progress.parse_heartbeat`): the finished stages plus
    the stage's own share, and its counts and ETA in words."""
    share = min(max(hb["percent"], 0), 100) / 100.0
    eta = "?" if hb["eta"] is None else f"{hb['eta']} s"
    return (100.0 * (index + share) / max(total, 1),
            f"{title}: {index}/{total} stages done; {hb['label']} {hb['done']}/{hb['total']} {hb['unit']} "
            f"({hb['percent']}%), {hb['elapsed']} s elapsed, ETA {eta}")


class ArtifactProgress:
    """Moves the flow's progress artifact from a running stage's heartbeat lines, at most once per
    `min_seconds` (the last line of a burst is kept for the next allowed update). `update(percent,
    description)` is `prefect.artifacts.update_progress_artifact` bound to the artifact; `clock` is
    injectable for tests."""

    def __init__(self, update, index: int, total: int, title: str, min_seconds: float = PROGRESS_MIN_SECONDS,
                 clock=time.monotonic):
        self.update, self.index, self.total, self.title = update, index, total, title
        self.min_seconds, self.clock = min_seconds, clock
        self._last: float | None = None
        self.updates = 0

    def __call__(self, hb: dict) -> bool:
        now = self.clock()
        if self._last is not None and now - self._last < self.min_seconds:
            return False
        self._last = now
        try:
            self.update(*progress_within(hb, self.index, self.total, self.title))
        except Exception:  # the artifact is a view: never fail the stage for it
            return False
        self.updates += 1
        return True


def _sibling(exe: str) -> str:
    """`exe` beside the running interpreter (the same virtual environment), else on PATH."""
    cand = Path(sys.executable).with_name(exe)
    return str(cand) if cand.exists() else exe


@task(
    name="qerl-stage",
    task_run_name="{stage}",
    description="One qerl stage through `dvc repro --single-item` (DVC decides whether it runs).",
    retries=RETRIES,
    retry_delay_seconds=exponential_backoff(backoff_factor=BACKOFF_SECONDS),
    retry_jitter_factor=0.5,
    retry_condition_fn=retry_transient,
    cache_policy=NO_CACHE,
    persist_result=False,
)
def run_stage(workspace: str, stage: str, progress: dict | None = None) -> dict:
    """Run one DVC stage of `workspace` (a git + DVC repository holding dvc.yaml / params.yaml).

    `progress`: {"id": the flow's progress artifact id, "index": this stage's 0-based position,
    "total": stages in the flow, "title": the artifact's title}; the stage's heartbeat lines then
    move that artifact while the stage runs (`ArtifactProgress`)."""
    log = get_run_logger()
    t0 = time.perf_counter()
    on_progress = None
    if progress:
        from prefect.artifacts import update_progress_artifact

        def update(percent: float, description: str) -> None:
            update_progress_artifact(progress["id"], percent, description=description)

        on_progress = ArtifactProgress(update, int(progress["index"]), int(progress["total"]), str(progress["title"]))
    if is_gpu_stage(stage):
        with gpu_slot(log) as slot:  # a no-op when the calling flow holds it already
            record = run_dvc_stage(workspace, stage, log, on_progress=on_progress)
        record["slot_wait_s"] = slot["wait_s"]
        record["gpu_slot"] = slot["limit"]
    else:
        record = run_dvc_stage(workspace, stage, log, on_progress=on_progress)
        record["slot_wait_s"] = 0.0
        record["gpu_slot"] = None
    record["task_body_s"] = round(time.perf_counter() - t0, 3)
    how = {"ran": "ran", "skipped": "up to date (DVC skipped it)", "restored": "restored from DVC's run cache"}
    log.info("%s: %s in %.1fs%s", stage, how.get(record["status"], record["status"]), record["dvc_s"],
             f" (stage's own work {record['work_s']:.1f}s)" if record.get("work_s") is not None else "")
    return record


__all__ = ["run_stage", "run_dvc_stage", "StageFailed", "StageInputError", "GpuBusy", "GPU_STAGES",
           "is_gpu_stage", "telemetry_off", "retry_transient", "classify", "work_seconds", "ArtifactProgress",
           "progress_within"]
