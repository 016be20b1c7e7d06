"""What several stages stamp on their outputs: file-level lineage metadata of the Parquet files
(base model, quantization, checkpoint hash, library versions, git commit, config hash) and the
provenance sidecar (seconds, flow run, host). Pure bookkeeping: no output byte of a stage's
computation depends on it except the Parquet metadata itself."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

from qerl_lib.config import QerlConfig, config_hash
from qerl_lib.io import read_json
from qerl_lib.paths import Layout

QUANT_SCHEMES = {"nvfp4": "NVFP4A16", "bf16": "BF16", "nf4": "NF4 (bitsandbytes, double quant)"}
"""`model.quant` -> the `quant_scheme` stamped on every Parquet file."""


def git_commit() -> str:
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "."], cwd=here.parents[1],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha or "unknown") + ("-dirty" if dirty else "")


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "peft", "vllm"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = ""
    return out


def policy_for(cfg: QerlConfig, layout: Layout, policy=None):
    """The policy a stage trains: `policy` when the caller holds one (`qerl run` keeps it loaded
    across stages), else a new one."""
    from qerl_lib.policy import get_policy

    return policy if policy is not None else get_policy(cfg, layout, reuse=False)


def sampler_for(cfg: QerlConfig, layout: Layout, policy=None):
    """The policy a rollout or eval stage samples from: the workspace's rollout server when one
    runs (`qerl_lib.rollout.service.find_server`; no model is loaded here then), else the
    in-process policy of `policy_for`."""
    from qerl_lib.rollout.client import remote_policy

    remote = remote_policy(cfg, layout)
    return remote if remote is not None else policy_for(cfg, layout, policy)


def file_metadata(cfg: QerlConfig, layout: Layout, kind: str) -> dict[str, str]:
    report_path = layout.convert_report(cfg.model.quant)
    ckpt_hash = read_json(report_path)["checkpoint_hash"] if report_path.is_file() else ""
    return {
        "kind": kind,
        "base_model": cfg.model.base,
        "quant_scheme": QUANT_SCHEMES[cfg.model.quant],
        "checkpoint_hash": ckpt_hash,
        **versions(),
        "git_commit": git_commit(),
        "config_hash": config_hash(cfg),
    }


def provenance(seconds: float, **extra) -> dict:
    return {
        "seconds": round(seconds, 3),
        "flow_run_id": os.environ.get("PREFECT__FLOW_RUN_ID") or os.environ.get("QERL_FLOW_RUN_ID", ""),
        "host": platform.node(),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **extra,
    }
