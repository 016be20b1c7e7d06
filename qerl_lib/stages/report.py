"""report: every step's metrics -> `reports/metrics.json`, `steps.csv`, `eval.csv`, the plots
(`qerl_lib.report`) and a copy of the config."""

from __future__ import annotations

from qerl_lib.config import QerlConfig, save_config
from qerl_lib.paths import Layout


def report_stage(cfg: QerlConfig, layout: Layout) -> dict:
    from qerl_lib.report import aggregate

    save_config(cfg, layout.reports_dir / "config.yaml")
    return aggregate(layout, cfg.run.steps)
