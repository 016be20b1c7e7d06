"""Seconds to load a GGUF base (tokenizer + model) with transformers, with and without one shared reader.

    python benchmarks/gguf_load.py --base smollm2 --out benchmarks/results/gguf_load_smollm2_cpu.json
    python benchmarks/gguf_load.py --base qwen2.5-coder-0.5b --out benchmarks/results/gguf_load_qwen05_cpu.json

`qerl_lib.model.materialize_base` loads a GGUF base the way this script does: `AutoTokenizer` and then
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`. transformers parses the file's metadata once
for each config, tokenizer and state-dict read. `qerl_lib.model.shared_gguf_reader` lets those reads
share one `gguf.GGUFReader`.

The two arms alternate in one process, `--repeats` times each:
- `separate`: transformers as it is;
- `shared`: inside `shared_gguf_reader()`.

Each arm reports its seconds and how many readers it built. The script checks that both arms give the
same tokenizer vocabulary and the same state dict, tensor for tensor.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from qerl_lib.io import atomic_write_text

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def load(location: str, gguf_file: str, shared: bool) -> tuple[float, int, dict, object]:
    """(seconds, readers built, state dict, tokenizer) of one tokenizer + model load."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl_lib.model import shared_gguf_reader

    built = 0
    original = gguf.GGUFReader

    def counting(*args, **kwargs):
        nonlocal built
        built += 1
        return original(*args, **kwargs)

    gguf.GGUFReader = counting  # counts the readers actually built; shared_gguf_reader wraps this one
    try:
        t0 = time.perf_counter()
        with shared_gguf_reader() if shared else contextlib.nullcontext():
            tok = AutoTokenizer.from_pretrained(location, gguf_file=gguf_file)
            model = AutoModelForCausalLM.from_pretrained(location, gguf_file=gguf_file, dtype=torch.bfloat16)
        seconds = time.perf_counter() - t0
    finally:
        gguf.GGUFReader = original
    return seconds, built, model.state_dict(), tok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="smollm2", help="model.base: smollm2 or a packaged Qwen model")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import torch
    import transformers

    from qerl_lib.model import resolve_source

    location, gguf_file = resolve_source(args.base)
    if gguf_file is None:
        raise SystemExit(f"gguf_load: model.base={args.base} is not a GGUF file")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    arms = {"separate": [], "shared": []}
    built, ref = {}, None
    for _ in range(args.repeats):
        for arm in arms:
            seconds, n, state, tok = load(location, gguf_file, arm == "shared")
            arms[arm].append(round(seconds, 2))
            built[arm] = n
            if ref is None:
                ref = (state, tok.get_vocab())
            elif state.keys() != ref[0].keys() or any(not torch.equal(state[k], ref[0][k]) for k in state) \
                    or tok.get_vocab() != ref[1]:
                raise SystemExit(f"gguf_load: the {arm} load gave other weights or another vocabulary")
            del state, tok
    med = {arm: round(statistics.median(v), 2) for arm, v in arms.items()}
    result = {
        "base": args.base, "gguf_file": gguf_file, "seconds": arms, "median_s": med,
        "readers_built": built, "shared_over_separate": round(med["shared"] / med["separate"], 3),
        "same_weights_and_vocab": True,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "command": "python benchmarks/gguf_load.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print(json.dumps(result, indent=1))
    if args.out:  # written whole or not at all
        atomic_write_text(args.out, json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
