"""Wall-clock of the convert stage, with and without a BF16 base already in the workspace.

    python benchmarks/convert_stage.py -c experiments/qwen05_gsm8k/nvfp4.yaml --data <gsm8k dir> \
        --out benchmarks/results/convert_stage_qwen05_cpu.json

`scripts/device_experiment.sh qwen-convert` converts the Qwen GGUF once to a BF16 HF copy (`models/base`),
hard-links that copy into the NVFP4 and NF4 workspaces, and runs their convert stages there. Both arms
run `python -m qerl_lib stage convert` as a fresh process, as the script does, one after the other:

- `cold`: an empty workspace, so the stage loads the GGUF, writes `models/base`, then quantizes;
- `base_in_place`: `models/base` hard-linked from the cold run's workspace, so the stage only quantizes.

Both must give the same checkpoint hash. Their difference is what each further quantization saves when it
finds the base in place.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qerl_lib.io import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]


def convert(config: Path, data: Path, root: Path) -> float:
    """Seconds of one `qerl stage convert` process on workspace `root`."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1"}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "qerl_lib", "stage", "convert", "-c", str(config), "-s",
                    f"data.source={data}", "--root", str(root)], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def checkpoint_hash(root: Path) -> str:
    (report,) = root.glob("models/*/convert_report.json")
    return json.loads(report.read_text())["checkpoint_hash"]


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "llmcompressor", "compressed-tensors", "gguf"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-c", "--config", type=Path, required=True, help="a qerl config (its model.base and model.quant)")
    ap.add_argument("--data", type=Path, required=True, help="data.source for the config (the stage does not read it)")
    ap.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="qerl-convert-") as tmp:
        cold, warm = Path(tmp) / "cold", Path(tmp) / "warm"
        cold_s = convert(args.config, args.data, cold)
        (warm / "models").mkdir(parents=True)
        shutil.copytree(cold / "models" / "base", warm / "models" / "base", copy_function=os.link)
        warm_s = convert(args.config, args.data, warm)
        hashes = {checkpoint_hash(cold), checkpoint_hash(warm)}
    if len(hashes) != 1:
        raise SystemExit(f"convert_stage: the two workspaces' checkpoints differ: {sorted(hashes)}")
    result = {
        "config": str(args.config), "cold_s": round(cold_s, 1), "base_in_place_s": round(warm_s, 1),
        "saved_per_further_quantization_s": round(cold_s - warm_s, 1), "checkpoint_hash": hashes.pop(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "python": platform.python_version(),
        "versions": versions(),
        "command": "python benchmarks/convert_stage.py " + " ".join(
            "<data dir>" if a == str(args.data) else a for a in (argv if argv is not None else sys.argv[1:])),
    }
    print(json.dumps(result, indent=1))
    if args.out:  # written whole or not at all
        atomic_write_text(args.out, json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
