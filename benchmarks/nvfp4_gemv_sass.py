#!/usr/bin/env python3
"""The CUDA decode GEMM's machine code, counted: which instructions one round of its main loop issues,
on which of the SM's pipes, for every compiled variant. Runs on the CPU (nvcc + nvdisasm, no GPU).

At one row the kernel is bound by its instructions, not its reads (benchmarks/results/
nvfp4_gemv_bound.json, nvfp4_gemv_ncu.txt: the integer pipe at 69 % of peak). So the question "does a
change to the decode pay?" has a first answer in the SASS, before any GPU time: how many
instructions the steady-state round issues, and how they load the pipes.

It compiles `qerl_lib/kernels/csrc/nvfp4_gemv.cu` for sm_90 with the extension's own nvcc flags
(`nvfp4_gemv_cuda.build_flags`, plus the defines torch's cpp_extension adds), disassembles the cubin
with nvdisasm (`pip install nvidia-cuda-nvdisasm`, part of the `dev` extra; or `--nvdisasm PATH`), and
for each `gemv_kernel<BF16, MT, ALIGNED, REPACKED, LOOP>` takes the basic block with the most HMMA, the full
round of the loop (U chunks of 8 MMA steps, U = 4 at one n-tile and 2 at two, bounds checks hoisted;
with LOOP ring, whose refill loads branch per chunk, the block of one chunk or a few; with pipe / pipe2,
the unchecked set of U / 2 / U chunks),
with the loop's control around it (its head down to the branch into the round, and the latch back):
where the time goes at 7B shapes (28-148 chunks of K per row tile, up to 20 per warp).

Pipes of sm_90 (Hopper), each 16 lanes per SM sub-partition, so each takes one warp instruction every
2 cycles, while the scheduler issues at most 1 per cycle:
- `alu`: integer and logic except multiplies (LOP3, PRMT, LEA, SHF, IADD3, ISETP, SEL, ...) and
  FP32 -> FP16/BF16 conversion (F2FP);
- `fma_heavy`: integer multiply-add (IMAD in all its forms, which ptxas also uses for moves and
  shifts by a constant);
- `fma`: FP32 and packed FP16/BF16 arithmetic (FFMA, FMUL, FADD, HFMA2, HMUL2, HADD2), issued to
  fma-heavy or fma-lite, so up to one per cycle between them;
- `tensor` (HMMA), `lsu` (loads, stores, shuffles), `branch`, `uniform` (the U* datapath, S2UR, R2UR)
  and `other` (NOP, S2R, anything unknown: each still takes an issue slot).

`cycles_lower_bound` of a round = max(2 x alu, 2 x fma_heavy, fma_heavy + fma, issued): the fewest
cycles one sub-partition needs for that round's instructions if nothing stalls. It ranks variants
by their instruction mix; it is not a timing (latency, occupancy and memory are not in it), and a
variant is kept only when the GPU benchmark says so (benchmarks/nvfp4_gemv.py, nvfp4_gemv_bound.py).

    python benchmarks/nvfp4_gemv_sass.py --out benchmarks/results/nvfp4_gemv_sass.json
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qerl_lib.io import atomic_write_json  # noqa: E402

SOURCE = ROOT / "qerl_lib" / "kernels" / "csrc" / "nvfp4_gemv.cu"

PIPES = ("alu", "fma_heavy", "fma", "tensor", "lsu", "branch", "uniform", "other")
_PIPE_OF = {
    "alu": ("LOP3", "LOP", "PRMT", "LEA", "SHF", "SHL", "SHR", "IADD3", "IADD", "VIADD", "ISETP", "SEL",
            "FSEL", "MOV", "IMNMX", "VIMNMX", "PLOP3", "BMSK", "FLO", "POPC", "BREV", "F2FP", "FSETP",
            "FMNMX", "IABS", "SGXT", "P2R", "R2P", "CS2R", "LOP32I", "IADD32I"),
    "fma_heavy": ("IMAD", "IMUL", "IDP", "IMAD32I"),
    "fma": ("FFMA", "FMUL", "FADD", "HFMA2", "HMUL2", "HADD2", "FFMA32I", "FMUL32I", "FADD32I"),
    "tensor": ("HMMA", "IMMA", "HGMMA", "DMMA"),
    "lsu": ("LDG", "STG", "LDS", "STS", "LDC", "LDL", "STL", "SHFL", "LDGSTS", "LDSM", "RED", "ATOM", "ATOMS",
            "ATOMG", "REDG", "MEMBAR", "FENCE", "CCTL"),
    "branch": ("BRA", "BSSY", "BSYNC", "EXIT", "RET", "CALL", "WARPSYNC", "BAR", "BREAK", "YIELD", "BRX"),
    "uniform": ("S2UR", "R2UR", "VOTEU"),
}  # anything else (NOP, S2R, ...) is `other`
PIPE_OF = {base: pipe for pipe, bases in _PIPE_OF.items() for base in bases}

_LABEL = re.compile(r"^(\S+):\s*$")  # column 0: `.L_x_12:`, or an inlined subroutine's `$__internal_...:`
_FUNC = re.compile(r"^\s*\.text\.(\S+):")
_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:(@!?U?P[T0-9])\s+)?([A-Z][A-Z0-9_.]*)(.*)$")
_TARGET = re.compile(r"\(([^()\s]+)\)")
_GEMV = re.compile(r"gemv_kernelILb(\d)ELi(\d)ELb(\d)ELb(\d)E(?:L([bi])(\d)E)?")
LOOPS = ("rounds", "ring", "pipe", "pipe2")  # the K loop's template argument (csrc/nvfp4_gemv.h kRounds..)


@dataclass(frozen=True)
class Instr:
    opcode: str
    """Full opcode with modifiers, e.g. `IMAD.SHL.U32`."""
    predicate: str | None
    """`@P0`, `@!P1`, ... or None when always executed."""
    target: str | None
    """The label a branch goes to, else None."""

    @property
    def ends_block(self) -> bool:
        return self.opcode.startswith(("BRA", "EXIT", "RET"))

    @property
    def always_leaves(self) -> bool:
        """An unconditional jump or exit: the next block is not reached by falling through."""
        return self.ends_block and self.predicate is None


@dataclass
class Function:
    blocks: list[list[Instr]]
    """Basic blocks in address order; a block ends at a label or after a branch."""
    labels: dict[str, int]
    """Label -> index of the block it starts."""


def pipe_of(opcode: str) -> str:
    """The sm_90 pipe that executes `opcode` (module docstring); U* opcodes run on the uniform datapath."""
    base = opcode.split(".", 1)[0]
    if base in PIPE_OF:
        return PIPE_OF[base]
    return "uniform" if base.startswith("U") else "other"


def parse_sass(text: str) -> dict[str, Function]:
    """nvdisasm's output (`nvdisasm -c`) -> {mangled function name: its basic blocks and labels}."""
    functions: dict[str, Function] = {}
    fn: Function | None = None
    for line in text.splitlines():
        if m := _FUNC.match(line):
            fn = functions.setdefault(m.group(1), Function([[]], {}))
            continue
        if fn is None:
            continue
        if m := _LABEL.match(line):
            if fn.blocks[-1]:
                fn.blocks.append([])
            fn.labels[m.group(1)] = len(fn.blocks) - 1
            continue
        if m := _INSTR.match(line):
            target = _TARGET.search(m.group(4)) if m.group(3).startswith("BRA") else None
            fn.blocks[-1].append(Instr(m.group(3), m.group(2), target.group(1) if target else None))
            if fn.blocks[-1][-1].ends_block:
                fn.blocks.append([])
    for f in functions.values():
        if not f.blocks[-1]:
            f.blocks.pop()
    return functions


def _mma(block: list[Instr]) -> int:
    return sum(pipe_of(i.opcode) == "tensor" for i in block)


def steady_round(fn: Function) -> tuple[list[Instr], bool]:
    """(instructions, with_loop_control) of the kernel's full round: the basic block with the most
    tensor-core MMAs (ties: the first), plus the loop control around it where it can be followed: the
    blocks it falls through to up to the branch back (the latch), and the blocks from the loop's head
    down to the branch into the round. False: the block alone (no such path found)."""
    blocks = fn.blocks
    if not blocks:
        raise ValueError("no instructions")
    r = max(range(len(blocks)), key=lambda k: _mma(blocks[k]))
    round_labels = {label for label, i in fn.labels.items() if i == r}

    def goes_back(block: list[Instr]) -> bool:
        return block[-1].target is not None and fn.labels.get(block[-1].target, len(blocks)) <= r

    latch = r
    while not goes_back(blocks[latch]):
        if blocks[latch][-1].always_leaves or latch + 1 == len(blocks):
            return blocks[r], False
        latch += 1
    entry = []
    for h in range(fn.labels[blocks[latch][-1].target], r):  # the head falls through to the round's entry
        entry.append(h)
        if blocks[h][-1].target in round_labels:
            break
        if blocks[h][-1].always_leaves:
            return blocks[r], False
    return [i for h in [*entry, *range(r, latch + 1)] for i in blocks[h]], True


def pipe_counts(instrs: list[Instr]) -> dict[str, int]:
    """Instructions per pipe (every name of PIPES present, 0 when none)."""
    counts = collections.Counter(pipe_of(i.opcode) for i in instrs)
    return {p: counts.get(p, 0) for p in PIPES}


def cycles_lower_bound(pipes: dict[str, int]) -> tuple[int, str]:
    """(cycles, binding limit): the fewest cycles one SM sub-partition needs to issue these instructions,
    from the pipes' rates (module docstring), and which limit sets it."""
    issued = sum(pipes.values())
    limits = {"alu": 2 * pipes["alu"], "fma_heavy": 2 * pipes["fma_heavy"],
              "fma": pipes["fma_heavy"] + pipes["fma"], "issue": issued}
    name = max(limits, key=lambda k: limits[k])
    return limits[name], name


def variant_of(name: str) -> dict | None:
    """gemv_kernel's template arguments from its mangled name, or None for other kernels."""
    m = _GEMV.search(name)
    if not m:
        return None
    bf16, mt, aligned, repacked, kind, loop = m.groups()
    # the last argument: `bool RING` before the pipe loops (Lb), the loop's number since (Li)
    return {"bf16": bf16 == "1", "mt": int(mt), "aligned": aligned == "1", "repacked": repacked == "1",
            "loop": LOOPS[int(loop or 0)]}


def analyse(functions: dict[str, Function]) -> list[dict]:
    """One row per gemv_kernel variant: its full round's instruction counts by opcode and pipe, in all and
    per MMA step (4 weights of each of a lane's two rows decoded, 8 per lane, then MT MMAs m16n8k16)."""
    rows = []
    for name, fn in sorted(functions.items()):
        variant = variant_of(name)
        if variant is None:
            continue
        block, loop_control = steady_round(fn)
        pipes = pipe_counts(block)
        steps = pipes["tensor"] // variant["mt"]  # a step decodes 8 weights per lane, then runs MT MMAs
        if steps == 0 or pipes["tensor"] % variant["mt"]:
            raise SystemExit(f"{name}: its busiest block holds {pipes['tensor']} MMAs, not a whole number of "
                             f"steps of {variant['mt']}: the listing is not the kernel this script knows")
        cycles, limit = cycles_lower_bound(pipes)
        rows.append({**variant, "function": name, "instructions": len(block), "mma_steps": steps,
                     "with_loop_control": loop_control, "pipes": pipes,
                     "per_step": {"instructions": round(len(block) / steps, 2),
                                  **{p: round(v / steps, 2) for p, v in pipes.items()},
                                  "cycles_lower_bound": round(cycles / steps, 2)},
                     "cycles_lower_bound": cycles, "binding": limit,
                     "opcodes": dict(collections.Counter(i.opcode for i in block).most_common())})
    return rows


def compare_layouts(rows: list[dict]) -> list[dict]:
    """Repacked vs compressed-tensors codes for each (bf16, mt, aligned): the repacked round's counts per
    MMA step as fractions of the other's."""
    by_key = {(r["bf16"], r["mt"], r["aligned"], r["repacked"]): r for r in rows if r["loop"] == "rounds"}
    out = []
    for (bf16, mt, aligned, repacked), base in sorted(by_key.items()):
        other = by_key.get((bf16, mt, aligned, True))
        if repacked or other is None:
            continue
        ratio = {k: round(other["per_step"][k] / base["per_step"][k], 3)
                 for k in ("instructions", "alu", "cycles_lower_bound")}
        out.append({"bf16": bf16, "mt": mt, "aligned": aligned, **ratio})
    return out


def find_nvdisasm(explicit: str | None) -> str:
    """--nvdisasm, else nvdisasm on PATH, else the one the `nvidia-cuda-nvdisasm` wheel installs."""
    if explicit:
        if not Path(explicit).is_file():
            raise SystemExit(f"--nvdisasm {explicit}: no such file")
        return explicit
    if found := shutil.which("nvdisasm"):
        return found
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        for path in sorted(Path(base).glob("cu*/bin/nvdisasm")):
            return str(path)
    raise SystemExit("nvdisasm not found: pip install nvidia-cuda-nvdisasm (the `dev` extra has it), "
                     "or pass --nvdisasm PATH")


def tool_version(tool: str) -> str:
    """The last line of `tool --version` (nvcc and nvdisasm print their build there)."""
    out = subprocess.run([tool, "--version"], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""


def ptxas_resources(stderr: str) -> dict[str, dict[str, int]]:
    """{mangled function: {"registers": n, "spill_stores": bytes, "spill_loads": bytes}} from `ptxas -v`."""
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in stderr.splitlines():
        if m := re.search(r"Compiling entry function '([^']+)'", line):
            current = out.setdefault(m.group(1), {})
        elif current is not None and (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            current["spill_stores"], current["spill_loads"] = int(m.group(1)), int(m.group(2))
        elif current is not None and (m := re.search(r"Used (\d+) registers", line)):
            current["registers"] = int(m.group(1))
    return out


def compile_and_disassemble(source: Path, arch: str, nvcc: str, nvdisasm: str) -> tuple[str, dict]:
    """(`nvdisasm -c` text, `ptxas_resources`) of nvcc -cubin for sm_`arch` with the extension's flags."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS  # what the extension's build adds to ours

    from qerl_lib.kernels.nvfp4_gemv_cuda import build_flags

    flags = [f for f in build_flags(arch)[0] if not f.startswith("-gencode")]
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "nvfp4_gemv.cubin"
        cmd = [nvcc, *flags, *COMMON_NVCC_FLAGS, "-Xptxas=-v", f"-arch=sm_{arch}", "-cubin", "-o", str(cubin),
               str(source)]
        built = subprocess.run(cmd, capture_output=True, text=True)
        if built.returncode != 0:
            raise SystemExit(f"nvcc failed on {source}:\n{built.stderr[-3000:]}")
        dis = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True)
        if dis.returncode != 0:
            raise SystemExit(f"nvdisasm failed on {cubin}:\n{dis.stderr[-3000:]}")
        return dis.stdout, ptxas_resources(built.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/nvfp4_gemv_sass.json"))
    ap.add_argument("--arch", default="90", help="SM architecture to compile for (the H200: 90)")
    ap.add_argument("--nvcc", default="nvcc", help="the nvcc to compile with (CUDA 12.8+)")
    ap.add_argument("--nvdisasm", default=None, help="path to nvdisasm (default: PATH, then the pip wheel)")
    ap.add_argument("--sass", default=None, help="analyse this `nvdisasm -c` output instead of compiling")
    args = ap.parse_args()

    resources: dict = {}
    if args.sass:
        if not Path(args.sass).is_file():
            raise SystemExit(f"--sass {args.sass}: no such file (give the output of `nvdisasm -c` on the kernel's cubin)")
        text, tools = Path(args.sass).read_text(), {"sass": args.sass}
    else:
        if shutil.which(args.nvcc) is None:
            raise SystemExit(f"{args.nvcc} not found: this compiles csrc/nvfp4_gemv.cu (CUDA toolkit 12.8+)")
        nvdisasm = find_nvdisasm(args.nvdisasm)
        text, resources = compile_and_disassemble(SOURCE, args.arch, args.nvcc, nvdisasm)
        tools = {"nvcc": tool_version(args.nvcc), "nvdisasm": tool_version(nvdisasm)}
    rows = analyse(parse_sass(text))
    if not rows:
        raise SystemExit("no gemv_kernel in the disassembly")
    for r in rows:  # registers decide how many warps an SM holds, so a decode change must not add many
        r.update(resources.get(r["function"], {}))
    res = {"command": "python benchmarks/nvfp4_gemv_sass.py " + " ".join(sys.argv[1:]), "arch": f"sm_{args.arch}",
           "tools": tools, "variants": rows, "repacked_over_compressed_tensors": compare_layouts(rows)}
    print("per MMA step of the full round:")
    print(f"{'bf16':>5} {'mt':>2} {'aligned':>7} {'repacked':>8} {'loop':>6} {'steps':>5} {'instr':>6} "
          + " ".join(f"{p:>9}" for p in PIPES[:5]) + f" {'cycles>=':>9} {'regs':>4} binding")
    for r in rows:
        st = r["per_step"]
        print(f"{r['bf16']!s:>5} {r['mt']:>2} {r['aligned']!s:>7} {r['repacked']!s:>8} {r['loop']:>6} {r['mma_steps']:>5} "
              f"{st['instructions']:>6} " + " ".join(f"{st[p]:>9}" for p in PIPES[:5])
              + f" {st['cycles_lower_bound']:>9} {r.get('registers', '-'):>4} {r['binding']}")
    for c in res["repacked_over_compressed_tensors"]:
        print(f"repacked / compressed-tensors (bf16={c['bf16']}, mt={c['mt']}, aligned={c['aligned']}): "
              f"instructions {c['instructions']}, alu {c['alu']}, cycle bound {c['cycles_lower_bound']}")
    atomic_write_json(Path(args.out), res)
    print(json.dumps({"out": args.out}))


if __name__ == "__main__":
    main()
