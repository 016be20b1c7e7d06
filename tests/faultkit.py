"""Tools of the fault tests (`test_faults.py`, `test_bad_input.py`): a tiny workspace built once
per session, copies of it per test, a real SIGKILL at a chosen write, and the checks that a
workspace holds nothing half-written and lost nothing.

`kill_at`: runs `qerl ARGS` in a child process (its own process group) in which one function is
wrapped; at the `nth` call whose arguments mention `match`, the child SIGKILLs its whole process
group `before` the call, `after` it, or after it with the written file cut to half its size
(`half`: what a kill in the middle of the write leaves on disk).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import quiet_env, tiny_pipeline_tree

from qerl_lib.paths import Layout

_KILL_SCRIPT = r"""
import importlib, json, os, signal, sys
spec = json.loads(sys.argv[1])
mod = importlib.import_module(spec["module"])
orig = getattr(mod, spec["attr"])
seen = [0]

def die():
    os.killpg(0, signal.SIGKILL)

def wrapper(*args, **kwargs):
    text = " ".join(str(a) for a in [*args, *kwargs.values()])
    hit = spec["match"] in text
    if hit:
        seen[0] += 1
    now = hit and seen[0] == spec["nth"]
    if now and spec["when"] == "before":
        die()
    out = orig(*args, **kwargs)
    if now and spec["when"] == "half":
        target = next(str(a) for a in [*args, *kwargs.values()] if spec["match"] in str(a))
        size = os.path.getsize(target)
        os.truncate(target, size // 2)
    if now:
        die()
    return out

setattr(mod, spec["attr"], wrapper)
from qerl_lib.cli import main
sys.exit(main(spec["argv"]))
"""


def kill_at(argv: list[str], module: str, attr: str, match: str, when: str = "after", nth: int = 1,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `qerl argv` and SIGKILL it at the `nth` call of `module.attr` whose arguments contain
    `match` (`when`: before / after / half). Asserts that the kill happened (rc -9)."""
    spec = {"module": module, "attr": attr, "match": match, "when": when, "nth": nth, "argv": argv}
    res = subprocess.run([sys.executable, "-c", _KILL_SCRIPT, json.dumps(spec)], env=quiet_env(),
                         capture_output=True, text=True, timeout=timeout, start_new_session=True)
    assert res.returncode == -9, f"not killed at {module}.{attr}({match!r}): rc {res.returncode}\n{res.stderr[-3000:]}"
    return res


def qerl(argv: list[str], timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """`qerl argv` in a child process (exit status and output, never raises); `env`: extra variables."""
    return subprocess.run([sys.executable, "-m", "qerl_lib", *argv], env=quiet_env(**env), capture_output=True,
                          text=True, timeout=timeout)


def partial_files(root: Path) -> list[Path]:
    """What a killed writer may leave: temporaries (`*.tmp`, also nested) and half-swapped `*.old`."""
    return sorted(p for p in Path(root).rglob("*") if ".git" not in p.parts and ".dvc" not in p.parts
                  and (p.name.endswith(".tmp") or p.name.endswith(".old") or ".tmp." in p.name))


IGNORED = {".qerl.lock", "stage_times.jsonl"}


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under `root` by relative path (locks and lock directories left out)."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        rel = p.relative_to(root)
        if p.is_file() and p.name not in IGNORED and ".qerl-locks" not in rel.parts:
            out[str(rel)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def ws_tree(base: Path, root: Path) -> dict:
    """The tiny pipeline's config (two steps, 16 / 4 prompts, 8 new tokens) rooted at `root`."""
    tree = tiny_pipeline_tree(base)
    tree["run"]["root"] = str(root)
    return tree


def write_config(root: Path, tree: dict) -> Path:
    import yaml

    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def build_workspace(base: Path, root: Path, upto: tuple[str, ...]) -> Path:
    """A workspace at `root` with the stages `upto` (labels: prepare, convert, init_adapter,
    rollout@0, reward@0, update@0, eval@0, ...) run in this process, through the CLI."""
    from qerl_lib.cli import main

    root.mkdir(parents=True, exist_ok=True)
    cfg = write_config(root, ws_tree(base, root))
    for label in upto:
        name, _, step = label.partition("@")
        argv = ["stage", name, "-c", str(cfg)] + (["--step", step] if step else [])
        assert main(argv) == 0, label
    return root


def copy_ws(src: Path, dest: Path) -> Path:
    """A copy of workspace `src` at `dest`, its config re-rooted there."""
    import yaml

    shutil.copytree(src, dest, symlinks=True, ignore=shutil.ignore_patterns(".qerl-locks", ".qerl.lock"))
    tree = yaml.safe_load((src / "tiny.yaml").read_text())
    tree["run"]["root"] = str(dest)
    write_config(dest, tree)
    (dest / "config.yaml").unlink(missing_ok=True)  # names the source's root; the next command rewrites it
    return dest


def stage_argv(ws: Path, label: str) -> list[str]:
    name, _, step = label.partition("@")
    return ["stage", name, "-c", str(ws / "tiny.yaml")] + (["--step", step] if step else [])


def outputs(ws: Path, label: str) -> list[Path]:
    """Every output path of stage `label` (files; a directory output: its files)."""
    from qerl_lib.stages import registry

    st, step = registry.parse_label(label)
    files = []
    for out in st.outputs(Layout(ws), "nvfp4", step):
        files += sorted(p for p in out.rglob("*") if p.is_file()) if out.is_dir() else [out] if out.exists() else []
    return files


def done_marker(ws: Path, label: str) -> Path:
    from qerl_lib.stages import registry

    st, step = registry.parse_label(label)
    return st.done(Layout(ws), "nvfp4", step)[0]


def _timeless(path: Path, root: Path) -> dict:
    data = json.loads(path.read_text().replace(str(root), "ROOT"))
    return {k: v for k, v in data.items() if not (k.startswith("seconds") or k in ("finished_at", "tokens_per_second"))}


def assert_same_outputs(ws: Path, ref: Path, label: str) -> None:
    """Stage `label`'s outputs in `ws` equal those in `ref`: byte for byte, except the measured
    seconds of JSON files (provenance.json is timing only) and the workspace's own path where a
    file names it (PEFT's README.md and adapter_config.json name the base checkpoint's directory)."""
    mine = outputs(ws, label)
    theirs = outputs(ref, label)
    assert [p.relative_to(ws) for p in mine] == [p.relative_to(ref) for p in theirs], (mine, theirs)
    for a, b in zip(mine, theirs):
        if a.name == "provenance.json":
            continue
        if a.suffix == ".json":
            assert _timeless(a, ws) == _timeless(b, ref), a
        else:
            assert a.read_bytes().replace(str(ws).encode(), b"ROOT") == b.read_bytes().replace(str(ref).encode(), b"ROOT"), a
