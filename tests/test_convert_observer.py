"""`model.nvfp4_observer`: the convert stage's choice of llm-compressor weight observer for the NVFP4
group scales. The same checkpoint format either way; the MSE searches change codes and scales, and
on the tiny model they lower the quantization error that the report measures with our own
dequantization."""

from __future__ import annotations

import json
from pathlib import Path

from qerl_lib.convert import DEFAULT_OBSERVER, convert, nvfp4_recipe


def test_recipe_names_the_observer():
    assert nvfp4_recipe().scheme == "NVFP4A16"  # the default is llm-compressor's preset, unchanged
    mod = nvfp4_recipe("nvfp4_expanded_mse")
    (group,) = mod.config_groups.values()
    assert group.weights.observer == "nvfp4_expanded_mse" and group.weights.group_size == 16
    assert group.weights.num_bits == 4 and group.targets == ["Linear"] and mod.ignore == ["lm_head"]


def test_mse_observers_write_the_same_format_with_less_error(tiny_llama_dir: Path, tmp_path: Path):
    reports = {}
    for obs in (DEFAULT_OBSERVER, "memoryless_mse", "nvfp4_expanded_mse"):
        out = tmp_path / obs
        reports[obs] = convert(tiny_llama_dir, out, "nvfp4", obs)
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        assert qc["format"] == "nvfp4-pack-quantized"
        weights = next(iter(qc["config_groups"].values()))["weights"]
        assert weights["observer"] in (obs, None if obs == DEFAULT_OBSERVER else obs)
        assert reports[obs]["recipe"]["observer"] == obs and reports[obs]["layers"] == 14
    base = reports[DEFAULT_OBSERVER]
    for obs in ("memoryless_mse", "nvfp4_expanded_mse"):
        r = reports[obs]
        assert r["checkpoint_hash"] != base["checkpoint_hash"]
        assert r["rel_error_mean"] < base["rel_error_mean"], (obs, r["rel_error_mean"], base["rel_error_mean"])


def test_observer_error_benchmark_on_some_layers(tiny_llama_dir: Path, tmp_path: Path):
    """benchmarks/nvfp4_observer_error.py quantizes only the named layers' linears, through `convert`'s recipe."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import nvfp4_observer_error as B

    out = tmp_path / "e.json"
    assert B.main(["--base", str(tiny_llama_dir), "--layers", "1", "--observers", "memoryless_minmax,memoryless_mse",
                   "--out", str(out)]) == 0
    res = json.loads(out.read_text())["observers"]
    for r in res.values():
        assert r["linears"] == 7 and all(".layers.1." in k for k in r["rel_error"])
    assert res["memoryless_minmax"]["mean_over_minmax"] == 1.0 and res["memoryless_mse"]["mean_over_minmax"] < 1.0
