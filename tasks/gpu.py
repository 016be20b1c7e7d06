"""The `qerl-gpu` slot: a Prefect global concurrency limit held around every GPU stage.

GPU stages (convert, rollout, update, eval) run inside `gpu_slot()`, which takes one slot
of the global concurrency limit `qerl-gpu` (created with limit 1 the first time it is
missing; raise it for a machine with more GPUs: `prefect gcl update qerl-gpu --limit 2`).
Two GPU stages, of this run or of any other flow run talking to the same Prefect API,
therefore never share the device unplanned. CPU stages (prepare, init_adapter, reward,
report) take no slot.

Slots are leases (Prefect 3): the holder renews its lease while the stage runs, and a
Prefect server (`prefect server start`) takes back the slot of a holder that was killed
once its lease expires (`LEASE_SECONDS`, the least the API accepts).

The ephemeral server (no `PREFECT_API_URL`) runs no such service and keeps leases in the
memory of a server process that dies with its flow, so a flow killed by SIGKILL while it
held the slot would leave it occupied in the shared SQLite database forever and every
later GPU stage would wait for it. In that mode (or with `QERL_GPU_RECLAIM=1`) the
slot is taken under a host-wide file lock: a holder also holds a shared `flock` on
`$PREFECT_HOME/qerl/gpu.holders` (the kernel drops it when the holder dies), and a waiter
that finds the slot taken while no live process on this host holds that lock releases
the orphaned slots (`active_slots` reset) and logs that it did. The ephemeral database
is local to the host, so "no live holder on this host" means "no live holder".

`QERL_GPU_SLOT_TIMEOUT` (seconds; unset = wait as long as it takes) bounds the wait; past
it the stage fails with `GpuBusy` (and is retried by the task's policy).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

GPU_LIMIT = "qerl-gpu"
LEASE_SECONDS = 60  # the API refuses leases shorter than 60 s
POLL_SECONDS = 2.0

_known_limits: set[tuple[str, str]] = set()
_held = threading.local()  # slots this thread holds: gpu_slot() is re-entrant per thread


class GpuBusy(TimeoutError):
    """The GPU slot was not free within QERL_GPU_SLOT_TIMEOUT seconds."""


def _api_key() -> str:
    from prefect.settings import get_current_settings

    return str(get_current_settings().api.url or "ephemeral")


def reclaim_mode() -> bool:
    """True where orphaned slots must be reclaimed by the clients themselves."""
    from prefect.settings import get_current_settings

    return os.environ.get("QERL_GPU_RECLAIM") == "1" or not get_current_settings().api.url


def ensure_gpu_limit(name: str = GPU_LIMIT, limit: int = 1, log: logging.Logger | None = None) -> dict:
    """Create the global concurrency limit `name` (with `limit` slots) if it does not exist.

    An existing limit is left as it is (an operator may have raised it). Returns its
    name, limit and active slots as the API reports them.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            found = client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=limit))
                if log:
                    log.info("created global concurrency limit %r with %d slot(s)", name, limit)
            except ObjectAlreadyExists:
                pass
            found = client.read_global_concurrency_limit_by_name(name)
    _known_limits.add((_api_key(), name))
    return {"name": found.name, "limit": found.limit, "active_slots": found.active_slots}


def _lock_dir() -> Path:
    from prefect.settings import get_current_settings

    d = Path(get_current_settings().home) / "qerl"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _reclaim_orphaned(name: str, holders_path: Path, log: logging.Logger) -> int:
    """Release the slots of `name` when no live process on this host holds one. Call with
    the host mutex held. Returns the number of slots released."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate

    fd = os.open(holders_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0  # a live holder: the slot is really in use
        with get_client(sync_client=True) as client:
            found = client.read_global_concurrency_limit_by_name(name)
            if found.active_slots <= 0:
                return 0
            client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(active_slots=0))
        log.warning(
            "released %d slot(s) of %r held by a run that was killed (no live process on this host "
            "holds one; the ephemeral Prefect server cannot expire leases)", found.active_slots, name,
        )
        return found.active_slots
    finally:
        os.close(fd)


@contextmanager
def gpu_slot(log: logging.Logger, name: str = GPU_LIMIT, timeout: float | None = None) -> Iterator[dict]:
    """Hold one slot of the global concurrency limit `name` for the body.

    Yields a dict with the limit name and `wait_s`, the seconds spent waiting for the slot.
    """
    from prefect.concurrency._asyncio import AcquireConcurrencySlotTimeoutError
    from prefect.concurrency.sync import concurrency

    depth = getattr(_held, name.replace("-", "_"), 0)
    if depth:  # already held by this thread (a flow holds it around the task call)
        setattr(_held, name.replace("-", "_"), depth + 1)
        try:
            yield {"limit": name, "wait_s": 0.0, "held_by_caller": True}
        finally:
            setattr(_held, name.replace("-", "_"), depth)
        return
    if timeout is None and os.environ.get("QERL_GPU_SLOT_TIMEOUT"):
        timeout = float(os.environ["QERL_GPU_SLOT_TIMEOUT"])
    if (_api_key(), name) not in _known_limits:
        ensure_gpu_limit(name, log=log)
    t0 = time.monotonic()
    busy = GpuBusy(f"GPU slot {name!r} not free within {timeout or 0:.0f}s (QERL_GPU_SLOT_TIMEOUT); "
                   f"see `prefect gcl inspect {name}`")
    stack = ExitStack()
    try:
        if not reclaim_mode():
            try:
                stack.enter_context(concurrency(name, occupy=1, timeout_seconds=timeout,
                                                lease_duration=LEASE_SECONDS, strict=True))
            except AcquireConcurrencySlotTimeoutError as e:
                raise busy from e
        else:
            _acquire_with_reclaim(stack, name, timeout, t0, busy, log)
        info = {"limit": name, "wait_s": round(time.monotonic() - t0, 3)}
        log.info("holding GPU slot %r (waited %.1fs)", name, info["wait_s"])
        setattr(_held, name.replace("-", "_"), 1)
        try:
            yield info
        finally:
            setattr(_held, name.replace("-", "_"), 0)
    finally:
        stack.close()  # releases the slot, then the host-side holder mark (see _acquire_with_reclaim)


def _acquire_with_reclaim(stack: ExitStack, name: str, timeout: float | None, t0: float, busy: GpuBusy,
                          log: logging.Logger) -> None:
    """Take the slot under the host mutex, reclaiming orphaned slots first (ephemeral mode).

    On success the shared holder lock is registered on `stack` before the slot itself, so
    closing the stack gives the slot back first and drops the holder mark after it.
    """
    from prefect.concurrency._asyncio import AcquireConcurrencySlotTimeoutError
    from prefect.concurrency.sync import concurrency

    lock_dir = _lock_dir()
    holders = lock_dir / "gpu.holders"
    mutex_fd = os.open(lock_dir / "gpu.mutex", os.O_RDWR | os.O_CREAT, 0o644)
    holder_fd = os.open(holders, os.O_RDWR | os.O_CREAT, 0o644)
    stack.callback(os.close, holder_fd)
    said_waiting = False
    try:
        while True:
            fcntl.flock(mutex_fd, fcntl.LOCK_EX)
            try:
                _reclaim_orphaned(name, holders, log)
                try:
                    stack.enter_context(concurrency(name, occupy=1, timeout_seconds=POLL_SECONDS,
                                                    lease_duration=LEASE_SECONDS, strict=True))
                except AcquireConcurrencySlotTimeoutError:
                    pass
                else:
                    fcntl.flock(holder_fd, fcntl.LOCK_SH)
                    return
            finally:
                fcntl.flock(mutex_fd, fcntl.LOCK_UN)
            if not said_waiting:
                log.info("waiting for GPU slot %r (another GPU stage holds it)", name)
                said_waiting = True
            if timeout is not None and time.monotonic() - t0 > timeout:
                raise busy
            time.sleep(POLL_SECONDS)
    finally:
        os.close(mutex_fd)
