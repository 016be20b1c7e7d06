"""DVC's two files: `dvc.yaml`'s stage list, rendered from the stage registry
(`qerl_lib.stages.registry`), and `params.yaml`, rendered from a config by `qerl plan` (`render_params`).

    python -m qerl_lib.dvc_yaml            # rewrite the `stages:` block of ./dvc.yaml
    python -m qerl_lib.dvc_yaml --check    # exit 1 when it differs (tests/test_dvc.py checks it too)

Each stage declares:
- `deps`: its input artifacts (the registry's `inputs`), and the library files that compute its
  outputs: the stage's own module (`qerl_lib/stages/<name>.py`) and every `qerl_lib` module it
  imports, anywhere in the file (lazy imports too), transitively. The doors (CLI, local runner,
  registry), the config schema (params.yaml holds every value) and plumbing (atomic writes, the
  layout, progress) are not followed: adding a command or a config field re-runs nothing.
- `params`: exactly the keys the stage reads (the registry's `params`; the tests trace the reads).
- `outs` / `metrics`: what it writes.

Only the `stages:` block is rendered; the header comment and the `plots:` block of the file are
kept as they are.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from qerl_lib.paths import Layout
from qerl_lib.stages.registry import STAGES, Stage

PROJECT_ROOT = Path(__file__).resolve().parent.parent
NOT_DEPS = frozenset({
    "qerl_lib/cli.py", "qerl_lib/run.py", "qerl_lib/config.py", "qerl_lib/config_sections.py", "qerl_lib/io.py",
    "qerl_lib/paths.py", "qerl_lib/progress.py", "qerl_lib/__init__.py", "qerl_lib/__main__.py", "qerl_lib/dvc_yaml.py",
    "qerl_lib/stages/__init__.py", "qerl_lib/stages/registry.py", "qerl_lib/locks.py", "qerl_lib/env.py",
})
"""Modules that are no stage's dependency (the doors, the config schema, plumbing)."""
STEP_TEMPLATE = {"none": None, "train": "${item.step}", "eval": "${item}"}
FOREACH = {"train": "${plan.steps}", "eval": "${plan.evals}"}


def _module_file(mod: str, root: Path) -> Path | None:
    base = root / Path(*mod.split("."))
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return base.with_suffix(".py") if base.with_suffix(".py").is_file() else None


def _qerl_imports(tree: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module and n.module.split(".")[0] == "qerl_lib":
            out |= {f"qerl_lib.{a.name}" for a in n.names} if n.module == "qerl_lib" else {n.module}
            out |= {f"{n.module}.{a.name}" for a in n.names}  # `from pkg import module`
        elif isinstance(n, ast.Import):
            out |= {a.name for a in n.names if a.name.split(".")[0] == "qerl_lib"}
    return out


def library_deps(stage: Stage, root: Path = PROJECT_ROOT) -> list[str]:
    """qerl_lib files (relative, sorted) that compute `stage`'s outputs (module doc)."""
    module = stage.function.partition(":")[0]
    files: set[str] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        f = _module_file(m, root)
        if f is None:
            continue  # `from qerl_lib.x import name`: name is not a module
        rel = f.relative_to(root).as_posix()
        if rel in files:
            continue
        files.add(rel)
        if rel in NOT_DEPS:
            continue
        todo += _qerl_imports(ast.parse(f.read_text()))
        parts = m.split(".")  # importing a.b.c runs a/b/__init__.py too
        todo += [".".join(parts[:k]) for k in range(2, len(parts))]
    return sorted(files - NOT_DEPS)


def _rel(paths: list[Path]) -> list[str]:
    return [p.as_posix() for p in paths]


def render_stage(stage: Stage, root: Path = PROJECT_ROOT) -> list[str]:
    lay = Layout(".")
    quant = "${model.quant}"
    step = STEP_TEMPLATE[stage.steps]
    per_step = step is not None
    pad = "      " if per_step else "    "
    cmd = f"qerl stage {stage.name}" + (f" --step {step}" if per_step else "") + " --config params.yaml"
    lines = [f"  {stage.name}:"]
    if per_step:
        lines += [f"    foreach: {FOREACH[stage.steps]}", "    do:"]
    lines.append(f"{pad}cmd: {cmd}")
    deps = _rel(stage.inputs(lay, quant, step)) + library_deps(stage, root)
    lines.append(f"{pad}deps:")
    lines += [f"{pad}  - {d}" for d in deps]
    lines.append(f"{pad}params:")
    lines += [f"{pad}  - {p}" for p in stage.params]
    if stage.dvc_metrics:
        lines.append(f"{pad}metrics:")
        lines += [f"{pad}  - {m}" for m in _rel(stage.dvc_metrics(lay, quant, step))]
    outs = stage.dvc_outs(lay, quant, step) if stage.dvc_outs else stage.outputs(lay, quant, step)
    lines.append(f"{pad}outs:")
    lines += [f"{pad}  - {o}" for o in _rel(outs)]
    return lines


def render_stages(root: Path = PROJECT_ROOT) -> str:
    """The `stages:` block, from `stages:` to the blank line before the next top-level key."""
    out = ["stages:"]
    for st in STAGES:
        out += render_stage(st, root)
        out.append("")
    return "\n".join(out)


def render(current: str, root: Path = PROJECT_ROOT) -> str:
    """`current` (the text of dvc.yaml) with its `stages:` block replaced by the rendered one."""
    lines = current.split("\n")
    try:
        start = lines.index("stages:")
    except ValueError:
        raise ValueError("dvc.yaml has no top-level 'stages:' line") from None
    end = next((i for i in range(start + 1, len(lines)) if lines[i] and not lines[i][0].isspace()
                and not lines[i].startswith("#")), len(lines))
    return "\n".join(lines[:start] + render_stages(root).split("\n") + lines[end:])


PARAMS_HEADER = """\
# params.yaml: every knob of the DVC pipeline (dvc.yaml), in the format of a qerl config file
# (`qerl config --show` documents each field). Written by `qerl plan`: edit a value, then run
# `qerl plan` again when run.steps or eval.every change (it rewrites `plan`, the unrolled
# stage list that dvc.yaml iterates over), and `dvc repro`.
"""


def render_params(cfg) -> str:
    """The text of params.yaml for `cfg`: every field of the resolved config, then the plan."""
    import yaml

    from qerl_lib.config import config_to_dict, expected_plan

    plan = expected_plan(cfg)
    lines = [PARAMS_HEADER, yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False).rstrip(),
             "plan:"]
    if plan.steps:
        lines.append("  steps:")
        for s in plan.steps:
            lines.append(f"  - {{step: {s.step}, prev: {'null' if s.prev is None else s.prev}, next: {s.next}}}")
    else:
        lines.append("  steps: []")
    lines.append(f"  evals: [{', '.join(str(k) for k in plan.evals)}]")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = PROJECT_ROOT / "dvc.yaml"
    current = path.read_text()
    new = render(current)
    if "--check" in argv:
        if new != current:
            print(f"{path} is out of date: run `python -m qerl_lib.dvc_yaml`", file=sys.stderr)
            return 1
        print(f"{path}: up to date")
        return 0
    if new != current:
        from qerl_lib.io import atomic_write_text

        atomic_write_text(path, new)
        print(f"rewrote the stages of {path}")
    else:
        print(f"{path}: up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
