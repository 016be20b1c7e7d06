"""scripts/device_experiment.sh's carry-check: a GPU call's carry plus the working tree, against the limit.

The device tool refuses a call whose working tree and carried paths pass its size limit, and a refused
call mid-sequence costs the machine (it is given back after 30 s idle). The check runs here, before.
And its `qwen_claim`: a run workspace on the machine belongs to one experiment.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "device_experiment.sh"

pytestmark = pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                                reason="carry-check counts the working tree with git")


def carry_check(*paths: Path, limit: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, CARRY_MAX=str(limit), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(["bash", str(SCRIPT), "carry-check", *map(str, paths)], capture_output=True, text=True,
                          env=env, cwd=ROOT)


def tree_bytes() -> int:
    out = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    return sum((ROOT / f).stat().st_size for f in out.split("\0") if f and (ROOT / f).is_file())


def test_a_carry_under_the_limit_fits(tmp_path):
    piece = tmp_path / "p1"
    piece.mkdir()
    (piece / "part").write_bytes(b"x" * 1000)
    (piece / "manifest.json").write_bytes(b"{}")
    r = carry_check(piece, limit=tree_bytes() + 1002)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fits" in r.stdout


def test_a_carry_one_byte_over_is_refused_naming_it(tmp_path):
    piece = tmp_path / "part"
    piece.write_bytes(b"x" * 1000)
    r = carry_check(piece, limit=tree_bytes() + 999)
    assert r.returncode == 1
    assert "TOO LARGE" in r.stdout and str(piece) in r.stdout


VLLM_FIRST_PIECE = 50_337_240
"""Bytes of `.device/vllm/a`, the larger of the two pieces `../shared/tools/device-vllm/build` makes (vLLM
0.26.0), as built in sessions 37 and 38: the largest carry of the GPU set-up."""
TREE_MARGIN = 2**20
"""Room kept for one session's results: session 38 added about 0.4 MB (a run's files, a replaced run)."""


def test_the_working_tree_leaves_room_for_vllms_first_piece():
    """Call 1 of every GPU session carries vLLM's first piece beside the whole working tree. In session 38
    the tree had grown to 15.34 MiB and the call was refused (63.34 MiB of 63); the PNGs, saved as
    palettes since, bought back 2.1 MiB. This fails while there is still time to shrink the tree, not on
    the GPU machine."""
    piece = ROOT / ".device" / "vllm" / "a"
    first = sum(f.stat().st_size for f in piece.rglob("*") if f.is_file()) if piece.is_dir() else VLLM_FIRST_PIECE
    limit = int(re.search(r"^CARRY_MAX=\$\{CARRY_MAX:-(\d+)\}", SCRIPT.read_text(), re.M).group(1))
    tree = tree_bytes()
    room = limit - first - tree
    assert room >= TREE_MARGIN, (f"the working tree ({tree / 2**20:.2f} MiB) leaves {room / 2**20:.2f} MiB "
                                 f"beside vLLM's first piece ({first / 2**20:.2f} MiB) under {limit / 2**20:.2f} MiB")


def test_a_missing_path_is_named(tmp_path):
    r = carry_check(tmp_path / "nope", limit=2**30)
    assert r.returncode != 0
    assert "nope does not exist" in r.stderr


def qwen_claim(ws: Path, experiment: str) -> subprocess.CompletedProcess:
    """The script's `qwen_claim` function alone, run on `ws` for `experiment` (QWEN_EXPERIMENT)."""
    body = subprocess.run(["sed", "-n", "/^qwen_claim() {/,/^}/p", str(SCRIPT)], capture_output=True, text=True,
                          check=True).stdout
    assert body.startswith("qwen_claim() {"), "scripts/device_experiment.sh lost its qwen_claim function"
    return subprocess.run(["bash", "-c", body + 'qwen_claim "$1"', "qwen_claim", str(ws)], capture_output=True,
                          text=True, env=dict(os.environ, QWEN_EXPERIMENT=experiment))


def test_a_workspace_of_another_experiment_is_refused(tmp_path):
    """`qerl run` resumes a workspace whose config differs only in run.steps / eval.every, so recipe 3's
    bf16 seed 0 would continue recipe 2's in the same runs/bf16/seed0: the claim refuses it, naming both."""
    ws = tmp_path / "runs" / "bf16" / "seed0"
    first = qwen_claim(ws, "qwen05_gsm8k_v2")
    assert first.returncode == 0, first.stderr
    assert (ws / "EXPERIMENT").read_text() == "qwen05_gsm8k_v2\n"
    assert qwen_claim(ws, "qwen05_gsm8k_v2").returncode == 0  # the same experiment resumes its own run
    other = qwen_claim(ws, "qwen05_gsm8k_v3")
    assert other.returncode == 1
    assert f"{ws} holds a run of experiments/qwen05_gsm8k_v2, not of experiments/qwen05_gsm8k_v3" in other.stderr
    assert (ws / "EXPERIMENT").read_text() == "qwen05_gsm8k_v2\n"


def script(cmd: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`scripts/device_experiment.sh CMD ARGS` with `env` added, the venv's python3 first on PATH (unless
    `env` brings a PATH of its own)."""
    full = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **env}
    return subprocess.run(["bash", str(SCRIPT), cmd, *args], capture_output=True, text=True, env=full, cwd=ROOT,
                          timeout=300)


def test_a_runs_resume_state_travels_in_pieces_and_is_checked(reference_run, tmp_path):
    """qwen-save cuts a run's resume state (`qerl_lib.run.resume_state`) into pieces, a few a call;
    keep-state files what came back into carry-sized folders; qwen-restore joins them on another
    machine into the same files, and refuses pieces whose join does not match the manifest's sha256."""
    from qerl_lib.paths import Layout
    from qerl_lib.run import resume_state

    ws = tmp_path / "exp" / "runs" / "bf16" / "seed0"
    shutil.copytree(reference_run, ws)
    for rel in ("rollouts/step=1", "rewards/step=1", "metrics/step=1", "adapters/step=2", "eval/step=2"):
        shutil.rmtree(ws / rel)
    (ws / "EXPERIMENT").write_text("qwen05_gsm8k_v3\n")
    times = Layout(ws).stage_times
    whole = times.read_text()
    times.write_text(whole + '{"stage": "rollout", "st')  # the running run is writing a line: it is left out
    expected = [f.relative_to(ws) for f in resume_state(Layout(ws))] + [Path("EXPERIMENT")]
    outs = []
    for call in range(20):
        outs.append(tmp_path / f"out{call}")
        r = script("qwen-save", QERL_EXP=str(tmp_path / "exp"), OUT=str(outs[-1]), QWEN_RUNS="bf16:0:false",
                   SAVE_PIECE="20000", SAVE_CALL_MAX="2")
        assert r.returncode == 0, r.stderr
        assert len([p for p in outs[-1].iterdir() if ".tar." in p.name]) <= 2
        if "every piece of bf16.seed0 sent" in r.stdout:
            break
    assert len(outs) > 2, "the state should need several calls at 20,000-byte pieces"
    manifest = (outs[0] / "bf16.seed0.manifest").read_text().splitlines()
    assert manifest[1] == "step 1"

    state = tmp_path / "state"
    r = script("keep-state", *map(str, outs), STATE_DIR=str(state), STATE_CARRY="2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert all(len([p for p in d.iterdir() if ".tar." in p.name]) <= 2 for d in state.iterdir())

    r = script("qwen-restore", QERL_EXP=str(tmp_path / "exp2"), STATE_DIR=str(state))
    assert r.returncode == 0, r.stdout + r.stderr
    new = tmp_path / "exp2" / "runs" / "bf16" / "seed0"
    assert "qwen-restore: bf16.seed0 into" in r.stdout and "step 1" in r.stdout
    assert sorted(str(p.relative_to(new)) for p in new.rglob("*") if p.is_file()) == sorted(map(str, expected))
    timing = times.relative_to(ws)
    assert all((new / rel).read_bytes() == (ws / rel).read_bytes() for rel in expected if rel != timing)
    assert (new / timing).read_text() == whole
    r = script("qwen-restore", QERL_EXP=str(tmp_path / "exp2"), STATE_DIR=str(state))
    assert r.returncode == 3 and "holds a run already" in r.stderr  # never over a run

    piece = sorted(state.glob("s*/bf16.seed0.tar.01"))[0]
    piece.write_bytes(b"x" + piece.read_bytes()[1:])
    r = script("qwen-restore", QERL_EXP=str(tmp_path / "exp3"), STATE_DIR=str(state))
    assert r.returncode == 4 and "do not match" in r.stderr and "bf16.seed0.manifest" in r.stderr
    assert not (tmp_path / "exp3" / "runs" / "bf16" / "seed0" / "config.yaml").exists()


STUB_PYTHON = """#!/usr/bin/env bash
# python3 -m qerl_lib stage STAGE ... --root WS: logged; `eval` writes WS/eval/step=0/metrics.json
echo "$*" >> "$STUB_LOG"
root=${@: -1}
echo "$4: done"
if [ "$4" = eval ]; then mkdir -p "$root/eval/step=0" && echo '{"greedy_acc": 0.5, "pass1": 0.4}' > "$root/eval/step=0/metrics.json"; fi
"""


def test_a_base_evaluation_beside_a_training_run_keeps_to_its_own_workspace(tmp_path):
    """QWEN_BASE_WS=base: the 1.5B's base is evaluated in runs/bf16/base while its seed-0 run trains in
    runs/bf16/seed0 on the same GPU. Its prepare, init_adapter and step-0 eval all name the base workspace,
    the training run's files stay as they were, and $OUT gets what `summarize.py --base-evals` reads
    (metrics, convert report, log); QWEN_COLLECT=0 leaves the archive to the training's qwen-wait."""
    exp, out, bin_ = tmp_path / "exp", tmp_path / "out", tmp_path / "bin"
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / ".complete").touch()
    (exp / "site").mkdir(parents=True)
    (exp / "site" / ".w").touch()
    for d in ("base", "bf16"):
        (exp / "tmpl" / "bf16" / "models" / d).mkdir(parents=True)
    (exp / "tmpl" / "bf16" / "models" / "bf16" / "convert_report.json").write_text('{"checkpoint_hash": "c2755f5a"}')
    train = exp / "runs" / "bf16" / "seed0"
    train.mkdir(parents=True)
    (train / "EXPERIMENT").write_text("qwen15_gsm8k\n")
    (train / "config.yaml").write_text("training\n")
    bin_.mkdir()
    (bin_ / "python3").write_text(STUB_PYTHON)
    (bin_ / "python3").chmod(0o755)
    r = script("qwen-base-evals", "bf16", PATH=f"{bin_}{os.pathsep}{os.environ['PATH']}",
               STUB_LOG=str(tmp_path / "calls"), QERL_EXP=str(exp), QERL_VLLM_SITE=str(tmp_path / "vllm"),
               OUT=str(out), QWEN_EXPERIMENT="qwen15_gsm8k", QWEN_BASE_WS="base", QWEN_COLLECT="0")
    assert r.returncode == 0, r.stdout + r.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert [c.split()[3] for c in calls] == ["prepare", "init_adapter", "eval"]
    assert all(c.endswith(f"--root {exp}/runs/bf16/base") and "-c experiments/qwen15_gsm8k/bf16.yaml" in c for c in calls)
    assert sorted(p.name for p in train.iterdir()) == ["EXPERIMENT", "config.yaml"]
    assert (train / "config.yaml").read_text() == "training\n"
    assert sorted(p.name for p in out.iterdir()) == ["bf16.base.log", "bf16.convert_report.json",
                                                     "bf16.step0_metrics.json"]
    assert "eval: done" in (out / "bf16.base.log").read_text()
