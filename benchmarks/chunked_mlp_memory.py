"""Peak memory of one MLP's forward-with-grad + backward, chunked or not, on the CPU (Linux).

What the recomputed decoder layer of a checkpointed training step does with its MLP: a
Qwen2MLP (bf16, intermediate 18944 as Qwen2.5-7B) whose gate/up/down are a frozen base (NVFP4
packed, or dense bf16) with PEFT LoRA r16 (float32 adapters), run with grad over `--tokens` rows,
then backward. The peak is read from the process's resident-set high-water mark (VmHWM, reset
through /proc/self/clear_refs after a warm-up step and `malloc_trim`), one fresh process per
configuration; tensors above glibc's 32 MiB mmap threshold come and go with the RSS, so the figure
is the largest set of live tensors. The hidden size is small by default (`--hidden 128`): the
[tokens, intermediate] tensors, which this measures, do not depend on it, and the step stays fast.

    python benchmarks/chunked_mlp_memory.py --out benchmarks/results/chunked_mlp_memory_cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INTERMEDIATE = 18944


def measure(hidden: int, tokens: int, quant: str, chunk: int) -> dict:
    """One configuration, in this process: peak bytes above the warm baseline."""
    import ctypes
    import gc
    import time

    import torch
    from peft import LoraConfig, get_peft_model
    from torch import nn
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    from qerl_lib.chunked_mlp import chunked_mlp
    from qerl_lib.lora import NVFP4LoraLinear
    from qerl_lib.nvfp4 import quantize_nvfp4
    from qerl_lib.nvfp4_linear import NVFP4Linear

    torch.manual_seed(0)
    mlp = Qwen2MLP(Qwen2Config(hidden_size=hidden, intermediate_size=INTERMEDIATE)).to(torch.bfloat16)
    for name in ("gate_proj", "up_proj", "down_proj"):
        lin = getattr(mlp, name)
        lin.weight.requires_grad_(False)
        if quant == "nvfp4":
            setattr(mlp, name, NVFP4Linear.from_tensors(*quantize_nvfp4(lin.weight.float())))

    class Holder(nn.Module):  # PEFT wants a model with at least one parameter
        def __init__(self):
            super().__init__()
            self.mlp, self.anchor = mlp, nn.Parameter(torch.zeros(1), requires_grad=False)

    cfg = LoraConfig(r=16, lora_alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"])
    cfg._register_custom_module({NVFP4Linear: NVFP4LoraLinear})
    model = get_peft_model(Holder(), cfg)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            nn.init.normal_(p, 0, 0.01)
    m = model.base_model.model.mlp
    x = torch.randn(tokens, hidden).to(torch.bfloat16).requires_grad_(True)
    gy = torch.randn(tokens, hidden).to(torch.bfloat16)

    def step():
        (m(x) if chunk == 0 else chunked_mlp(m, x, chunk)).backward(gy)

    def vm(key: str) -> int:
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    step()  # warm-up: x.grad, LoRA grads and allocator state exist before the baseline
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = vm("VmRSS")
    t0 = time.time()
    step()
    peak = vm("VmHWM") - base
    return {"quant": quant, "tokens": tokens, "chunk": chunk, "hidden": hidden, "intermediate": INTERMEDIATE,
            "peak_bytes": peak, "peak_gib": round(peak / 2**30, 3),
            "bytes_per_token_and_intermediate": round(peak / (tokens * INTERMEDIATE), 2),
            "bytes_per_chunk_token_and_intermediate": round(peak / (min(chunk or tokens, tokens) * INTERMEDIATE), 2),
            "seconds": round(time.time() - t0, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=4608, help="rows (default: Qwen2.5-7B micro-batch 2 x 2304)")
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 2304, 1152, 576], help="0: unchunked")
    ap.add_argument("--quants", nargs="+", default=["bf16", "nvfp4"], choices=["bf16", "nvfp4"])
    ap.add_argument("--one", nargs=2, metavar=("QUANT", "CHUNK"), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.hidden, args.tokens, args.one[0], int(args.one[1]))))
        return 0
    rows = []
    for quant in args.quants:
        for chunk in args.chunks:
            cmd = [sys.executable, __file__, "--hidden", str(args.hidden), "--tokens", str(args.tokens),
                   "--one", quant, str(chunk)]
            res = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    if args.out:
        cmd = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
        args.out.write_text(json.dumps({"command": cmd, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
