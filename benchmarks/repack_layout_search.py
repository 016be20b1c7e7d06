#!/usr/bin/env python3
"""Where the CUDA decode GEMM's repacked layout puts each code's bits, and why: an exhaustive search.

A repacked 32-bit word holds 8 E2M1 codes as 4 pairs; pair p's first code lies in the low 16 bits and
its second code 16 bits higher, at the same relative positions, so one instruction acts on both. The
kernel turns pair p into a 16-bit float pair by moving each code's magnitude bits (m, e0, e1) to the
float's bits 6, 7, 8 (bf16; fp16: 9, 10, 11) and its sign to bit 15, leaving every other bit zero
(`decode_pair_repacked` in qerl_lib/kernels/csrc/nvfp4_gemv.cuh). Bits that move by the same amount
move together, so a code whose four bits need d distinct shifts costs

    (shifts other than 0) + d LOP3    (one LOP3 masks the first group, one more ORs in each further group)

instructions. Shifts by a constant run on the FMA pipe (IMAD.SHL, IMAD.HI for right shifts), LOP3 on
the integer pipe. The search places the 16 bits of one half word (4 codes x 4 bits, every
permutation) by dynamic programming over the sets of used bits and keeps the placements that are
Pareto-best for (bf16 instructions, fp16 instructions). The model counts only shifts and LOP3 (no
PRMT, multiply or funnel-shift tricks); the compiled counts are `benchmarks/nvfp4_gemv_sass.py`'s.

The shipped layout (session 16: pair p's sign at bit 12 + p) costs bf16 14 per word; the search's
cheapest for bf16 costs 11 (the shipped one with the signs of pairs 0/1 and 2/3 swapped). That
variant was built and timed in session 24 and not kept: 8 % fewer instructions per MMA step in the
machine code, but 0.9 % slower on DRAM-resident weights on an H100 (1.4 % faster only on
L2-resident ones); benchmarks/results/gemv_variants_session24/README.md has the figures.

    python benchmarks/repack_layout_search.py --out benchmarks/results/repack_layout_search.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qerl_lib.io import atomic_write_json  # noqa: E402

TARGET = {"bf16": (6, 7, 8, 15), "fp16": (9, 10, 11, 15)}  # where (m, e0, e1, sign) must land
FULL = (1 << 16) - 1


def code_cost(target: tuple[int, ...], source: tuple[int, ...]) -> int:
    """Instructions that move one code's bits from `source` to `target` positions (both (m, e0, e1, sign))."""
    shifts = {t - s for t, s in zip(target, source)}
    return len(shifts - {0}) + len(shifts)


def layout_cost(layout: tuple[tuple[int, ...], ...], dtype: str) -> int:
    return sum(code_cost(TARGET[dtype], code) for code in layout)


@functools.cache
def _options(bits: frozenset[int]) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
    return tuple((code_cost(TARGET["bf16"], perm), code_cost(TARGET["fp16"], perm), perm)
                 for perm in itertools.permutations(sorted(bits)))


@functools.cache
def _pareto(used: int) -> dict[tuple[int, int], tuple[tuple[int, ...], ...]]:
    """Best (bf16, fp16) costs of placing the codes left once the bits in `used` are taken."""
    if used == FULL:
        return {(0, 0): ()}
    free = [i for i in range(16) if not used >> i & 1]
    res: dict[tuple[int, int], tuple[tuple[int, ...], ...]] = {}
    for others in itertools.combinations(free[1:], 3):  # the lowest free bit belongs to the next code
        bits = (free[0],) + others
        tail = _pareto(used | sum(1 << i for i in bits))
        for cb, cf, perm in _options(frozenset(bits)):
            for (tb, tf), rest in tail.items():
                res.setdefault((cb + tb, cf + tf), (perm,) + rest)
    return {k: v for k, v in res.items() if not any(o[0] <= k[0] and o[1] <= k[1] and o != k for o in res)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/repack_layout_search.json"))
    args = ap.parse_args()
    shipped = tuple((3 * p, 3 * p + 1, 3 * p + 2, 12 + p) for p in range(4))  # nvfp4_gemv.cuh repack_word
    swapped = tuple((3 * p, 3 * p + 1, 3 * p + 2, 12 + (p ^ 1)) for p in range(4))  # session 24's variant
    pareto = [{"bf16": b, "fp16": f, "layout": [list(c) for c in lay]} for (b, f), lay in sorted(_pareto(0).items())]
    res = {
        "command": "python benchmarks/repack_layout_search.py " + " ".join(sys.argv[1:]),
        "model": "per code: (distinct nonzero shifts) + (distinct shifts) LOP3; per word: 4 codes (x2 halves)",
        "pareto": pareto,
        "shipped": {"layout": [list(c) for c in shipped], "bf16": layout_cost(shipped, "bf16"),
                    "fp16": layout_cost(shipped, "fp16")},
        "sign_swap_session_24": {"layout": [list(c) for c in swapped], "bf16": layout_cost(swapped, "bf16"),
                                 "fp16": layout_cost(swapped, "fp16"),
                                 "kept": False},
    }
    for row in pareto:
        print(f"pareto: bf16 {row['bf16']:2d}  fp16 {row['fp16']:2d}  (m, e0, e1, sign) per pair {row['layout']}")
    for key in ("shipped", "sign_swap_session_24"):
        print(f"{key:20s}: bf16 {res[key]['bf16']:2d}  fp16 {res[key]['fp16']:2d}  {res[key]['layout']}")
    atomic_write_json(Path(args.out), res)
    print(json.dumps({"out": args.out}))


if __name__ == "__main__":
    main()
