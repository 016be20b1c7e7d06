"""The `qerl` command line: clear one-line errors (exit 2) that name the culprit, no partial output."""

from __future__ import annotations

from qerl_lib.cli import main


def test_config_show_lists_documented_fields(capsys):
    assert main(["config", "--show"]) == 0
    out = capsys.readouterr().out
    assert "aqn.sigma_start = 0.01" in out and "rollout.group_size" in out


def test_config_prints_resolved_yaml(capsys):
    assert main(["config", "--set", "rollout.group_size=6"]) == 0
    assert "group_size: 6" in capsys.readouterr().out


def test_unknown_key_exits_2_naming_it(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("algo:\n  los: dapo\n")
    assert main(["stage", "prepare", "--config", str(cfg), "--root", str(tmp_path / "ws")]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'algo.los'" in err and str(cfg) in err
    assert not (tmp_path / "ws" / "data").exists()


def test_missing_input_names_the_file(capsys, tmp_path):
    assert main(["stage", "reward", "--step", "3", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "rollouts/step=3/rollouts.parquet" in err
    assert not (tmp_path / "rewards").exists()


def test_rollout_without_adapter_names_it(capsys, tmp_path):
    # Prepared data exists, the adapter of step 2 does not.
    assert main(["stage", "prepare", "--root", str(tmp_path), "--set", "data.synthetic_train=8",
                 "--set", "data.synthetic_test=2"]) == 0
    assert main(["stage", "rollout", "--step", "2", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "adapters/step=2" in err
    assert not (tmp_path / "rollouts").exists()


def test_step_stage_needs_step(capsys):
    assert main(["stage", "update"]) == 2  # an input error (exit 2), not a crash (exit 1)
    assert "needs --step" in capsys.readouterr().err
