"""Process environment for the flows, set before Prefect is imported (it reads its settings
once, at import time): `qerl_lib.env`'s defaults (telemetry off, ...) and
PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120: with no Prefect server configured, a flow
starts a temporary one, which on a fresh database takes longer than Prefect's default 20 s on
two cores (about 16 s measured here with a warm disk; more when cold).

Values already set in the environment win.
"""

from __future__ import annotations

from qerl_lib import env

env.setup({"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"})
