"""convert: base model (hub id, HF directory, GGUF file or a packaged model) -> `models/base/`
(plain HF copy) and `models/<quant>/` (NVFP4A16 through llm-compressor, or BF16) with
`convert_report.json` (bytes before / after, quantization error, checkpoint hash)."""

from __future__ import annotations

import time

from qerl_lib.config import QerlConfig
from qerl_lib.paths import Layout


def convert_stage(cfg: QerlConfig, layout: Layout) -> dict:
    from qerl_lib.convert import convert
    from qerl_lib.model import materialize_base

    t0 = time.perf_counter()
    source_marker = f"{cfg.model.base}\n{cfg.model.gguf_file or ''}\n"
    marker = layout.base_model / "SOURCE"
    if not (marker.is_file() and marker.read_text() == source_marker):
        materialize_base(cfg.model.base, cfg.model.gguf_file, layout.base_model)
    t1 = time.perf_counter()
    report = convert(layout.base_model, layout.checkpoint(cfg.model.quant), cfg.model.quant)
    report["seconds_materialize"] = round(t1 - t0, 3)
    report["seconds_convert"] = round(time.perf_counter() - t1, 3)
    return report
