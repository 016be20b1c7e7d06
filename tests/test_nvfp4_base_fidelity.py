"""benchmarks/nvfp4_base_fidelity.py on the tiny model: the 16-bit model against itself is at KL 0 with full
top-1 agreement, its NVFP4 conversion is not, and bad input names the file and row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import nvfp4_base_fidelity as F  # noqa: E402


def _data(tmp_path: Path, rows: list[str]) -> Path:
    (tmp_path / "test.jsonl").write_text("\n".join(rows) + "\n")
    return tmp_path


def test_kl_against_the_reference(tiny_llama_dir: Path, tmp_path: Path):
    from qerl_lib.convert import convert

    nvfp4 = tmp_path / "nvfp4"
    convert(tiny_llama_dir, nvfp4, "nvfp4")
    data = _data(tmp_path, [json.dumps({"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = <<{i}+{i}={2 * i}>>"
                                        f"{2 * i}\n#### {2 * i}"}) for i in range(1, 4)])
    out = tmp_path / "f.json"
    assert F.main(["--reference", str(tiny_llama_dir), "--nvfp4", f"q={nvfp4}", "--nvfp4", f"same={tiny_llama_dir}",
                   "--data", str(data), "--n", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["problems"] == 2 and res["tokens"] > 0
    same, q = res["variants"]["same"], res["variants"]["q"]
    assert abs(same["kl"]) < 1e-6 and same["top1_agree"] == 1.0 and same["nll"] == pytest.approx(res["reference_nll"])
    assert q["kl"] > 1e-4 and q["top1_agree"] <= 1.0 and q["nll"] != pytest.approx(res["reference_nll"])
    (p,) = F.read_problems(data, 1)  # what the models read: annotations gone, the answer line kept
    assert "<<" not in p["solution"] and p["solution"].endswith("#### 2")


def test_bad_input_names_the_file_and_row(tmp_path: Path):
    data = _data(tmp_path, [json.dumps({"question": "q", "answer": "#### 1"}), json.dumps({"question": "q"})])
    with pytest.raises(SystemExit, match=r"test.jsonl: row 2: KeyError"):
        F.read_problems(data, 5)
    with pytest.raises(SystemExit, match="no test.jsonl"):
        F.read_problems(tmp_path / "nowhere", 1)
    with pytest.raises(SystemExit, match="expected NAME=DIR"):
        F.main(["--reference", str(tmp_path), "--nvfp4", "just-a-path", "--data", str(data)])
