"""Bad input: each kind is refused by the CLI with exit 2 and one `qerl: error:` line naming the
field, file or row (no traceback), and nothing in the workspace is written, half-written or
deleted (a sha256 snapshot of every file before and after). The kinds are counted, with the
kill points, in docs/reliability.md.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from faultkit import copy_ws, qerl, snapshot, stage_argv

from qerl_lib.cli import main


def refused(argv: list[str], capsys, *needles: str) -> str:
    """Run `qerl argv` in this process: exit 2, a `qerl: error:` message containing `needles`."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, f"exit {rc}:\n{err}"
    # the error is the last line (a library's progress bar may precede it on stderr)
    assert err.count("qerl: error:") == 1 and "Traceback" not in err, err
    assert err.strip().split("\n")[-1].split("\r")[-1].startswith("qerl: error:"), err
    for n in needles:
        assert n in err, f"{n!r} not in: {err}"
    return err


# ---------------------------------------------------------------------------------------------
# config values: refused before anything is written (the workspace is not even created)
# ---------------------------------------------------------------------------------------------

BAD_VALUES = [
    ("eval.max_prompts=-1", "eval.max_prompts"),
    ("data.max_train=-3", "data.max_train"),
    ("data.max_test=0", "data.max_test"),
    ("eval.max_new_tokens=0", "eval.max_new_tokens"),
    ("optim.lr=-1", "optim.lr"),
    ("aqn.sigma_start=-1", "aqn.sigma_start"),
    ("aqn.sigma_end=0", "aqn.sigma_end"),
    ("run.threads=-2", "run.threads"),
    ("run.steps=0", "run.steps"),
    ("data.synthetic_train=0", "data.synthetic_train"),
    ("data.synthetic_levels=[5]", "data.synthetic_levels"),
    ("data.synthetic_levels=[]", "data.synthetic_levels"),
    ("data.test_fraction=1.5", "data.test_fraction"),
    ("model.device=gpu", "model.device"),
    ("model.quant=int3", "model.quant"),
    ("model.nvfp4_observer=absmax", "model.nvfp4_observer"),
    ("model.nvfp4_calibration=awq", "model.nvfp4_calibration"),
    ("model.nvfp4_calibration_samples=0", "model.nvfp4_calibration_samples"),
    ("lora.r=0", "lora.r"),
    ("lora.alpha=0", "lora.alpha"),
    ("lora.dropout=1", "lora.dropout"),
    ("lora.target_modules=[]", "lora.target_modules"),
    ("rollout.group_size=0", "rollout.group_size"),
    ("rollout.top_p=1.5", "rollout.top_p"),
    ("rollout.temperature=0", "rollout.temperature"),
    ("rollout.vllm_gpu_memory_utilization=1.5", "rollout.vllm_gpu_memory_utilization"),
    ("reward.overlong_buffer=-1", "reward.overlong_buffer"),
    ("algo.eps_low=-0.1", "algo.eps_low"),
    ("algo.std_eps=0", "algo.std_eps"),
    ("algo.tis_cap=0", "algo.tis_cap"),
    ("algo.loss=ppo", "algo.loss"),
    ("optim.weight_decay=-1", "optim.weight_decay"),
    ("optim.warmup_steps=-1", "optim.warmup_steps"),
    ("optim.min_lr_ratio=2", "optim.min_lr_ratio"),
    ("optim.betas=[0.9,1.5]", "optim.betas"),
    ("eval.top_p=0", "eval.top_p"),
    ("eval.k=0", "eval.k"),
    ("run.stepz=3", "run.stepz"),
    ("run.steps", "not of the form"),
    ("run.steps=[", "not valid YAML"),
    ("run.steps.x=1", "run.steps: Input should be a valid integer"),
]


@pytest.mark.parametrize("override,needle", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_a_bad_config_value_is_refused_before_anything_is_written(override, needle, tmp_path, capsys):
    root = tmp_path / "ws"
    err = refused(["stage", "prepare", "--root", str(root), "-s", override], capsys, needle)
    assert len(err.strip().splitlines()) == 1, err
    assert not root.exists()


def test_a_config_file_that_is_not_yaml_or_not_a_mapping_or_missing_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: {steps: [\n")
    refused(["run", "-c", str(bad), "--root", str(tmp_path / "ws")], capsys, str(bad), "not valid YAML")
    bad.write_text("- a\n- b\n")
    refused(["run", "-c", str(bad), "--root", str(tmp_path / "ws")], capsys, str(bad), "mapping")
    refused(["run", "-c", str(tmp_path / "none.yaml"), "--root", str(tmp_path / "ws")], capsys, "none.yaml")
    assert not (tmp_path / "ws").exists()


@pytest.mark.parametrize("argv,needle", [
    (["stage", "update"], "needs --step"),
    (["stage", "prepare", "--step", "3"], "takes no --step"),
    (["stage", "rollout", "--step", "-1"], "--step -1"),
], ids=["no-step", "step-for-a-stepless-stage", "negative-step"])
def test_stage_arguments(argv, needle, tmp_path, capsys):
    refused([*argv, "--root", str(tmp_path / "ws")], capsys, needle)
    assert not (tmp_path / "ws").exists()


# ---------------------------------------------------------------------------------------------
# damaged files in a workspace: refused by name, nothing written or deleted
# ---------------------------------------------------------------------------------------------


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _nan_adapter(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(path))
    key = sorted(k for k in state if "lora_A" in k)[0]
    state[key][0, 0] = float("nan")
    save_file(state, str(path))


class _Payload:
    """A pickle that would run a command when unpickled (`weights_only=True` refuses it)."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/qerl-pwned",))


def _pickle_payload(path: Path) -> None:
    torch.save({"state": {}, "param_groups": [], "x": _Payload()}, path)


def _foreign_optimizer(path: Path) -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones(3)
    opt.step()
    torch.save(opt.state_dict(), path)


def _plant_optimizer(fault_ref: Path):
    def plant(path: Path) -> None:
        shutil.copy(fault_ref / "adapters/step=1/optimizer.pt", path)
        _truncate(path)
    return plant


def _bad_json(path: Path) -> None:
    path.write_text('{"r": 16, ')


DAMAGED = [
    # (id, stage, file, damage, words of the message)
    ("adapter-truncated-before-update", "update@0", "adapters/step=0/adapter_model.safetensors", _truncate,
     ["adapter_model.safetensors", "not a readable safetensors file"]),
    ("adapter-truncated-before-eval", "eval@0", "adapters/step=0/adapter_model.safetensors", _truncate,
     ["adapter_model.safetensors", "not a readable safetensors file"]),
    ("adapter-nan-before-update", "update@0", "adapters/step=0/adapter_model.safetensors", _nan_adapter,
     ["adapter_model.safetensors", "NaN or infinite"]),
    ("adapter-nan-before-rollout", "rollout@0", "adapters/step=0/adapter_model.safetensors", _nan_adapter,
     ["adapter_model.safetensors", "NaN or infinite"]),
    ("adapter-config-bad-json", "update@0", "adapters/step=0/adapter_config.json", _bad_json,
     ["adapter_config.json", "not valid JSON"]),
    ("trainer-state-bad-json", "update@0", "adapters/step=0/trainer_state.json", _bad_json,
     ["trainer_state.json", "not valid JSON"]),
    ("optimizer-pickle-payload", "update@0", "adapters/step=0/optimizer.pt", _pickle_payload,
     ["optimizer.pt", "not a readable optimizer state"]),
    ("optimizer-foreign", "update@0", "adapters/step=0/optimizer.pt", _foreign_optimizer,
     ["optimizer.pt", "does not fit"]),
    ("checkpoint-config-bad-json", "update@0", "models/nvfp4/config.json", _bad_json,
     ["models/nvfp4", "could not be loaded"]),
    ("checkpoint-weights-truncated", "eval@0", "models/nvfp4/model.safetensors", _truncate,
     ["models/nvfp4", "could not be loaded"]),
    ("prepared-train-truncated", "rollout@0", "data/prepared/train.parquet", _truncate,
     ["train.parquet", "not a readable Parquet file"]),
    ("scored-truncated", "update@0", "rewards/step=0/scored.parquet", _truncate, ["scored.parquet"]),
]


@pytest.mark.parametrize("case", DAMAGED, ids=[d[0] for d in DAMAGED])
def test_a_damaged_file_is_refused_by_name(case, fault_ws, tmp_path, capsys):
    _, label, rel, damage, needles = case
    ws = copy_ws(fault_ws, tmp_path / "ws")
    damage(ws / rel)
    before = snapshot(ws)
    refused(stage_argv(ws, label), capsys, *needles)
    after = snapshot(ws)
    after.pop("config.yaml", None)  # the resolved config the command records (new in this copy)
    assert after == before
    assert not Path("/tmp/qerl-pwned").exists()


def test_a_truncated_optimizer_state_is_refused_by_name(fault_ws, fault_ref, tmp_path, capsys):
    ws = copy_ws(fault_ws, tmp_path / "ws")
    _plant_optimizer(fault_ref)(ws / "adapters/step=0/optimizer.pt")
    before = snapshot(ws)
    refused(stage_argv(ws, "update@0"), capsys, "optimizer.pt", "not a readable optimizer state")
    after = snapshot(ws)
    after.pop("config.yaml", None)
    assert after == before


def test_an_update_that_diverges_writes_no_non_finite_adapter(fault_ws, tmp_path, capsys, monkeypatch):
    """Training that leaves a NaN in a LoRA weight (stood in for by a wrapper of the trainer):
    the update refuses to write adapter 1, which the next rollout would die on, and says so."""
    import qerl_lib.trainer as trainer

    real = trainer.train_on_rollouts

    def diverging(pol, *args, **kwargs):
        out = real(pol, *args, **kwargs)
        with torch.no_grad():
            next(p for n, p in pol.model.named_parameters() if "lora_B" in n)[0, 0] = float("nan")
        return out

    monkeypatch.setattr(trainer, "train_on_rollouts", diverging)
    ws = copy_ws(fault_ws, tmp_path / "ws")
    refused(stage_argv(ws, "update@0"), capsys, "NaN or infinite", "step=1", "not written")
    assert not (ws / "adapters/step=1").exists() and not (ws / "metrics").exists()
    assert not [p for p in (ws / "adapters").iterdir() if p.name.startswith(".")]


# ---------------------------------------------------------------------------------------------
# the base model (convert)
# ---------------------------------------------------------------------------------------------


def _model_dir(tiny_llama_dir: Path, dest: Path) -> Path:
    shutil.copytree(tiny_llama_dir, dest)
    return dest


def test_a_base_path_that_does_not_exist_is_not_taken_for_a_hub_id(tmp_path, capsys):
    for base in ("./no/such/model", str(tmp_path / "none"), "~/no-such-model-dir", "../x"):
        refused(["stage", "convert", "--root", str(tmp_path / "ws"), "-s", f"model.base={base}"], capsys,
                "no such file or directory", base)
    assert not (tmp_path / "ws" / "models").exists()


def test_a_hub_id_that_cannot_be_loaded_says_both(tmp_path):
    res = qerl(["stage", "convert", "--root", str(tmp_path / "ws"), "-s", "model.base=no-such-org/no-such-model"],
               HF_HUB_OFFLINE="1")
    assert res.returncode == 2 and res.stderr.startswith("qerl: error:"), res.stderr
    assert "no such file or directory here, and as a hub id it could not be loaded" in res.stderr, res.stderr
    assert not (tmp_path / "ws" / "models").exists()


def _bad_config_json(d: Path) -> None:
    (d / "config.json").write_text("{not json")


def _wrong_shapes(d: Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg["hidden_size"] *= 2
    cfg["intermediate_size"] *= 2
    (d / "config.json").write_text(json.dumps(cfg))


def _pickle_bin(d: Path) -> None:
    (d / "model.safetensors").unlink()
    with open(d / "pytorch_model.bin", "wb") as f:
        pickle.dump(_Payload(), f)


BASES = [("config-json-bad-json", _bad_config_json), ("config-json-wrong-shapes", _wrong_shapes),
         ("pickle-payload-bin", _pickle_bin)]


@pytest.mark.parametrize("name,damage", BASES, ids=[b[0] for b in BASES])
def test_a_damaged_base_model_is_refused_by_name(name, damage, tiny_llama_dir, tmp_path, capsys):
    d = _model_dir(tiny_llama_dir, tmp_path / "model")
    damage(d)
    refused(["stage", "convert", "--root", str(tmp_path / "ws"), "-s", f"model.base={d}"], capsys,
            str(d), "could not be loaded")
    assert not (tmp_path / "ws" / "models").exists()
    assert not Path("/tmp/qerl-pwned").exists()


def test_a_gguf_file_of_garbage_is_refused_by_name(tmp_path, capsys):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + struct.pack("<I", 3) + os.urandom(64))
    refused(["stage", "convert", "--root", str(tmp_path / "ws"), "-s", f"model.base={gguf}"], capsys,
            "model.gguf", "could not be loaded")
    assert not (tmp_path / "ws" / "models").exists()


# ---------------------------------------------------------------------------------------------
# the environment
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_it(fault_ws, tmp_path, capsys):
    ws = copy_ws(fault_ws, tmp_path / "ws")
    before = snapshot(ws)
    refused([*stage_argv(ws, "update@0"), "-s", "model.device=cuda"], capsys, "model.device=cuda",
            "no CUDA device")
    assert snapshot(ws) == before


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_backend_without_vllm(fault_ws, tmp_path, capsys):
    ws = copy_ws(fault_ws, tmp_path / "ws")
    before = snapshot(ws)
    refused([*stage_argv(ws, "rollout@0"), "-s", "rollout.backend=vllm"], capsys, "rollout.backend=vllm",
            "not installed")
    assert snapshot(ws) == before


def test_a_prompt_longer_than_the_context_is_refused_with_a_count(fault_ws, tmp_path, capsys):
    """The rule (qerl_lib/preflight.py): prompt tokens + max_new_tokens > max_position_embeddings
    refuses the stage before it samples, with the count of such prompts."""
    ws = copy_ws(fault_ws, tmp_path / "ws")
    src = tmp_path / "long.jsonl"
    rows = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(30)]
    rows[3]["question"] = "What is " + " + ".join(["1"] * 400) + "?"
    rows[7]["question"] = "Add these: " + " ".join(["2"] * 300)
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    over = ["-s", f"data.source={src}", "-s", "data.layout=gsm8k"]
    assert main([*stage_argv(ws, "prepare"), *over]) == 0
    capsys.readouterr()
    shutil.rmtree(ws / "rollouts")
    before = snapshot(ws)
    err = refused([*stage_argv(ws, "rollout@0"), *over], capsys, "train.parquet", "max_position_embeddings (256)",
                  "rollout.max_new_tokens")
    n_train = len(__import__("pyarrow.parquet").parquet.read_table(ws / "data/prepared/train.parquet"))
    assert f"2 of {n_train} prompt(s)" in err, err
    assert snapshot(ws) == before


def _unshare_ok() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


needs_mounts = pytest.mark.skipif(not _unshare_ok(), reason="needs root and mount namespaces (unshare -m)")


def _in_namespace(script: str, timeout: float = 300) -> subprocess.CompletedProcess:
    from conftest import quiet_env

    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], env=quiet_env(),
                          capture_output=True, text=True, timeout=timeout)


@needs_mounts
def test_a_read_only_workspace(fault_ws, tmp_path):
    ws = copy_ws(fault_ws, tmp_path / "ws")
    before = snapshot(ws)
    argv = " ".join(stage_argv(ws, "reward@0"))
    res = _in_namespace(f"mount --bind {ws} {ws} && mount -o remount,ro,bind {ws} && "
                        f"{sys.executable} -m qerl_lib {argv}")
    assert res.returncode == 2, res.stderr
    errors = [ln for ln in res.stderr.splitlines() if "qerl: error:" in ln]
    assert len(errors) == 1 and "read-only file system" in errors[0].lower(), res.stderr
    assert str(ws) in errors[0] and "Traceback" not in res.stderr
    assert snapshot(ws) == before


@needs_mounts
def test_a_full_disk_names_the_file_being_written(fault_ws, tmp_path):
    """A tmpfs with a few kB left: the update's adapter does not fit. One line says so, names the
    output, and nothing of it is left (the temporaries are removed)."""
    src = copy_ws(fault_ws, tmp_path / "src")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    size_kb = sum(p.stat().st_size for p in src.rglob("*") if p.is_file()) // 1024 + 2048
    argv = " ".join(stage_argv(mnt / "ws", "update@0"))
    script = (f"mount -t tmpfs -o size={size_kb}k tmpfs {mnt} && cp -a {src} {mnt}/ws && "
              f"{sys.executable} -c \"import yaml,sys; p='{mnt}/ws/tiny.yaml'; t=yaml.safe_load(open(p)); "
              f"t['run']['root']='{mnt}/ws'; open(p,'w').write(yaml.safe_dump(t))\" && "
              f"free=$(df -k --output=avail {mnt} | tail -1); dd if=/dev/zero of={mnt}/fill bs=1k "
              f"count=$((free - 24)) status=none; "
              f"{sys.executable} -m qerl_lib {argv}; rc=$?; "
              f"ls -a {mnt}/ws/adapters {mnt}/ws/metrics 2>/dev/null; exit $rc")
    res = _in_namespace(script)
    assert res.returncode == 2, res.stdout + res.stderr
    errors = [ln for ln in res.stderr.splitlines() if "qerl: error:" in ln]  # progress lines may precede it
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr
    assert "no space left on device writing" in errors[0] and f"{mnt}/ws/" in errors[0], errors[0]
    listing = res.stdout.split()
    assert not [n for n in listing if n.endswith((".tmp", ".old")) or n == "step=1"], listing


def test_a_vllm_max_model_len_below_prompt_plus_completion_is_refused_by_count(fault_ws, tmp_path):
    """With the vLLM backend the context is the smaller of max_position_embeddings and
    rollout.vllm_max_model_len, and the refusal names the field that bounds it."""
    import yaml

    from qerl_lib.config import ConfigError, QerlConfig
    from qerl_lib.paths import Layout
    from qerl_lib.preflight import check_prompt_lengths

    ws = copy_ws(fault_ws, tmp_path / "ws")
    tree = yaml.safe_load((ws / "tiny.yaml").read_text())
    cfg = QerlConfig.model_validate(tree)
    rc = cfg.rollout
    check_prompt_lengths(cfg, Layout(ws), "train", rc.max_new_tokens, "rollout.max_new_tokens")  # fits
    tree["rollout"].update(backend="vllm", vllm_max_model_len=rc.max_new_tokens + 2)
    cfg = QerlConfig.model_validate(tree)
    with pytest.raises(ConfigError, match=r"> rollout.vllm_max_model_len \(\d+\)") as e:
        check_prompt_lengths(cfg, Layout(ws), "train", rc.max_new_tokens, "rollout.max_new_tokens")
    assert "prompt(s) do not fit" in str(e.value)
