"""The rollout record: validated on write and read, atomic, errors name file, row and field."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from qerl_lib.schema import (
    ROLLOUT_SCHEMA, SCHEMA_VERSION, SchemaError, read_metadata, read_rollouts, to_table, write_rollouts,
)


def row(**kw):
    base = dict(
        step=0, prompt_id="p0", group_id="g0", sample_idx=0, prompt="What is 1 + 1?", prompt_text="<q>",
        prompt_token_ids=[1, 2, 3], completion_text="#### 2", completion_token_ids=[4, 5],
        sampling_logprobs=[-0.1, -0.2], finish_reason="stop", truncated=False, ground_truth="2",
        policy_version=0, adapter_hash="", aqn_sigma=0.0, aqn_seed=1, seed=123, temperature=1.0,
        top_p=1.0, max_new_tokens=8,
    )
    base.update(kw)
    return base


def test_round_trip_with_metadata(tmp_path):
    path = tmp_path / "r.parquet"
    write_rollouts(to_table([row(), row(sample_idx=1)]), path, {"base_model": "m", "git_commit": "abc"})
    table = read_rollouts(path)
    assert table.schema == ROLLOUT_SCHEMA and table.num_rows == 2
    meta = read_metadata(path)
    assert meta["schema_version"] == SCHEMA_VERSION and meta["base_model"] == "m"


def test_misaligned_logprobs_name_row_and_field(tmp_path):
    path = tmp_path / "r.parquet"
    with pytest.raises(SchemaError, match=r"row 1: completion_token_ids has 2 tokens but sampling_logprobs has 1"):
        write_rollouts(to_table([row(), row(sampling_logprobs=[-0.1])]), path, {})
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_wrong_type_and_unknown_field_are_named():
    with pytest.raises(SchemaError, match=r"row 1: field 'step'"):
        to_table([row(), row(step="seven")])
    with pytest.raises(SchemaError, match=r"row 0: unknown field"):
        to_table([row(colour="red")])


def test_null_required_and_scored_fields(tmp_path):
    with pytest.raises(SchemaError, match=r"row 0: field 'ground_truth' is null"):
        write_rollouts(to_table([row(ground_truth=None)]), tmp_path / "a.parquet", {})
    with pytest.raises(SchemaError, match=r"row 0: field 'reward_correct' is null"):
        write_rollouts(to_table([row()]), tmp_path / "b.parquet", {}, scored=True)


def test_wrong_schema_version_is_refused(tmp_path):
    path = tmp_path / "old.parquet"
    table = to_table([row()]).replace_schema_metadata({"qerl.schema_version": "0"})
    pq.write_table(table, path)
    with pytest.raises(SchemaError, match=r"old.parquet: schema_version '0', expected '1'"):
        read_rollouts(path)


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing rollout file"):
        read_rollouts(tmp_path / "none.parquet")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(SchemaError, match="bad.parquet: not a readable Parquet file"):
        read_rollouts(bad)


def test_a_failed_write_keeps_the_previous_file(tmp_path):
    path = tmp_path / "r.parquet"
    write_rollouts(to_table([row()]), path, {})
    before = path.read_bytes()
    with pytest.raises(SchemaError):
        write_rollouts(to_table([row(finish_reason="eos")]), path, {})
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.parquet"]
