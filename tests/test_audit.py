"""`qerl audit` over a produced run: per-step summary, zero-variance groups, one prompt across
steps, the lineage of a row, exports; and the README's plain DuckDB / Polars queries."""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import PROJECT_ROOT

from qerl_lib.audit import Audit, AuditError
from qerl_lib.cli import main
from qerl_lib.paths import Layout

STEPS = 2


def rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def test_summary_agrees_with_the_stage_metrics(reference_run):
    lay = Layout(reference_run)
    res = Audit(reference_run).summary().as_dicts()
    assert [r["step"] for r in res] == list(range(STEPS))
    for r in res:
        i = r["step"]
        rew = json.loads(lay.reward_metrics(i).read_text())
        upd = json.loads(lay.update_metrics(i).read_text())
        scored = rows(lay.scored(i))
        assert r["n"] == len(scored) == 8 and r["groups"] == rew["groups"] == 2
        assert r["reward_mean"] == pytest.approx(rew["reward_mean"], abs=1e-6)
        assert r["reward_std"] == pytest.approx(rew["reward_std"], abs=1e-6)
        assert r["correct_rate"] == pytest.approx(rew["correct_rate"])
        assert r["truncated_rate"] == pytest.approx(rew["truncated_frac"])
        assert r["kept_frac"] == pytest.approx(rew["kept_frac"])
        assert r["len_mean"] == pytest.approx(rew["completion_len_mean"])
        assert r["len_max"] == max(len(x["completion_token_ids"]) for x in scored)
        assert r["entropy_mean"] == pytest.approx(upd["entropy"]) and r["kl"] == pytest.approx(upd["kl"])
        assert r["aqn_sigma"] == pytest.approx(upd["sigma"]) and r["policy_version"] == i


def test_zero_variance_groups(reference_run, tmp_path):
    """A workspace where one group of step 0 got equal rewards: exactly that group is listed."""
    from qerl_lib.schema import read_metadata, to_table, write_rollouts

    ws = tmp_path / "ws"
    for sub in ("rollouts", "rewards", "metrics"):
        shutil.copytree(reference_run / sub, ws / sub)
    lay = Layout(ws)
    scored = rows(lay.scored(0))
    flat = scored[0]["group_id"]
    for r in scored:
        if r["group_id"] == flat:
            r["reward"], r["advantage"], r["kept"] = 0.5, 0.0, False
    write_rollouts(to_table(scored), lay.scored(0), read_metadata(lay.scored(0)), scored=True)

    audit = Audit(ws)
    zero = audit.groups(zero_variance=True).as_dicts()
    expect = []
    for i in range(STEPS):
        by_group = defaultdict(list)
        for r in rows(lay.scored(i)):
            by_group[(r["group_id"], r["prompt_id"])].append(r["reward"])
        expect += [(i, g) for (g, _), rs in by_group.items() if len(set(rs)) == 1]
    assert sorted((z["step"], z["group_id"]) for z in zero) == sorted(expect)
    assert (0, flat) in expect
    z = next(z for z in zero if z["group_id"] == flat)
    assert z["n"] == 4 and z["reward_std"] == 0 and z["kept"] is False
    every = audit.groups(step=0).as_dicts()
    assert len(every) == 2 and {g["group_id"] for g in every} >= {flat}


def test_all_samples_of_one_prompt_across_steps(reference_run):
    lay = Layout(reference_run)
    audit = Audit(reference_run)
    train = [r for i in range(STEPS) for r in rows(lay.scored(i))]
    counts = defaultdict(set)
    for r in train:
        counts[r["prompt_id"]].add(r["step"])
    pid = max(counts, key=lambda p: (len(counts[p]), p))
    got = audit.prompt(pid).as_dicts()
    want = [r for r in train if r["prompt_id"] == pid]
    assert len(got) == len(want) and {g["kind"] for g in got} == {"train"}
    assert [(g["step"], g["sample_idx"]) for g in got] == sorted((w["step"], w["sample_idx"]) for w in want)
    assert {g["completion_text"] for g in got} == {w["completion_text"] for w in want}
    # An evaluated prompt: its sampled (k) and greedy rows at each evaluated adapter.
    ev = rows(lay.eval_samples(0))
    epid = ev[0]["prompt_id"]
    got = audit.prompt(epid).as_dicts()
    n_eval = sum(1 for k in (0, STEPS) for r in rows(lay.eval_samples(k)) if r["prompt_id"] == epid)
    assert len(got) == n_eval and {g["kind"] for g in got} == {"eval"}
    with pytest.raises(AuditError, match="appears in no rollout"):
        audit.prompt("no-such-prompt")


def test_lineage_of_a_row(dvc_repro_done):
    lay = Layout(dvc_repro_done)
    audit = Audit(dvc_repro_done)
    lin = dict(audit.lineage(step=1, row=3).rows)
    row = rows(lay.rollouts(1))[3]
    assert lin["row.prompt_id"] == row["prompt_id"] and lin["row.sample_idx"] == row["sample_idx"]
    assert lin["row.seed"] == row["seed"]
    report = json.loads((dvc_repro_done / "models/nvfp4/convert_report.json").read_text())
    assert lin["meta.checkpoint_hash"] == report["checkpoint_hash"] and lin["checkpoint.matches_workspace"] is True
    assert lin["meta.quant_scheme"] == "NVFP4A16" and lin["meta.git_commit"]
    assert lin["adapter.version"] == 1 and lin["adapter.made_by"] == "update@0"
    assert lin["adapter.sha256_matches_row"] is True and lin["adapter.trainer_state.optimizer_steps"] == 1
    assert lin["config.hash_matches_file"] is True and lin["config.file"].endswith("params.yaml")
    assert lin["dvc.stage"] == "rollout@1" and lin["dvc.out_md5_matches_file"] is True
    assert lin["param.rollout.group_size"] == 4 and lin["param.run.seed"] == 0
    assert "provenance.flow_run_id" in lin and lin["provenance.seconds"] > 0
    assert "scored.reward" in lin and "scored.advantage" in lin
    # The same row found by prompt id and sample index.
    again = dict(audit.lineage(step=1, prompt_id=row["prompt_id"], sample_idx=row["sample_idx"]).rows)
    assert again == lin
    with pytest.raises(AuditError, match="row 99 does not exist"):
        audit.lineage(step=1, row=99)


def test_cli_exports_csv_markdown_json(reference_run, tmp_path, capsys):
    out = tmp_path / "summary.csv"
    assert main(["audit", "summary", "--root", str(reference_run), "--format", "csv", "--output", str(out)]) == 0
    table = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [int(r["step"]) for r in table] == list(range(STEPS)) and "entropy_mean" in table[0]
    md = tmp_path / "zero.md"
    assert main(["audit", "groups", "--zero-variance", "--root", str(reference_run), "-f", "markdown",
                 "-o", str(md)]) == 0
    text = md.read_text()
    assert text.startswith("### zero-variance groups") and "| step | group_id | prompt_id |" in text
    capsys.readouterr()
    assert main(["audit", "sql", "select step, count(*) as n from samples group by step order by step",
                 "--root", str(reference_run), "-f", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["rows"] == [{"step": i, "n": 8} for i in range(STEPS)]
    assert main(["audit", "summary", "--root", str(reference_run)]) == 0
    assert re.search(r"^step\s+n\s+groups", capsys.readouterr().out, re.M)
    assert main(["audit", "summary", "--root", str(tmp_path)]) == 2
    assert "no rollout files" in capsys.readouterr().err


def _readme_block(language: str, marker: str) -> str:
    """The README's Audit-section code block that contains `marker`."""
    text = (PROJECT_ROOT / "README.md").read_text()
    section = text[text.index("\n## Audit"):]
    for block in re.findall(rf"```{language}\n(.*?)```", section, re.S):
        if marker in block:
            return block
    raise AssertionError(f"no {language} block with {marker!r} in README's Audit section")


def test_readme_duckdb_query_reads_the_files(reference_run, monkeypatch, capsys):
    monkeypatch.chdir(reference_run)
    exec(_readme_block("python", "import duckdb"), {})
    printed = capsys.readouterr().out
    assert "reward" in printed and "truncated" in printed


def test_readme_polars_query_reads_the_files(reference_run, monkeypatch, capsys):
    pytest.importorskip("polars")
    monkeypatch.chdir(reference_run)
    exec(_readme_block("python", "import polars"), {})
    assert "reward" in capsys.readouterr().out


def _touch_rollouts(root: Path) -> Path:
    f = Layout(root).rollouts(0)
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_bytes(b"")
    return root


def test_default_root_is_the_workspace_that_has_rollouts(tmp_path, monkeypatch):
    """In the repository root after `qerl run` (rollouts in runs/default, none at the root) audit
    reads runs/default; a root holding rollouts (after `dvc repro`) wins; with none anywhere it
    reads the DVC root, and the error names that folder and suggests --root."""
    from qerl_lib.audit import default_root

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("{}\n")
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    assert default_root() == "."  # nothing anywhere: the DVC workspace
    _touch_rollouts(tmp_path / "runs" / "default")
    assert default_root() == "runs/default"
    _touch_rollouts(tmp_path)
    assert default_root() == "."
    (tmp_path / "params.yaml").unlink()
    shutil.rmtree(tmp_path / "rollouts")
    assert default_root() == "runs/default"  # not a DVC workspace, no rollouts here


def test_cli_names_the_workspace_it_read(reference_run, tmp_path, monkeypatch, capsys):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "params.yaml").write_text("{}\n")
    (repo / "dvc.yaml").write_text("stages: {}\n")
    monkeypatch.chdir(repo)
    assert main(["audit", "summary"]) == 2  # no runs/default yet, no rollouts at the root
    err = capsys.readouterr().err
    assert f"workspace {repo}" in err and "--root" in err and "runs/default" in err
    run = repo / "runs" / "default"
    for sub in ("rollouts", "rewards", "metrics"):
        shutil.copytree(reference_run / sub, run / sub)
    assert main(["audit", "summary"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"workspace: {run}"


def test_text_output_is_rounded_and_exports_are_not(reference_run, capsys):
    """Table and Markdown cells carry at most 4 significant digits; CSV and JSON the full value."""
    from qerl_lib.tables import round_sig

    assert [round_sig(v) for v in (0.515625, -0.59375, 1234.567, 7.0, 5e-4, 1.23456e-7, 0.0)] == [
        "0.5156", "-0.5938", "1235", "7", "0.0005", "1.235e-07", "0"]
    res = Audit(reference_run).summary()
    table = res.render("table")
    digits = [len(re.sub(r"[^0-9]", "", m).lstrip("0")) for m in re.findall(r"-?\d+\.\d+", table)]
    assert digits and max(digits) <= 4
    exact = [r["reward_std"] for r in res.as_dicts()]
    assert any(len(repr(v)) > 8 for v in exact)  # the values really have more digits to drop
    as_csv = list(csv.DictReader(io.StringIO(res.render("csv"))))
    assert [float(r["reward_std"]) for r in as_csv] == exact
    assert [r["reward_std"] for r in json.loads(res.render("json"))["rows"]] == exact
    assert f"workspace `{Path(reference_run).resolve()}`" in res.render("markdown")
