"""Query results as tables: one `Result` (columns, rows, title, notes, the workspace it came from)
rendered as an aligned text table, Markdown, CSV or JSON (`qerl audit --format`).

Text and Markdown are for reading: floats are rounded to `DIGITS` significant digits and the
workspace that was read is named at the top. CSV and JSON are for programs: full precision.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from typing import Any

DIGITS = 4
"""Significant digits of a float in text and Markdown output."""


def round_sig(v: float, digits: int = DIGITS) -> str:
    """`v` with `digits` significant digits and no trailing zeros: 0.515625 -> "0.5156",
    1234.567 -> "1235", 7.0 -> "7". Plain decimals for 1e-4 <= |v| < 1e6 (a sigma of 5e-4 reads
    "0.0005"), else scientific ("1.235e+07"); nan, inf as Python writes them."""
    if not math.isfinite(v):
        return str(v)
    if v == 0:
        return "0"
    mag = math.floor(math.log10(abs(v)))
    if not -4 <= mag < 6:
        return f"{v:.{digits - 1}e}"
    text = f"{v:.{max(0, digits - 1 - mag)}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def _cell(v: Any, digits: int | None = DIGITS) -> str:
    """One value as text: None and nan empty, floats rounded (`digits` None: full precision),
    lists as JSON."""
    if v is None:
        return ""
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        return round_sig(v, digits) if digits else repr(v)
    if isinstance(v, (list, tuple)):
        return json.dumps(list(v))
    return str(v)


@dataclass
class Result:
    """A query result: column names and rows, renderable in every `--format`."""

    columns: list[str]
    rows: list[tuple]
    title: str = ""
    notes: list[str] = field(default_factory=list)
    workspace: str = ""
    """The workspace the rows were read from (named at the top of text and Markdown output)."""

    def as_dicts(self) -> list[dict]:
        return [dict(zip(self.columns, r)) for r in self.rows]

    def to_csv(self) -> str:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(self.columns)
        for r in self.rows:
            w.writerow(["" if v is None else (json.dumps(list(v)) if isinstance(v, (list, tuple)) else v) for v in r])
        return buf.getvalue()

    def to_markdown(self) -> str:
        def esc(s: str) -> str:
            return s.replace("|", "\\|").replace("\n", " ")

        lines = []
        if self.title:
            lines += [f"### {self.title}", ""]
        if self.workspace:
            lines += [f"workspace `{self.workspace}`", ""]
        lines.append("| " + " | ".join(esc(c) for c in self.columns) + " |")
        lines.append("| " + " | ".join("---" for _ in self.columns) + " |")
        for r in self.rows:
            lines.append("| " + " | ".join(esc(_cell(v)) for v in r) + " |")
        lines += [f"\n{n}" for n in self.notes]
        return "\n".join(lines) + "\n"

    def to_json(self) -> str:
        return json.dumps({"title": self.title, "workspace": self.workspace, "columns": self.columns,
                           "rows": self.as_dicts(), "notes": self.notes}, indent=2, default=str) + "\n"

    def to_table(self, max_width: int = 60) -> str:
        def clip(s: str) -> str:
            s = s.replace("\n", "\\n")
            return s if len(s) <= max_width else s[: max_width - 1] + "…"

        cells = [[clip(c) for c in self.columns]] + [[clip(_cell(v)) for v in r] for r in self.rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.columns))]
        out = []
        if self.workspace:
            out.append(f"workspace: {self.workspace}")
        if self.title:
            out.append(self.title)
        for j, row in enumerate(cells):
            out.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
            if j == 0:
                out.append("  ".join("-" * w for w in widths))
        if not self.rows:
            out.append("(no rows)")
        out += self.notes
        return "\n".join(out) + "\n"

    def render(self, fmt: str = "table") -> str:
        renderers = {"csv": self.to_csv, "markdown": self.to_markdown, "json": self.to_json, "table": self.to_table}
        if fmt not in renderers:
            raise ValueError(f"unknown format {fmt!r} (table, csv, markdown, json)")
        return renderers[fmt]()
