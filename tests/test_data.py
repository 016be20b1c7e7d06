"""The prepare stage: real layouts from temp files, the synthetic set, and bad input."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from qerl_lib.config import DataConfig
from qerl_lib.data import PREPARED_SCHEMA, DataError, load_prepared, prepare, synthetic_examples
from qerl_lib.rewards import is_correct, last_boxed, normalize_number
from qerl_lib.seeds import stable_id

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
if not DATA.is_dir():
    DATA = Path("/work/shared/data")


def _rows(rel: str, n: int) -> list[dict]:
    path = DATA / rel
    if not path.is_file():
        pytest.skip(f"real data not present: {path}")
    with path.open() as fh:
        return [json.loads(line) for _, line in zip(range(n), fh)]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _no_parquet(out: Path) -> bool:
    return not out.exists() or not any(out.iterdir())


# --- real layouts ------------------------------------------------------------------


def test_gsm8k_directory_source(tmp_path):
    train_rows, test_rows = _rows("gsm8k/train.jsonl", 40), _rows("gsm8k/test.jsonl", 12)
    src = tmp_path / "gsm8k"
    _write_jsonl(src / "train.jsonl", train_rows)
    _write_jsonl(src / "test.jsonl", test_rows)
    out = tmp_path / "prepared"
    summary = prepare(DataConfig(source=str(src), max_train=30, max_test=None), seed=0, out_dir=out)
    assert summary["layout"] == "gsm8k" and summary["grader"] == "gsm8k"
    assert summary["train"]["rows"] == 30 and summary["test"]["rows"] == 12
    train, test = load_prepared(out / "train.parquet"), load_prepared(out / "test.parquet")
    assert pq.read_schema(out / "train.parquet").remove_metadata() == PREPARED_SCHEMA
    # first N in source order, ground truth = the number after ####, commas stripped
    for i, row in enumerate(train):
        raw = train_rows[i]
        assert (row["source_index"], row["question"], row["split"]) == (i, raw["question"], "train")
        assert row["ground_truth"] == normalize_number(raw["answer"].rsplit("####", 1)[1])
        assert row["prompt_id"] == stable_id("gsm8k/train.jsonl", "train", i)
        assert row["source"] == "gsm8k/train.jsonl" and row["grader"] == "gsm8k" and row["level"] is None
        assert row["solution"] == raw["answer"].strip()  # the worked solution, for GPTQ's calibration
    assert [r["source"] for r in test] == ["gsm8k/test.jsonl"] * 12
    assert len({r["prompt_id"] for r in train + test}) == 42


def test_gsm8k_ground_truth_with_thousands_separator(tmp_path):
    rows = [r for r in _rows("gsm8k/test.jsonl", 1319) if "," in r["answer"].rsplit("####", 1)[1]][:3]
    src = _write_jsonl(tmp_path / "g" / "train.jsonl", rows * 4)
    test = _write_jsonl(tmp_path / "g2" / "test.jsonl", rows)
    prepare(DataConfig(source=str(src), test_source=str(test)), seed=0, out_dir=tmp_path / "out")
    for row in load_prepared(tmp_path / "out" / "test.parquet"):
        assert "," not in row["ground_truth"] and int(row["ground_truth"]) >= 1000


def test_math_layout_single_file_split_and_answers(tmp_path):
    # MATH train has no answer column: the ground truth is the last \boxed of the solution
    rows = _rows("math/train.jsonl", 60)
    src = _write_jsonl(tmp_path / "math" / "train.jsonl", rows)
    out = tmp_path / "out"
    cfg = DataConfig(source=str(src), test_fraction=0.25, max_train=None, max_test=None)
    summary = prepare(cfg, seed=0, out_dir=out)
    assert summary["layout"] == "math" and summary["grader"] == "math"
    train, test = load_prepared(out / "train.parquet"), load_prepared(out / "test.parquet")
    assert len(train) + len(test) == 60 and 5 <= len(test) <= 25
    indices = sorted(r["source_index"] for r in train + test)
    assert indices == list(range(60))  # every row lands in exactly one split
    for row in train + test:
        raw = rows[row["source_index"]]
        assert row["question"] == raw["problem"] and row["ground_truth"] == last_boxed(raw["solution"])
        assert row["grader"] == "math" and row["solution"] == raw["solution"]
    # MATH-500 has an answer column, which wins over the solution
    m500 = _rows("math500/test.jsonl", 20)
    test_src = _write_jsonl(tmp_path / "math500" / "test.jsonl", m500)
    prepare(DataConfig(source=str(src), test_source=str(test_src), max_test=None), seed=0, out_dir=out)
    test = load_prepared(out / "test.parquet")
    assert [r["ground_truth"] for r in test] == [r["answer"] for r in m500]
    assert all(is_correct(last_boxed(m500[i]["solution"]), r["ground_truth"], "math") for i, r in enumerate(test))


def test_parquet_source(tmp_path):
    rows = _rows("gsm8k/test.jsonl", 20)
    src = tmp_path / "pq" / "train.parquet"
    src.parent.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), src)
    out = tmp_path / "out"
    summary = prepare(DataConfig(source=str(src), test_fraction=0.3), seed=0, out_dir=out)
    assert summary["train"]["rows"] + summary["test"]["rows"] == 20


def test_prepare_is_deterministic_for_real_data(tmp_path):
    src = _write_jsonl(tmp_path / "g" / "train.jsonl", _rows("gsm8k/train.jsonl", 50))
    a, b = tmp_path / "a", tmp_path / "b"
    prepare(DataConfig(source=str(src)), seed=3, out_dir=a)
    prepare(DataConfig(source=str(src)), seed=3, out_dir=b)
    for split in ("train", "test"):
        assert (a / f"{split}.parquet").read_bytes() == (b / f"{split}.parquet").read_bytes()


# --- synthetic ---------------------------------------------------------------------


def test_synthetic_deterministic_bytes(tmp_path):
    cfg = DataConfig(synthetic_levels=[1, 2], synthetic_train=64, synthetic_test=16)
    prepare(cfg, seed=7, out_dir=tmp_path / "a")
    prepare(cfg, seed=7, out_dir=tmp_path / "b")
    prepare(cfg, seed=8, out_dir=tmp_path / "c")
    for split in ("train", "test"):
        a, b, c = ((tmp_path / d / f"{split}.parquet").read_bytes() for d in "abc")
        assert a == b and a != c


def test_synthetic_levels_and_answers():
    cfg = DataConfig(synthetic_levels=[1, 2, 3, 4], synthetic_train=400, synthetic_test=40, synthetic_style="plain")
    _, train, test = synthetic_examples(cfg, seed=0)
    assert {e.level for e in train} == {1, 2, 3, 4}
    for e in train + test:
        expr = e.question.removeprefix("What is ").removesuffix("?")
        assert int(e.ground_truth) == eval(expr)  # noqa: S307 - our own "a op b" strings
        nums = [int(t) for t in expr.split() if t.lstrip("-").isdigit()]
        if e.level == 1:
            assert "+" in expr and all(0 <= n <= 9 for n in nums)
        elif e.level == 2:
            assert ("+" in expr or "-" in expr) and all(10 <= n <= 99 for n in nums) and int(e.ground_truth) >= 0
        elif e.level == 3:
            assert ("*" in expr and 10 <= nums[0] <= 99 and 2 <= nums[1] <= 9) or len(nums) == 3
        else:
            assert 100 <= nums[0] <= 999
        assert e.grader == "gsm8k"


def test_synthetic_words_style_states_the_numbers():
    cfg = DataConfig(synthetic_levels=[2], synthetic_train=50, synthetic_test=10, synthetic_style="words")
    _, train, _ = synthetic_examples(cfg, seed=0)
    assert all(not e.question.startswith("What is") and e.question.endswith("?") for e in train)
    mixed = DataConfig(synthetic_levels=[2], synthetic_train=200, synthetic_test=10, synthetic_style="mixed")
    questions = [e.question for e in synthetic_examples(mixed, seed=0)[1]]
    assert 50 < sum(q.startswith("What is") for q in questions) < 150


def test_synthetic_train_test_disjoint(tmp_path):
    # level 1 has only 100 distinct sums: the 64 test ones must never appear in train,
    # whatever the wording (a word problem with the same numbers is the same problem)
    cfg = DataConfig(synthetic_levels=[1], synthetic_train=512, synthetic_test=64, max_train=None, max_test=None)
    prepare(cfg, seed=0, out_dir=tmp_path)
    train, test = load_prepared(tmp_path / "train.parquet"), load_prepared(tmp_path / "test.parquet")
    assert len(train) == 512 and len(test) == 64

    def key(q):
        nums = tuple(int(t.strip("?.,")) for t in q.split() if t.strip("?.,").isdigit())
        return nums

    test_keys = [key(r["question"]) for r in test]
    assert len(set(test_keys)) == 64  # distinct test problems
    assert not set(test_keys) & {key(r["question"]) for r in train}
    assert {r["split"] for r in train} == {"train"} and {r["split"] for r in test} == {"test"}
    assert all(r["level"] == 1 for r in train + test)
    assert len({r["prompt_id"] for r in train + test}) == 576


def test_synthetic_bad_levels_and_too_small_space(tmp_path):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="synthetic_levels"):  # the config refuses it first
        DataConfig(synthetic_levels=[9])
    with pytest.raises(DataError, match="unknown level"):  # and prepare on its own, past the config
        prepare(DataConfig().model_copy(update={"synthetic_levels": [9]}), seed=0, out_dir=tmp_path)
    with pytest.raises(DataError, match="100 distinct"):
        prepare(DataConfig(synthetic_levels=[1], synthetic_test=100), seed=0, out_dir=tmp_path)
    assert _no_parquet(tmp_path)


# --- bad input ---------------------------------------------------------------------


def _prepare_fails(tmp_path, source: str, **kw) -> str:
    out = tmp_path / "out"
    with pytest.raises(DataError) as err:
        prepare(DataConfig(source=source, **kw), seed=0, out_dir=out)
    assert _no_parquet(out), "a failed prepare must leave no output"
    return str(err.value)


def test_missing_file(tmp_path):
    msg = _prepare_fails(tmp_path, str(tmp_path / "nope.jsonl"))
    assert "not found" in msg and "nope.jsonl" in msg


def test_malformed_json_line_names_file_and_line(tmp_path):
    src = tmp_path / "bad" / "train.jsonl"
    rows = _rows("gsm8k/train.jsonl", 5)
    src.parent.mkdir()
    src.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]) + '{"question": "x", "answer": \n')
    msg = _prepare_fails(tmp_path, str(src))
    assert str(src) in msg and "line 4" in msg and "malformed JSON" in msg


def test_answer_without_hashes_names_row_and_field(tmp_path):
    rows = _rows("gsm8k/train.jsonl", 6)
    rows[4] = {**rows[4], "answer": rows[4]["answer"].replace("####", "answer:")}
    src = _write_jsonl(tmp_path / "g" / "train.jsonl", rows)
    msg = _prepare_fails(tmp_path, str(src))
    assert str(src) in msg and "line 5" in msg and "'answer'" in msg and "####" in msg


def test_empty_answer_names_row_and_field(tmp_path):
    rows = _rows("gsm8k/train.jsonl", 6)
    rows[2] = {**rows[2], "answer": "  "}
    src = _write_jsonl(tmp_path / "g" / "train.jsonl", rows)
    msg = _prepare_fails(tmp_path, str(src))
    assert "line 3" in msg and "'answer'" in msg and "empty" in msg


def test_math_row_without_boxed_names_field(tmp_path):
    rows = _rows("math/train.jsonl", 4)
    rows[1] = {**rows[1], "solution": "no final answer here"}
    src = _write_jsonl(tmp_path / "m" / "train.jsonl", rows)
    msg = _prepare_fails(tmp_path, str(src))
    assert "line 2" in msg and "'solution'" in msg and "boxed" in msg


def test_unknown_layout_names_columns(tmp_path):
    src = _write_jsonl(tmp_path / "x" / "train.jsonl", [{"prompt": "hi", "target": "1"}])
    msg = _prepare_fails(tmp_path, str(src))
    assert "unknown layout" in msg and "prompt" in msg and "target" in msg


def test_bad_test_file_writes_neither_split(tmp_path):
    # the train file is fine, the test file is broken: nothing at all may be written
    src = tmp_path / "d"
    _write_jsonl(src / "train.jsonl", _rows("gsm8k/train.jsonl", 10))
    bad = _rows("gsm8k/test.jsonl", 3)
    bad[2] = {"question": bad[2]["question"]}
    _write_jsonl(src / "test.jsonl", bad)
    msg = _prepare_fails(tmp_path, str(src))
    assert "test.jsonl" in msg and "line 3" in msg and "'answer'" in msg


def test_failed_prepare_keeps_previous_output(tmp_path):
    out = tmp_path / "out"
    prepare(DataConfig(synthetic_train=8, synthetic_test=4), seed=0, out_dir=out)
    before = (out / "train.parquet").read_bytes()
    with pytest.raises(DataError):
        prepare(DataConfig(source=str(tmp_path / "missing.jsonl")), seed=0, out_dir=out)
    assert (out / "train.parquet").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["test.parquet", "train.parquet"]  # no temporaries


def test_directory_without_train_file(tmp_path):
    (tmp_path / "empty").mkdir()
    msg = _prepare_fails(tmp_path, str(tmp_path / "empty"))
    assert "no train.jsonl" in msg


def test_hub_source_gives_clear_error_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    msg = _prepare_fails(tmp_path, "no-such-owner/no-such-dataset")
    assert "no-such-owner/no-such-dataset" in msg and "hub" in msg


def test_load_prepared_validates_columns(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt_id": ["a"], "question": ["q"]}), path)
    with pytest.raises(DataError, match="missing column 'source'"):
        load_prepared(path)
    with pytest.raises(DataError, match="not found"):
        load_prepared(tmp_path / "none.parquet")


def test_a_version_1_file_reads_with_null_solutions(tmp_path):
    """Prepared files written before the `solution` column (PREPARED_VERSION 1) still load, as
    workspaces that resume read them: the column is null, every other one as written."""
    out = tmp_path / "p"
    prepare(DataConfig(source="synthetic", synthetic_train=4, synthetic_test=2), seed=0, out_dir=out)
    rows = load_prepared(out / "train.parquet")
    assert [r["solution"] for r in rows] == [None] * 4  # arithmetic has no worked solution
    old = pq.read_table(out / "train.parquet").drop(["solution"])
    pq.write_table(old, tmp_path / "v1.parquet")
    assert load_prepared(tmp_path / "v1.parquet") == rows
