"""One full loop of every stage on a tiny random Llama, through the library and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch

from qerl_lib.config import load_config
from qerl_lib.paths import Layout
from qerl_lib.run import WorkspaceBusy, plan, run_all, workspace_lock
from qerl_lib.schema import read_metadata, read_rollouts, to_table, write_rollouts


def tiny_cfg(base, root, **extra):
    tree = {
        "run": {"root": str(root), "steps": 2},
        "model": {"base": str(base)},
        "data": {"synthetic_train": 16, "synthetic_test": 4},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8, "batch_size": 8},
        "eval": {"max_prompts": 3, "k": 2, "max_new_tokens": 8},
        "reward": {"format_weight": 0.1},  # the only reward a tiny random model earns
        "aqn": {"enabled": True, "stages": 2},
    }
    for section, values in extra.items():
        tree.setdefault(section, {}).update(values)
    return load_config(None, tree)


@pytest.fixture(scope="module")
def finished_run(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("loop")
    cfg = tiny_cfg(tiny_llama_dir, root)
    records = run_all(cfg)
    return cfg, Layout(root), records


def test_every_stage_writes_its_outputs(finished_run):
    cfg, layout, records = finished_run
    assert [r["stage"] for r in records][:3] == ["prepare", "convert", "init_adapter"]
    assert all(call.done_marker.exists() for call in plan(cfg, layout))
    for i in range(cfg.run.steps):
        rollouts = read_rollouts(layout.rollouts(i))
        assert rollouts.num_rows == cfg.rollout.prompts_per_step * cfg.rollout.group_size
        scored = read_rollouts(layout.scored(i), scored=True)
        assert scored.num_rows == rollouts.num_rows
        update = json.loads(layout.update_metrics(i).read_text())
        for key in ("loss", "entropy", "kl", "clip_frac", "grad_norm", "sigma", "reward_mean", "reward_std", "tokens"):
            assert key in update, key
        assert (layout.adapter(i + 1) / "adapter_model.safetensors").is_file()
    # AQN: 2 stages over 2 steps -> step 0 has no added noise, step 1 has sigma_start.
    assert read_rollouts(layout.rollouts(0)).column("aqn_sigma").to_pylist()[0] == 0.0
    assert read_rollouts(layout.rollouts(1)).column("aqn_sigma").to_pylist()[0] == pytest.approx(cfg.aqn.sigma_start)
    for k in (0, cfg.run.steps):
        m = json.loads(layout.eval_metrics(k).read_text())
        assert 0.0 <= m["pass_at_1"] <= 1.0 and 0.0 <= m["greedy_acc"] <= 1.0
    assert (layout.reports_dir / "steps.csv").is_file()
    meta = read_metadata(layout.rollouts(0))
    assert meta["schema_version"] == "1" and meta["quant_scheme"] == "NVFP4A16" and len(meta["checkpoint_hash"]) == 64


def test_rows_carry_seeds_and_aligned_logprobs(finished_run):
    cfg, layout, _ = finished_run
    from qerl_lib.seeds import derive_seed

    rows = read_rollouts(layout.rollouts(1)).to_pylist()
    for r in rows:
        assert r["seed"] == derive_seed(cfg.run.seed, 1, r["prompt_id"], r["sample_idx"])
        assert len(r["sampling_logprobs"]) == len(r["completion_token_ids"]) > 0
        assert all(lp <= 0 for lp in r["sampling_logprobs"])
        assert r["truncated"] == (len(r["completion_token_ids"]) == cfg.rollout.max_new_tokens
                                  and r["finish_reason"] == "length")


@pytest.mark.reproduces
def test_rerun_skips_and_resume_remakes_identical_bytes(finished_run):
    cfg, layout, _ = finished_run
    before = layout.rollouts(1).read_bytes()
    assert [r["stage"] for r in run_all(cfg)] == ["report"]  # everything else is done
    # Lose the tail of the run (as a kill after update@0 would) and resume it.
    for p in (layout.rollouts(1), layout.reward_metrics(1), layout.update_metrics(1), layout.eval_metrics(2)):
        p.unlink()
    redone = [(r["stage"], r["step"]) for r in run_all(cfg)]
    assert redone == [("rollout", 1), ("reward", 1), ("update", 1), ("eval", 2), ("report", None)]
    assert layout.rollouts(1).read_bytes() == before


@pytest.mark.reproduces
def test_cli_stage_matches_in_process_bytes(finished_run, tmp_path):
    """The same stage through `qerl stage` in a fresh process writes the same bytes."""
    cfg, layout, _ = finished_run
    before = layout.rollouts(0).read_bytes()
    layout.rollouts(0).unlink()
    out = subprocess.run([sys.executable, "-m", "qerl_lib", "stage", "rollout", "--step", "0",
                          "--config", str(layout.config)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert layout.rollouts(0).read_bytes() == before


def test_second_run_on_a_busy_workspace_is_refused(finished_run):
    cfg, layout, _ = finished_run
    with workspace_lock(layout):
        with pytest.raises(WorkspaceBusy, match="in use"):
            run_all(cfg)


def test_changed_config_on_existing_workspace_is_refused(finished_run):
    from qerl_lib.run import ConfigMismatch

    cfg, layout, _ = finished_run
    other = cfg.model_copy(deep=True)
    other.rollout.group_size = 2
    with pytest.raises(ConfigMismatch, match="rollout.group_size"):
        run_all(other)


def test_update_moves_the_adapter_toward_positive_advantages(finished_run, tmp_path):
    """With hand-set advantages, one DAPO update raises the logprob of the favoured samples."""
    from qerl_lib.policy import Policy
    from qerl_lib.stages import update_stage
    from qerl_lib.trainer import build_batch, policy_logprobs
    import shutil

    cfg, layout, _ = finished_run
    work = Layout(tmp_path / "ws")
    for sub in ("models", "adapters", "rewards", "data"):
        shutil.copytree(layout.root / sub, work.root / sub)
    rows = read_rollouts(work.scored(0), scored=True).to_pylist()
    for i, r in enumerate(rows):
        r["advantage"], r["kept"] = (1.0 if i % 2 == 0 else -1.0), True
    write_rollouts(to_table(rows), work.scored(0), read_metadata(work.scored(0)), scored=True)
    c = cfg.model_copy(deep=True)
    c.run.root = str(work.root)
    c.optim.lr = 1e-2

    pol = Policy(c, work)

    def favoured_minus_other():
        b = build_batch(rows, pol.tokenizer.pad_token_id, pol.device)
        with torch.no_grad():
            lp, _ = policy_logprobs(pol.model, b, rows[0]["temperature"], False)
        seq = (lp * b.mask).sum(-1)
        return float(seq[0::2].mean() - seq[1::2].mean())

    pol.load_adapter(work.adapter(0), 0)
    gap0 = favoured_minus_other()
    metrics = update_stage(c, work, 0, pol)
    assert metrics["grad_norm"] > 0 and metrics["optimizer_steps"] == 1
    pol.load_adapter(work.adapter(1), 1)
    assert favoured_minus_other() > gap0
    assert (work.adapter(1) / "optimizer.pt").is_file()
