"""The `prepare` stage: turn a dataset source into `train.parquet` and `test.parquet`.

Sources (`DataConfig.source`):

- `synthetic`: the built-in arithmetic generator (`qerl_lib.arith_task`; seeded, levels 1-4, see
  `DataConfig.synthetic_levels`), graded numerically;
- a local `.jsonl` or `.parquet` file, or a directory holding `train.*` / `test.*`;
- a hub dataset id (`openai/gsm8k`) loaded through `datasets.load_dataset` when no local
  path of that name exists.

Row layouts: `gsm8k` (question / answer ending in `#### N`), `math` (problem / solution /
answer; the answer column if present, else the last `\\boxed{}` of the solution),
`arith` (question / ground_truth or a plain-number answer); `auto` infers it from the
columns.

Output rows (`PREPARED_SCHEMA`): prompt_id (stable_id(source, split, source_index)),
source, split, source_index, question, ground_truth (normalised final answer), grader
(gsm8k | math), level (synthetic level; null for real data). Everything is parsed and
validated before anything is written, both files are written atomically, and the same
config and seed give byte-identical files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from qerl_lib.arith_task import SYNTHETIC_LEVELS, level_space, synthetic_problem
from qerl_lib.config import DataConfig
from qerl_lib.io import atomic_path
from qerl_lib.rewards import last_boxed, normalize_number, resolve_grader
from qerl_lib.seeds import stable_id

PREPARED_SCHEMA = pa.schema(
    [
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("split", pa.string(), nullable=False),
        pa.field("source_index", pa.int64(), nullable=False),
        pa.field("question", pa.string(), nullable=False),
        pa.field("ground_truth", pa.string(), nullable=False),
        pa.field("grader", pa.string(), nullable=False),
        pa.field("level", pa.int32(), nullable=True),
        pa.field("solution", pa.string(), nullable=True),
    ]
)
"""Columns of `data/prepared/{train,test}.parquet`. `solution`: the source's worked solution as it
stands there (GSM8K's `answer` with its `<<...>>` annotations and `#### N` line, MATH's `solution`),
null where the source has none (arithmetic); GPTQ's calibration reads it, no stage grades with it."""

PREPARED_VERSION = "2"  # 2: the `solution` column (files of version 1 read with solution = null)
_ADDED_COLUMNS = frozenset({"solution"})  # nullable columns that later versions added
_SUFFIXES = (".jsonl", ".parquet")


class DataError(ValueError):
    """Unusable input data; the message names the file, the row (line number) and the field."""


@dataclass(frozen=True)
class Example:
    """One prepared row before it is written (fields as in `PREPARED_SCHEMA`)."""

    prompt_id: str
    source: str
    split: str
    source_index: int
    question: str
    ground_truth: str
    grader: str
    level: int | None = None
    solution: str | None = None


# ---------------------------------------------------------------------------------
# Reading raw rows
# ---------------------------------------------------------------------------------


def _read_jsonl(path: Path) -> list[tuple[str, dict]]:
    """(location, row) per non-blank line; location is `file:line N` for error messages."""
    rows = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}: line {lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
            rows.append((where, row))
    return rows


def _read_parquet(path: Path) -> list[tuple[str, dict]]:
    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for bad files
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    return [(f"{path}: row {i}", row) for i, row in enumerate(table.to_pylist())]


def read_rows(path: Path) -> list[tuple[str, dict]]:
    """Rows of a local `.jsonl` / `.parquet` file as (location, dict) pairs."""
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    if path.suffix == ".jsonl":
        return _read_jsonl(path)
    if path.suffix == ".parquet":
        return _read_parquet(path)
    raise DataError(f"{path}: unsupported file type {path.suffix!r} (expected .jsonl or .parquet)")


# ---------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------


def detect_layout(rows: list[tuple[str, dict]], origin: str) -> str:
    """Infer the layout from the first row's keys: gsm8k (question + answer), arith
    (question + ground_truth), math (problem + answer or solution)."""
    if not rows:
        raise DataError(f"{origin}: no rows")
    keys = set(rows[0][1])
    if {"question", "answer"} <= keys:
        return "gsm8k"
    if {"question", "ground_truth"} <= keys:
        return "arith"
    if "problem" in keys and ({"answer", "solution"} & keys):
        return "math"
    raise DataError(
        f"{origin}: unknown layout, cannot infer it from columns {sorted(keys)}; expected "
        "question/answer (gsm8k), problem/solution/answer (math) or question/ground_truth (arith); "
        "or set data.layout"
    )


def _text_field(where: str, row: dict, field: str) -> str:
    value = row.get(field)
    if value is None or (isinstance(value, str) and not value.strip()):
        raise DataError(f"{where}: field {field!r} is missing or empty")
    if not isinstance(value, (str, int, float)):
        raise DataError(f"{where}: field {field!r} must be text, got {type(value).__name__}")
    return str(value).strip()


def gsm8k_answer(answer: str) -> str | None:
    """Ground truth of a GSM8K answer: the number after its last `####`, normalised."""
    if "####" not in answer:
        return None
    return normalize_number(answer.rsplit("####", 1)[1])


def _parse_gsm8k(where: str, row: dict) -> tuple[str, str, str | None]:
    question = _text_field(where, row, "question")
    answer = _text_field(where, row, "answer")
    truth = gsm8k_answer(answer)
    if truth is None:
        raise DataError(f"{where}: field 'answer' has no '#### <number>' final answer")
    return question, truth, answer


def _parse_math(where: str, row: dict) -> tuple[str, str, str | None]:
    question = _text_field(where, row, "problem")
    answer = row.get("answer")
    given = row.get("solution")
    solution = given if isinstance(given, str) and given.strip() else None
    if isinstance(answer, (int, float)) or (isinstance(answer, str) and answer.strip()):
        return question, str(answer).strip(), solution
    if "answer" in row and "solution" not in row:
        raise DataError(f"{where}: field 'answer' is empty")
    solution = _text_field(where, row, "solution")
    boxed = last_boxed(solution)
    if not boxed:
        raise DataError(f"{where}: field 'solution' has no \\boxed{{...}} final answer (and no 'answer' field)")
    return question, boxed, solution


def _parse_arith(where: str, row: dict) -> tuple[str, str, str | None]:
    question = _text_field(where, row, "question")
    field = "ground_truth" if "ground_truth" in row else "answer"
    raw = _text_field(where, row, field)
    truth = normalize_number(raw)
    if truth is None:
        raise DataError(f"{where}: field {field!r} is not a number: {raw!r}")
    return question, truth, None


_PARSERS = {"gsm8k": _parse_gsm8k, "math": _parse_math, "arith": _parse_arith}


def parse_rows(rows: list[tuple[str, dict]], layout: str, origin: str) -> tuple[str, list[tuple[str, str, str | None]]]:
    """(layout, [(question, ground_truth, solution or None)]) for every row, in order; the first
    bad row raises a `DataError` naming its location and field."""
    if layout == "auto":
        layout = detect_layout(rows, origin)
    if layout not in _PARSERS:
        raise DataError(f"{origin}: unknown layout {layout!r} (expected gsm8k, math or arith)")
    parse = _PARSERS[layout]
    return layout, [parse(where, row) for where, row in rows]


# ---------------------------------------------------------------------------------
# Synthetic arithmetic (the problems: qerl_lib.arith_task)
# ---------------------------------------------------------------------------------


def _check_levels(levels: list[int]) -> list[int]:
    if not levels:
        raise DataError("data.synthetic_levels is empty")
    bad = [lv for lv in levels if lv not in SYNTHETIC_LEVELS]
    if bad:
        raise DataError(f"data.synthetic_levels: unknown level(s) {bad} (levels: {sorted(SYNTHETIC_LEVELS)})")
    return sorted(set(levels))


def synthetic_examples(cfg: DataConfig, seed: int) -> tuple[str, list[Example], list[Example]]:
    """(source name, train, test) of the synthetic arithmetic set.

    The test split is drawn first from its own seed stream, with distinct problems; the
    train split from another stream, skipping every problem the test split holds (by
    arithmetic key, so `What is 3 + 4?` and a word problem adding 3 and 4 are the same
    problem). Train problems may repeat when a level has few problems (level 1 has 100).
    """
    levels = _check_levels(cfg.synthetic_levels)
    style = cfg.synthetic_style
    space = sum(level_space(lv) for lv in levels)
    if cfg.synthetic_test >= space:
        raise DataError(
            f"data.synthetic_test={cfg.synthetic_test} leaves no training problems: levels {levels} "
            f"hold only {space} distinct problems"
        )
    name = f"synthetic:levels={','.join(map(str, levels))}:style={style}:seed={seed}"

    def draw(split: str, n: int, taken: set[str], unique: bool) -> list[Example]:
        out = []
        for i in range(n):
            for attempt in range(10_000):
                key, question, value, level = synthetic_problem(seed, split, i, attempt, levels, style)
                if key not in taken:
                    break
            else:
                raise DataError(f"synthetic {split} problem {i}: no problem outside the test split after 10000 draws")
            if unique:
                taken.add(key)
            out.append(Example(stable_id(name, split, i), name, split, i, question, str(value), "gsm8k", level))
        return out

    taken: set[str] = set()
    test = draw("test", cfg.synthetic_test, taken, unique=True)
    train = draw("train", cfg.synthetic_train, taken, unique=False)
    return name, train, test


# ---------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------


def _file_name(path: Path) -> str:
    """Source name of a local file: `<parent dir>/<file>` (stable across machines,
    unlike an absolute path, and distinct for gsm8k/test.jsonl vs math500/test.jsonl)."""
    return f"{path.parent.name}/{path.name}"


def _split_file(directory: Path, split: str) -> Path | None:
    found = [directory / f"{split}{suf}" for suf in _SUFFIXES if (directory / f"{split}{suf}").is_file()]
    if len(found) > 1:
        raise DataError(f"{directory}: both {found[0].name} and {found[1].name} exist; keep one")
    return found[0] if found else None


@dataclass(frozen=True)
class _Part:
    """Parsed rows of one source file (or hub split)."""

    name: str
    layout: str
    items: list[tuple[str, str, str | None]]  # (question, ground truth, solution) in source order


def _parse_file(path: Path, layout: str) -> _Part:
    layout, items = parse_rows(read_rows(path), layout, str(path))
    return _Part(_file_name(path), layout, items)


def _hub_parts(hub_id: str, config: str | None, layout: str) -> dict[str, _Part]:
    """Splits of a hub dataset (train and, if it has one, test)."""
    try:
        import datasets  # lazy: an optional extra, slow to import
    except ImportError:
        raise DataError(
            f"data source {hub_id!r} is not a local path, and loading it from the hub needs the "
            "`datasets` package (pip install 'qerl[hub]')"
        ) from None
    try:
        loaded = datasets.load_dataset(hub_id, config)
    except Exception as e:  # noqa: BLE001 - network, auth and missing-repo errors vary
        raise DataError(
            f"data source {hub_id!r} is not a local path and could not be loaded from the hub "
            f"(config {config!r}): {type(e).__name__}: {e}. Without network, pass a local .jsonl/.parquet file"
        ) from None
    parts = {}
    for split in ("train", "test"):
        if split in loaded:
            origin = f"{hub_id}[{split}]"
            rows = [(f"{origin}: row {i}", dict(r)) for i, r in enumerate(loaded[split])]
            lay, items = parse_rows(rows, layout, origin)
            parts[split] = _Part(f"{hub_id}:{config}" if config else hub_id, lay, items)
    if "train" not in parts:
        raise DataError(f"hub dataset {hub_id!r} has no 'train' split (splits: {list(loaded)})")
    return parts


def _load_source(source: str, layout: str, hub_config: str | None) -> dict[str, _Part]:
    """{"train": part, "test": part?} of one source; a missing test part means "split me"."""
    path = Path(source).expanduser()
    if path.is_dir():
        train, test = _split_file(path, "train"), _split_file(path, "test")
        if train is None:
            raise DataError(f"{path}: no train.jsonl or train.parquet in this directory")
        parts = {"train": _parse_file(train, layout)}
        if test is not None:
            parts["test"] = _parse_file(test, layout)
        return parts
    if path.suffix in _SUFFIXES or path.exists() or source.startswith((".", "/", "~")):
        return {"train": _parse_file(path, layout)}  # a missing local file fails here, named
    return _hub_parts(source, hub_config, layout)


def _examples(part: _Part, split: str, indices: Iterable[int]) -> list[Example]:
    grader = resolve_grader(part.layout)
    return [
        Example(stable_id(part.name, split, i), part.name, split, i, part.items[i][0], part.items[i][1], grader,
                solution=part.items[i][2])
        for i in indices
    ]


def _held_out(name: str, index: int, fraction: float) -> bool:
    """Deterministic test membership of row `index` of a single-file source."""
    return int(stable_id(name, "holdout", index), 16) / 16**16 < fraction


def real_examples(cfg: DataConfig) -> tuple[str, str, list[Example], list[Example]]:
    """(source description, layout, train, test) of a file / directory / hub source."""
    parts = _load_source(cfg.source, cfg.layout, cfg.hub_config)
    train_part = parts["train"]
    test_part = parts.get("test")
    if cfg.test_source is not None:
        test_parts = _load_source(cfg.test_source, cfg.layout, cfg.hub_config)
        test_part = test_parts.get("test", test_parts["train"])
    if test_part is None:  # one file: hold out a deterministic share by row hash
        held = [_held_out(train_part.name, i, cfg.test_fraction) for i in range(len(train_part.items))]
        train = _examples(train_part, "train", (i for i, h in enumerate(held) if not h))
        test = _examples(train_part, "test", (i for i, h in enumerate(held) if h))
    else:
        if resolve_grader(test_part.layout) != resolve_grader(train_part.layout):
            raise DataError(
                f"train source {train_part.name} ({train_part.layout}) and test source "
                f"{test_part.name} ({test_part.layout}) need different graders"
            )
        train = _examples(train_part, "train", range(len(train_part.items)))
        test = _examples(test_part, "test", range(len(test_part.items)))
    return train_part.name, train_part.layout, train, test


# ---------------------------------------------------------------------------------
# Writing and reading prepared files
# ---------------------------------------------------------------------------------


def to_table(examples: list[Example], metadata: dict[str, str]) -> pa.Table:
    """Arrow table of prepared rows with `PREPARED_SCHEMA` and file-level metadata."""
    columns = {f.name: [getattr(e, f.name) for e in examples] for f in PREPARED_SCHEMA}
    schema = PREPARED_SCHEMA.with_metadata({k: str(v) for k, v in metadata.items()})
    return pa.Table.from_pydict(columns, schema=schema)


def _write(table: pa.Table, path: Path) -> None:
    # Fixed writer options (no statistics timestamps exist in Parquet; created_by names
    # the pyarrow version), so equal tables give equal bytes.
    pq.write_table(table, path, compression="zstd", compression_level=3, write_statistics=True)


def prepare(cfg: DataConfig, seed: int, out_dir: Path) -> dict:
    """Build `out_dir/train.parquet` and `out_dir/test.parquet` from `cfg`.

    Both splits are fully parsed and validated first; any bad input raises `DataError`
    and writes nothing. `max_train` / `max_test` keep the first N rows in source order.
    Returns a summary: source, layout, grader, and per split its path and row count.
    """
    if cfg.source == "synthetic":
        if cfg.layout not in ("auto", "arith"):
            raise DataError(f"data.layout={cfg.layout!r} does not apply to the synthetic source (it is arith)")
        name, train, test = synthetic_examples(cfg, seed)
        layout = "arith"
    else:
        name, layout, train, test = real_examples(cfg)
    if cfg.max_train is not None:
        train = train[: cfg.max_train]
    if cfg.max_test is not None:
        test = test[: cfg.max_test]
    if not train:
        raise DataError(f"{name}: no training rows")
    if not test:
        raise DataError(f"{name}: no test rows (set data.test_source or a larger data.test_fraction)")
    meta = {"qerl.prepared_version": PREPARED_VERSION, "qerl.source": name, "qerl.layout": layout,
            "qerl.seed": str(seed)}  # fmt: skip
    tables = {"train": to_table(train, meta), "test": to_table(test, meta)}
    out_dir = Path(out_dir)
    paths = {split: out_dir / f"{split}.parquet" for split in tables}
    # Both temporaries are written before either is renamed into place, and test.parquet (the
    # stage's done-marker, `stages.registry`) is committed last: the old marker goes first, then
    # train is renamed (inner block), then test. A kill at any point leaves either the old pair,
    # or no marker (so the stage runs again), never a marker beside a missing or stale train.
    with atomic_path(paths["test"]) as tmp_test:
        with atomic_path(paths["train"]) as tmp_train:
            _write(tables["train"], tmp_train)
            _write(tables["test"], tmp_test)
            paths["test"].unlink(missing_ok=True)
    return {
        "source": name,
        "layout": layout,
        "grader": resolve_grader(layout),
        "seed": seed,
        **{split: {"path": str(paths[split]), "rows": tables[split].num_rows} for split in tables},
    }


def load_prepared(path: str | Path) -> list[dict]:
    """Rows of a prepared Parquet file as dicts, after checking its columns and types."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"prepared file not found: {path}")
    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    for field in PREPARED_SCHEMA:
        if field.name not in table.schema.names:
            if field.name in _ADDED_COLUMNS:  # a file of an earlier PREPARED_VERSION: the column is null
                table = table.append_column(field, pa.nulls(table.num_rows, field.type))
                continue
            raise DataError(f"{path}: missing column {field.name!r}")
        actual = table.schema.field(field.name).type
        if actual != field.type:
            raise DataError(f"{path}: column {field.name!r} has type {actual}, expected {field.type}")
    rows = table.select(PREPARED_SCHEMA.names).to_pylist()
    for i, row in enumerate(rows):
        if row["grader"] not in ("gsm8k", "math"):
            raise DataError(f"{path}: row {i}: field 'grader' is {row['grader']!r}, expected gsm8k or math")
        for key in ("prompt_id", "question", "ground_truth"):
            if not row[key]:
                raise DataError(f"{path}: row {i}: field {key!r} is empty")
    return rows
