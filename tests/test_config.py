"""The typed config: defaults, YAML + overrides, and clear errors naming the culprit."""

from __future__ import annotations

import pytest
import yaml

from qerl_lib.config import ConfigError, QerlConfig, describe, load_config, save_config


def test_defaults_validate_and_every_field_is_documented():
    cfg = load_config()
    assert isinstance(cfg, QerlConfig)
    rows = describe()
    assert len(rows) > 60
    undocumented = [key for key, _, doc in rows if not doc]
    assert undocumented == []


def test_yaml_and_overrides_merge(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"rollout": {"group_size": 8}, "algo": {"loss": "grpo", "beta": 0.04}}))
    cfg = load_config(path, ["rollout.temperature=0.7", "aqn.enabled=false"])
    assert cfg.rollout.group_size == 8 and cfg.rollout.temperature == 0.7
    assert cfg.algo.loss == "grpo" and cfg.algo.beta == 0.04 and cfg.aqn.enabled is False


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["run.steps=7", "lora.r=8"])
    save_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == cfg


def test_unknown_key_names_the_key_and_file(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump({"rollout": {"grup_size": 8}}))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "rollout.grup_size" in str(e.value) and str(path) in str(e.value)


def test_unknown_section_and_bad_value_are_named():
    with pytest.raises(ConfigError, match="unknown key 'optimiser'"):
        load_config(None, {"optimiser": {"lr": 1}})
    with pytest.raises(ConfigError, match="rollout.group_size"):
        load_config(None, ["rollout.group_size=0"])
    with pytest.raises(ConfigError, match="algo.loss"):
        load_config(None, ["algo.loss=ppo"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["rollout.group_size"])


def test_vllm_rank_must_fit():
    with pytest.raises(ConfigError, match="vllm_max_lora_rank"):
        load_config(None, ["rollout.backend=vllm", "lora.r=32", "rollout.vllm_max_lora_rank=16"])


def test_eval_base_off_drops_only_the_step_0_evaluation():
    from qerl_lib.stages.registry import eval_steps

    assert eval_steps(60, 30) == [0, 30, 60]
    assert eval_steps(60, 30, base=False) == [30, 60]
    assert eval_steps(6, 0, base=False) == [6]
