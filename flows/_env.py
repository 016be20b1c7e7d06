"""Process environment for the flows, set before Prefect is imported (it reads its
settings once, at import time). Standard library only.

- telemetry off: DO_NOT_TRACK=1, PREFECT_SERVER_ANALYTICS_ENABLED=false, DVC_NO_ANALYTICS=1,
  VLLM_NO_USAGE_STATS=1, HF_HUB_DISABLE_TELEMETRY=1;
- PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120: with no Prefect server configured,
  a flow starts a temporary one, which on a fresh database takes longer than Prefect's
  default 20 s on two cores (about 16 s measured here with a warm disk; more when cold).

Values already set in the environment win.
"""

from __future__ import annotations

import os

DEFAULTS = {
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DVC_NO_ANALYTICS": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}


def setup_env() -> None:
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)


setup_env()
