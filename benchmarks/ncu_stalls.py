#!/usr/bin/env python3
"""Why a kernel's warps wait: Nsight Compute's per-instruction stall samples, summed by reason and opcode.

Reads the SASS source page that `scripts/device_vllm.sh kernel-ncu` exports
(`ncu -i X.ncu-rep --page source --csv --print-source sass`): one row per instruction, with
`Warp Stall Sampling (All Samples)` and one `stall_<reason>` column per reason. Prints, and writes
as JSON with `--out`:

- `by_reason`: each stall reason's share of all samples (`selected` is the sample of a warp that
  issued, so its share is the issue share; the rest are waits);
- `by_opcode`: each opcode's share of all samples (the opcode is the SASS mnemonic before the first
  dot, `IMAD.WIDE` counts as `IMAD`), with its own reasons;
- `top`: the instructions with the most samples, with their reasons.

A sample lands on the instruction a warp is waiting to issue, so a stall on an instruction is the
cost of what that instruction waits for (the operand of an earlier load for `long_sb`, an earlier
ALU result for `short_sb`/`wait`), not of the instruction itself.

    python benchmarks/ncu_stalls.py ncu_gate_up_sass.csv --out stalls.json
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

ALL = "Warp Stall Sampling (All Samples)"
REASON = re.compile(r"^stall_([a-z_]+)$")  # the "(Not Issued)" twins are left out: the all-samples set is the whole


def read_rows(path: Path) -> tuple[str, list[dict[str, str]]]:
    """(kernel name, the instruction rows) of one kernel's SASS page (the table's header follows the name)."""
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith('"Address","Source"'):
            name = next(csv.reader(lines[i - 1:i]), ["", ""])[1] if i else ""
            return name, list(csv.DictReader(lines[i:]))
    raise SystemExit(f"{path}: no SASS table (a line starting with \"Address\",\"Source\"): is this "
                     "`ncu --page source --csv --print-source sass` output?")


def _num(row: dict[str, str], key: str, path: Path, n: int) -> int:
    v = row.get(key, "0").replace(",", "")
    try:
        return int(float(v)) if v not in ("", "-") else 0
    except ValueError:
        raise SystemExit(f"{path}: row {n}, field {key!r}: {v!r} is not a number") from None


def opcode(source: str) -> str:
    """`@!P0 IMAD.WIDE.U32 R4, ...` -> `IMAD`."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def summarize(path: Path, top: int = 12) -> dict:
    kernel, rows = read_rows(path)
    if not rows:
        raise SystemExit(f"{path}: the SASS table has no rows")
    reasons = [m.group(1) for k in rows[0] if (m := REASON.match(k))]
    if ALL not in rows[0] or not reasons:
        raise SystemExit(f"{path}: missing field {ALL!r} or the stall_<reason> columns")
    total = 0
    by_reason: dict[str, int] = defaultdict(int)
    by_op: dict[str, dict] = defaultdict(lambda: {"samples": 0, "reasons": defaultdict(int), "instructions": 0})
    inst = []
    for n, row in enumerate(rows, start=1):
        s = _num(row, ALL, path, n)
        total += s
        op = opcode(row["Source"])
        by_op[op]["instructions"] += 1
        by_op[op]["samples"] += s
        rs = {}
        for r in reasons:
            v = _num(row, f"stall_{r}", path, n)
            if v:
                by_reason[r] += v
                by_op[op]["reasons"][r] += v
                rs[r] = v
        inst.append({"address": row["Address"], "source": row["Source"].strip(), "samples": s, "reasons": rs})
    if total == 0:
        raise SystemExit(f"{path}: no stall samples (was the report taken with --set full or the source counters?)")

    def share(d: dict[str, int]) -> dict[str, float]:
        return {k: round(v / total, 4) for k, v in sorted(d.items(), key=lambda kv: -kv[1]) if v}

    ops = {op: {"share": round(d["samples"] / total, 4), "instructions": d["instructions"],
                "reasons": share(d["reasons"])}
           for op, d in sorted(by_op.items(), key=lambda kv: -kv[1]["samples"]) if d["samples"]}
    inst.sort(key=lambda x: -x["samples"])
    return {"file": path.name, "kernel": kernel, "samples": total, "instructions": len(rows), "by_reason": share(by_reason),
            "by_opcode": ops, "top": [dict(i, share=round(i["samples"] / total, 4)) for i in inst[:top]]}


def show(s: dict) -> None:
    print(f"{s['file']}: {s['samples']} samples over {s['instructions']} instructions")
    print("  by reason: " + ", ".join(f"{k} {v:.1%}" for k, v in list(s["by_reason"].items())[:8]))
    for op, d in list(s["by_opcode"].items())[:8]:
        rs = ", ".join(f"{k} {v:.1%}" for k, v in list(d["reasons"].items())[:4])
        print(f"  {op:8s} {d['share']:6.1%} ({d['instructions']} instr): {rs}")
    for i in s["top"][:6]:
        rs = ", ".join(f"{k} {v}" for k, v in sorted(i["reasons"].items(), key=lambda kv: -kv[1])[:3])
        print(f"  {i['share']:6.1%}  {i['source'][:60]:60s} {rs}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="+", type=Path, help="SASS source pages exported by `ncu --page source --csv`")
    ap.add_argument("--top", type=int, default=12, help="how many instructions to list, most samples first")
    ap.add_argument("--out", type=Path, help="write the summaries as JSON here")
    a = ap.parse_args(argv)
    out = [summarize(p, a.top) for p in a.csv]
    for s in out:
        show(s)
    if a.out:
        doc = {"command": "python benchmarks/ncu_stalls.py " + " ".join(sys.argv[1:] if argv is None else argv),
               "kernels": out}
        tmp = a.out.with_suffix(a.out.suffix + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
