"""convert: base model (hub id, HF directory, GGUF file or a packaged model) -> `models/base/`
(plain HF copy) and `models/<quant>/` (NVFP4A16 through llm-compressor, or BF16) with
`convert_report.json` (bytes before / after, quantization error, checkpoint hash)."""

from __future__ import annotations

import time

from qerl_lib.config import QerlConfig
from qerl_lib.paths import Layout


def convert_stage(cfg: QerlConfig, layout: Layout) -> dict:
    from qerl_lib.convert import convert
    from qerl_lib.model import base_is_materialized, materialize_base

    t0 = time.perf_counter()
    # A workspace may start with models/base already in place (scripts/device_experiment.sh hard-links one
    # copy into each quantization's workspace): the GGUF -> BF16 copy is most of a convert stage's time.
    if not base_is_materialized(cfg.model.base, cfg.model.gguf_file, layout.base_model):
        materialize_base(cfg.model.base, cfg.model.gguf_file, layout.base_model)
    t1 = time.perf_counter()
    report = convert(layout.base_model, layout.checkpoint(cfg.model.quant), cfg.model.quant, cfg.model.nvfp4_observer)
    report["seconds_materialize"] = round(t1 - t0, 3)
    report["seconds_convert"] = round(time.perf_counter() - t1, 3)
    return report
