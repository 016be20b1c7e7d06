"""The one process environment every qerl door sets before it starts a tool (standard library
only: the flows import it before Prefect reads its settings).

- telemetry off: DO_NOT_TRACK, Prefect analytics, DVC analytics, vLLM usage stats, HF telemetry;
- TOKENIZERS_PARALLELISM=false: the Rust tokenizer's threads would otherwise warn after a fork;
- MKL_CBWR=AUTO,STRICT: MKL's default kernels may round differently with the memory alignment of
  a buffer, which differs between processes; strict CNR mode makes CPU stages repeat to the bit.

Values already set in the environment win.
"""

from __future__ import annotations

import os

TELEMETRY_OFF = {
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DVC_NO_ANALYTICS": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}
"""Every tool's switch for usage reporting, off."""
PROCESS_DEFAULTS = {**TELEMETRY_OFF, "TOKENIZERS_PARALLELISM": "false", "MKL_CBWR": "AUTO,STRICT"}
"""What a qerl process (CLI, stage, server) sets for itself and its children."""


def setup(extra: dict[str, str] | None = None) -> None:
    """Set `PROCESS_DEFAULTS` (and `extra`) where the environment does not already say otherwise."""
    for key, value in {**PROCESS_DEFAULTS, **(extra or {})}.items():
        os.environ.setdefault(key, value)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with the defaults filled in, for a child process."""
    env = dict(os.environ)
    for key, value in PROCESS_DEFAULTS.items():
        env.setdefault(key, value)
    env.update(extra or {})
    return env


def release_memory() -> None:
    """Give freed heap memory back to the operating system: a garbage collection, then glibc's
    `malloc_trim(0)` (a no-op elsewhere).

    glibc keeps the pages of freed blocks that lie below its (dynamic) mmap threshold; the large
    tensors a stage frees at its end (the dense inference cache of a rollout, the activations of an
    update, llm-compressor's model copy) then stay resident and the next stage's peak comes on top.
    `qerl run` calls this between stages (`qerl_lib.run.run_all`)."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
