"""prepare: dataset source -> `data/prepared/{train,test}.parquet` with stable `prompt_id`s
(`qerl_lib.data.prepare`)."""

from __future__ import annotations

from qerl_lib.config import QerlConfig
from qerl_lib.paths import Layout


def prepare_stage(cfg: QerlConfig, layout: Layout) -> dict:
    from qerl_lib.data import prepare

    return prepare(cfg.data, cfg.run.seed, layout.prepared_dir)
