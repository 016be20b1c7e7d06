"""The one place that declares the rollout record (one Parquet row per sample).

The same schema serves three files: the rollout stage writes it with the reward
columns null, the reward stage fills them (`scored.parquet`), and evaluation writes
it with `step` = the evaluated adapter's step. Every write validates (types, nulls,
aligned lengths) and goes through a temporary name; every read checks
`schema_version` and the columns, and names the file and row of any fault.

What does not belong in the bytes: wall-clock timing and the orchestrator's run id
change from run to run, while a rollout file must be byte-identical when re-made
from the same seeds (resume, `dvc repro`). Those go to the `provenance.json` beside
the Parquet file (`write_provenance`), which `qerl audit` joins back in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from qerl_lib.io import atomic_path, atomic_write_json

SCHEMA_VERSION = "1"

# (name, type, nullable, doc)
_FIELDS: list[tuple[str, pa.DataType, bool, str]] = [
    ("step", pa.int32(), False, "RL step whose policy sampled the row (eval: the adapter's step)"),
    ("prompt_id", pa.string(), False, "stable id of the prompt (hash of source and index)"),
    ("group_id", pa.string(), False, "id of the GRPO group: (step, prompt_id)"),
    ("sample_idx", pa.int32(), False, "index of the sample within its group, 0..G-1"),
    ("prompt", pa.string(), False, "the problem text as in the dataset"),
    ("prompt_text", pa.string(), False, "the exact text fed to the model (chat template applied)"),
    ("prompt_token_ids", pa.list_(pa.int32()), False, "token ids of prompt_text"),
    ("completion_text", pa.string(), False, "decoded completion (special tokens skipped)"),
    ("completion_token_ids", pa.list_(pa.int32()), False, "sampled token ids, EOS included when emitted"),
    ("sampling_logprobs", pa.list_(pa.float32()), False,
     "log softmax(logits / temperature) of each sampled token, as the rollout engine computed it"),
    ("finish_reason", pa.string(), False, "`stop` (EOS) or `length` (hit max_new_tokens)"),
    ("truncated", pa.bool_(), False, "finish_reason == 'length'"),
    ("ground_truth", pa.string(), False, "reference final answer"),
    ("extracted_answer", pa.string(), True, "answer parsed from the completion (null: none found / not scored)"),
    ("reward_correct", pa.float32(), True, "correctness component"),
    ("reward_format", pa.float32(), True, "format component"),
    ("reward_overlong", pa.float32(), True, "overlong penalty component (<= 0)"),
    ("reward", pa.float32(), True, "total reward"),
    ("advantage", pa.float32(), True, "group-normalised advantage"),
    ("kept", pa.bool_(), True, "False when dynamic sampling drops the group or overlong filtering masks the row"),
    ("policy_version", pa.int32(), False, "adapter step the row was sampled with"),
    ("adapter_hash", pa.string(), False, "sha256 of the adapter weights file ('' for the bare base)"),
    ("aqn_sigma", pa.float32(), False, "AQN noise std applied to the RMSNorm weights during sampling"),
    ("aqn_seed", pa.int64(), False, "AQN seed; the noise is a function of (aqn_seed, step, module)"),
    ("seed", pa.int64(), False, "sampling seed of this row: derive_seed(seed, step, prompt_id, sample_idx)"),
    ("temperature", pa.float32(), False, "sampling temperature (0 = greedy)"),
    ("top_p", pa.float32(), False, "nucleus mass"),
    ("max_new_tokens", pa.int32(), False, "completion length cap"),
]

ROLLOUT_SCHEMA = pa.schema([pa.field(n, t, nullable=nl) for n, t, nl, _ in _FIELDS])
FIELD_DOCS = {n: d for n, _, _, d in _FIELDS}
REWARD_COLUMNS = ["extracted_answer", "reward_correct", "reward_format", "reward_overlong", "reward", "advantage", "kept"]

# File-level metadata keys (all strings).
META_KEYS = [
    "schema_version", "kind", "base_model", "quant_scheme", "checkpoint_hash",
    "torch", "transformers", "peft", "vllm", "git_commit", "config_hash",
]


class SchemaError(ValueError):
    """A rollout file or table that breaks the schema; the message names file, row and field."""


def _check_table(table: pa.Table, where: str, scored: bool) -> None:
    missing = [n for n in ROLLOUT_SCHEMA.names if n not in table.column_names]
    if missing:
        raise SchemaError(f"{where}: missing column(s) {missing}")
    extra = [n for n in table.column_names if n not in ROLLOUT_SCHEMA.names]
    if extra:
        raise SchemaError(f"{where}: unknown column(s) {extra}")
    required = [f.name for f in ROLLOUT_SCHEMA if not f.nullable]
    if scored:
        required += [c for c in REWARD_COLUMNS if c != "extracted_answer"]
    for name in required:
        col = table.column(name)
        if col.null_count:
            row = next(i for i, v in enumerate(col.to_pylist()) if v is None)
            raise SchemaError(f"{where}: row {row}: field {name!r} is null")
    toks = table.column("completion_token_ids").to_pylist()
    lps = table.column("sampling_logprobs").to_pylist()
    for i, (t, lp) in enumerate(zip(toks, lps)):
        if len(t) != len(lp):
            raise SchemaError(
                f"{where}: row {i}: completion_token_ids has {len(t)} tokens but sampling_logprobs has {len(lp)}"
            )
    for i, (fr, tr) in enumerate(zip(table.column("finish_reason").to_pylist(), table.column("truncated").to_pylist())):
        if fr not in ("stop", "length"):
            raise SchemaError(f"{where}: row {i}: finish_reason {fr!r} is not 'stop' or 'length'")
        if tr != (fr == "length"):
            raise SchemaError(f"{where}: row {i}: truncated={tr} disagrees with finish_reason={fr!r}")


def to_table(rows: list[dict[str, Any]], where: str = "rollout rows") -> pa.Table:
    """Build a schema-typed table from row dicts (reward columns may be absent: null)."""
    for i, row in enumerate(rows):
        unknown = set(row) - set(ROLLOUT_SCHEMA.names)
        if unknown:
            raise SchemaError(f"{where}: row {i}: unknown field(s) {sorted(unknown)}")
    cols = {}
    for f in ROLLOUT_SCHEMA:
        values = [row.get(f.name) for row in rows]
        try:
            cols[f.name] = pa.array(values, type=f.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
            bad = next((i for i, v in enumerate(values) if not _fits(v, f.type)), None)
            raise SchemaError(f"{where}: row {bad}: field {f.name!r}: {e}") from None
    return pa.Table.from_pydict(cols, schema=ROLLOUT_SCHEMA)


def _fits(value: Any, typ: pa.DataType) -> bool:
    try:
        pa.array([value], type=typ)
        return True
    except Exception:
        return False


def write_rollouts(table: pa.Table, path: str | Path, metadata: dict[str, str], scored: bool = False) -> Path:
    """Validate and write atomically. `metadata` gets `schema_version` added."""
    path = Path(path)
    table = table.cast(ROLLOUT_SCHEMA) if table.schema != ROLLOUT_SCHEMA else table
    _check_table(table, str(path), scored)
    meta = {k: str(v) for k, v in metadata.items()}
    meta["schema_version"] = SCHEMA_VERSION
    meta["kind"] = "scored" if scored else meta.get("kind", "rollout")
    table = table.replace_schema_metadata({("qerl." + k): v for k, v in sorted(meta.items())})
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return path


def read_metadata(path: str | Path) -> dict[str, str]:
    raw = pq.read_schema(path).metadata or {}
    return {k.decode()[5:]: v.decode() for k, v in raw.items() if k.startswith(b"qerl.")}


def read_rollouts(path: str | Path, scored: bool = False) -> pa.Table:
    """Read and validate a rollout (or scored) file; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"missing rollout file: {path}")
    try:
        meta = read_metadata(path)
        table = pq.read_table(path)
    except pa.ArrowException as e:
        raise SchemaError(f"{path}: not a readable Parquet file ({e})") from None
    version = meta.get("schema_version")
    if version != SCHEMA_VERSION:
        raise SchemaError(f"{path}: schema_version {version!r}, expected {SCHEMA_VERSION!r}")
    _check_table(table, str(path), scored)
    return table.replace_schema_metadata(None).cast(ROLLOUT_SCHEMA)


def write_provenance(parquet_path: str | Path, info: dict[str, Any]) -> Path:
    """Run-dependent facts (timing, flow run id, host) beside a Parquet file."""
    return atomic_write_json(Path(parquet_path).with_name("provenance.json"), info)


def read_provenance(parquet_path: str | Path) -> dict[str, Any]:
    p = Path(parquet_path).with_name("provenance.json")
    return json.loads(p.read_text()) if p.is_file() else {}
