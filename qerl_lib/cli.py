"""`qerl`: one command per stage, and `qerl run` for a whole local training run.

    qerl run [--config FILE] [--set section.key=value ...]
    qerl stage NAME [--step I] [--config FILE] [--set ...]   NAME in: prepare convert init_adapter
                                                             rollout reward update eval report
    qerl config [--show]                                     resolved config, or every field's doc
    qerl plan [--params params.yaml] [--check]               write the DVC params file (every knob + plan)
    qerl audit summary|groups|prompt|lineage|sql [...]       query the rollout datasets (DuckDB)

Every command takes the same `--config` / `--set` and writes the resolved config to
`<run.root>/config.yaml`. Errors in input (missing file, bad row, unknown key) print
one clear line and exit 2.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
from pathlib import Path

from qerl_lib.stages.registry import NAMES as STAGES  # noqa: E402  (the one stage list)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", type=Path, default=None, help="YAML config file (default: built-in defaults)")
    p.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one field, e.g. --set rollout.group_size=8 (repeatable)")
    p.add_argument("--root", type=str, default=None, help="workspace directory (same as --set run.root=...)")


def _load(args):
    from qerl_lib.config import load_config

    overrides = list(args.overrides)
    if args.root:
        overrides.append(f"run.root={args.root}")
    cfg = load_config(args.config, overrides)
    if cfg.run.threads:  # torch is imported only when needed: a reward stage never loads it
        from qerl_lib.model import set_threads

        set_threads(cfg.run.threads)
    return cfg


def _setup_logging(verbose: bool) -> None:
    from rich.logging import RichHandler

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(show_path=False, rich_tracebacks=False)])
    for noisy in ("llmcompressor", "httpx", "transformers", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # bitsandbytes warns on import, in every process that loads peft, that the optional `kernels`
    # package is missing (a faster NF4 CPU kernel): advice, not a fault; shown with -v.
    logging.getLogger("bitsandbytes").setLevel(logging.INFO if verbose else logging.ERROR)
    logging.getLogger("qerl_lib").setLevel(logging.INFO)


def cmd_run(args) -> int:
    from rich.console import Console

    from qerl_lib import preflight
    from qerl_lib.paths import Layout
    from qerl_lib.run import plan, run_all

    cfg = _load(args)
    console = Console()
    layout = Layout(cfg.run.root)
    calls = plan(cfg, layout)
    console.print(f"[bold]qerl run[/bold]: {cfg.run.steps} steps, base={cfg.model.base} quant={cfg.model.quant} "
                  f"loss={cfg.algo.loss} aqn={'on' if cfg.aqn.enabled else 'off'} -> {layout.root}")
    state = {"i": 0}

    preflight.check_device(cfg.model.device)
    preflight.check_backend(cfg, layout)

    def on_event(kind, call, info):
        if kind == "start":  # inside run_all's workspace lock: no other writer of these paths
            preflight.check_stage(cfg, layout, call.name)
            _sweep_partial(stage_outputs(call.name, call.step, cfg, layout))
        state["i"] += kind != "start"
        n = f"[{state['i']}/{len(calls)}]"
        if kind == "skip":
            console.print(f"{n} {call.label}: done before, skipped")
        elif kind == "start":
            console.print(f"[dim]… {call.label}[/dim]")
        else:
            console.print(f"{n} {call.label}: {info['seconds']:.1f}s {_summary(call, info.get('result'))}")

    run_all(cfg, on_event)
    _print_artifacts(console, cfg, layout)
    from qerl_lib.outcome import result_lines

    for line in result_lines(layout.root, cfg.run.steps):  # the run's result, last on screen
        console.print(line, highlight=False, soft_wrap=True)
    return 0


def _summary(call, result) -> str:
    if not isinstance(result, dict):
        return f"-> {result}" if result is not None else ""
    if call.name == "update":
        return (f"reward {result.get('reward_mean', 0):.3f} loss {result.get('loss', 0):.4f} "
                f"entropy {result.get('entropy', float('nan')):.3f} sigma {result.get('sigma', 0):.2e}")
    if call.name == "eval":
        return f"pass@1 {result.get('pass_at_1', 0):.3f} greedy {result.get('greedy_acc', float('nan')):.3f}"
    if call.name == "convert":
        return f"{result['bytes_before'] / 1e6:.0f} MB -> {result['bytes_after'] / 1e6:.0f} MB"
    if call.name == "prepare":
        return " ".join(f"{k}={v}" for k, v in result.items() if isinstance(v, (int, float, str)) and len(str(v)) < 40)
    return ""


def _print_artifacts(console, cfg, layout) -> None:
    from rich.table import Table

    steps = cfg.run.steps
    t = Table(title="artifacts", show_lines=False)
    t.add_column("what")
    t.add_column("where")
    t.add_row("resolved config", str(layout.config))
    t.add_row("prepared data", str(layout.prepared_dir))
    t.add_row("checkpoint", str(layout.checkpoint(cfg.model.quant)))
    t.add_row("convert report", str(layout.convert_report(cfg.model.quant)))
    t.add_row("rollouts", str(layout.rollouts_root) + f"/step=0..{steps - 1}/rollouts.parquet")
    t.add_row("scored rollouts", str(layout.rewards_root) + f"/step=0..{steps - 1}/scored.parquet")
    t.add_row("adapters (PEFT)", str(layout.adapters_root) + f"/step=0..{steps}")
    t.add_row("update metrics", str(layout.metrics_root) + f"/step=0..{steps - 1}/update.json")
    t.add_row("evaluation", str(layout.eval_root) + "/step=K/{samples.parquet,metrics.json}")
    t.add_row("report", str(layout.reports_dir) + " (metrics.json, steps.csv, plots/*.png)")
    console.print(t)


def stage_outputs(name: str, step: int | None, cfg, layout) -> list:
    """Every file or directory stage `name` (at `step`) writes (`qerl_lib.stages.registry`)."""
    from qerl_lib.stages import registry

    return registry.outputs(name, step, cfg.model.quant, layout)


def _sweep_partial(outputs) -> list[Path]:
    """Remove what a killed writer of `outputs` left behind: the temporaries of `qerl_lib.io`
    (`.NAME.*.tmp` files or directories beside each output) and `.NAME.old` (a directory swap cut
    half-way). Only the caller's own outputs are swept, so stages running at the same time on
    other outputs are never touched; the caller must be the only writer of these paths (DVC's
    per-path lock, or the workspace lock of `qerl run`)."""
    import glob
    import shutil

    removed = []
    for out in outputs:
        out = Path(out)
        if not out.parent.is_dir():
            continue
        # `..NAME.*`: what a writer nested in a temporary directory of NAME left beside it (the
        # adapter writer did, before `lora.write_adapter_files`): `..step=1.X.tmp.Y.tmp`, `.old`.
        junks = [*out.parent.glob(f".{glob.escape(out.name)}.*.tmp"), out.parent / f".{out.name}.old",
                 *out.parent.glob(f"..{glob.escape(out.name)}.*.tmp.*")]
        for junk in junks:
            if junk.is_dir() and not junk.is_symlink():
                shutil.rmtree(junk, ignore_errors=True)
            elif junk.exists() or junk.is_symlink():
                junk.unlink(missing_ok=True)
            else:
                continue
            removed.append(junk)
    if removed:
        logging.getLogger("qerl_lib").info("removed %d partial file(s) of a killed run: %s", len(removed),
                                           ", ".join(str(r) for r in removed))
    return removed


def _stage_lock(layout, label: str) -> int:
    """A shared lock on the workspace lock file for one stage (`qerl_lib.locks`): refused while a
    whole `qerl run` works in the workspace; stages on different outputs may run side by side."""
    from qerl_lib import locks
    from qerl_lib.run import WorkspaceBusy

    try:
        return locks.acquire(locks.workspace_lock_path(layout.root), False, f"qerl stage {label} (pid {os.getpid()})")
    except locks.Busy as e:
        raise WorkspaceBusy(
            f"workspace {layout.root} is in use by {e.holder} (a whole `qerl run`); "
            f"stage {label} was not started: wait for the run to finish or use another run.root"
        ) from None


def _call_lock(layout, label: str) -> int:
    """The exclusive lock of one stage call (`qerl_lib.locks.stage_lock_path`): a second
    `qerl stage` of the same stage and step is refused while the first runs."""
    from qerl_lib import locks
    from qerl_lib.run import WorkspaceBusy

    try:
        return locks.acquire(locks.stage_lock_path(layout.root, label), True, f"qerl stage {label} (pid {os.getpid()})")
    except locks.Busy as e:
        raise WorkspaceBusy(f"stage {label} of workspace {layout.root} is already running ({e.holder}); "
                            "this call was not started") from None


def _writes_resolved_config(args, layout) -> bool:
    """Whether `qerl stage` records its resolved config in `<root>/config.yaml`.

    Not when it runs from the DVC params file of the workspace itself (`--config params.yaml`,
    no overrides): params.yaml is then the config, dvc.lock records the params each stage used,
    and a second copy would only go stale between stages (and dirty a git checkout)."""
    if args.config is None or args.overrides or args.root:
        return True
    return Path(args.config).resolve() != (layout.root / "params.yaml").resolve()


def cmd_stage(args) -> int:
    from qerl_lib import preflight
    from qerl_lib.config import save_config
    from qerl_lib.paths import Layout
    from qerl_lib.run import run_call
    from qerl_lib.stages import registry

    from qerl_lib.config import ConfigError

    stage = registry.get(args.name)
    if stage.steps != "none" and args.step is None:
        raise ConfigError(f"qerl stage {args.name} needs --step I (the RL step, or the adapter to evaluate)")
    if stage.steps == "none" and args.step is not None:
        raise ConfigError(f"qerl stage {args.name} takes no --step")
    if args.step is not None and args.step < 0:
        raise ConfigError(f"--step {args.step}: a step is 0 or more")
    cfg = _load(args)
    layout = Layout(cfg.run.root)
    label = args.name if args.step is None else f"{args.name}@{args.step}"
    preflight.check_stage(cfg, layout, args.name)  # before anything is locked, swept or written
    lock = _stage_lock(layout, label)
    try:
        # This call's own lock before its sweep: a second call of the same stage and step would
        # otherwise remove the temporaries the first one is writing.
        call_lock = _call_lock(layout, label)
    except BaseException:
        os.close(lock)
        raise
    try:
        _sweep_partial(stage_outputs(args.name, args.step, cfg, layout))
        if _writes_resolved_config(args, layout):
            save_config(cfg, layout.config)
        call = registry.Call(stage, args.step, layout.root)
        result = run_call(call, cfg, layout)
    finally:
        os.close(call_lock)
        os.close(lock)  # releases the shared lock
    print(f"{call.label}: {_summary(call, result) or 'done'}")
    return 0


def cmd_serve(args) -> int:
    from qerl_lib.paths import Layout
    from qerl_lib.rollout.serve import serve

    cfg = _load(args)
    return serve(cfg, Layout(cfg.run.root), args.host, args.port)


def cmd_config(args) -> int:
    import yaml

    from qerl_lib.config import config_to_dict, describe

    if args.show:
        for key, default, doc in describe():
            print(f"{key} = {default}\n    {doc}")
        return 0
    print(yaml.safe_dump(config_to_dict(_load(args)), sort_keys=False), end="")
    return 0


def cmd_plan(args) -> int:
    import yaml

    from qerl_lib.config import ConfigError, expected_plan, load_config, parse_overrides, yaml_error
    from qerl_lib.dvc_yaml import render_params
    from qerl_lib.io import atomic_write_text, sweep_dead_temporaries

    target = Path(args.params)
    source = args.config or (target if target.is_file() else None)
    tree: dict = {}
    if source is not None:
        if not Path(source).is_file():
            raise ConfigError(f"config file not found: {source}")
        try:
            tree = yaml.safe_load(Path(source).read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {source} is not valid YAML: {yaml_error(e)}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {source} must hold a mapping at the top level")
    tree.pop("plan", None)  # recomputed below; a stale one must not fail validation
    overrides = parse_overrides(list(args.overrides))
    if args.root:
        raise ConfigError("qerl plan: the DVC workspace is the repository root; run.root is always '.'")
    old_root = (tree.get("run") or {}).get("root", ".")
    overrides.setdefault("run", {})["root"] = "."
    cfg = load_config(None, _merged(tree, overrides))
    text = render_params(cfg)
    if args.check:
        current = target.read_text() if target.is_file() else ""
        if current != text:
            print(f"qerl: {target} is out of date (run `qerl plan`)", file=sys.stderr)
            return 1
        print(f"{target}: up to date")
        return 0
    sweep_dead_temporaries(target)  # `.params.yaml.<pid>-*.tmp` of a killed `qerl plan`
    atomic_write_text(target, text)
    if old_root not in (".", None):
        print(f"note: run.root was {old_root!r}; DVC stages run at the repository root, so it is '.'")
    n = cfg.run.steps
    evals = ", ".join(f"eval@{k}" for k in expected_plan(cfg).evals)
    print(f"wrote {target}: {n} steps (rollout@, reward@, update@ 0..{n - 1}), {evals}; "
          f"run `dvc repro` to reproduce it")
    return 0


def _merged(tree: dict, overrides: dict) -> dict:
    from qerl_lib.config import _merge

    return _merge(tree, overrides)


def cmd_audit(args) -> int:
    from qerl_lib import audit

    root = args.root
    if root is None:
        root = _load(args).run.root if (args.config or args.overrides) else audit.default_root()
    a = audit.Audit(root)
    if args.audit == "summary":
        result = a.summary()
    elif args.audit == "groups":
        result = a.groups(zero_variance=args.zero_variance, step=args.step)
    elif args.audit == "prompt":
        result = a.prompt(args.prompt_id)
    elif args.audit == "lineage":
        result = a.lineage(step=args.step, row=args.row, prompt_id=args.prompt_id, sample_idx=args.sample_idx)
    else:
        result = a.sql(args.query)
    text = result.render(args.format)
    if args.output:
        from qerl_lib.io import atomic_write_text

        atomic_write_text(Path(args.output), text)
        print(f"{result.title or args.audit}: {len(result.rows)} row(s) -> {args.output}")
    else:
        print(text, end="" if text.endswith("\n") else "\n")
    return 0


def cmd_compare(args) -> int:
    from qerl_lib import compare

    arms = [compare.load_arm(*compare.parse_arm_spec(spec)) for spec in args.arms]
    result = compare.compare(arms, args.out, early_steps=args.early_steps)
    print(compare.to_markdown(result), end="")
    print(f"comparison of {len(arms)} arm(s) -> {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qerl", description="QeRL: RL on a frozen NVFP4 base with LoRA and AQN")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run (or resume) a whole local training run")
    _add_config_args(r)
    r.set_defaults(func=cmd_run)

    s = sub.add_parser("stage", help="run one stage")
    s.add_argument("name", choices=STAGES)
    s.add_argument("--step", type=int, default=None, help="RL step (rollout, reward, update) or adapter (eval)")
    _add_config_args(s)
    s.set_defaults(func=cmd_stage)

    sv = sub.add_parser("serve", help="start the workspace's long-lived rollout server (vLLM on GPU, or the CPU "
                                      "server); stages find it and sample there")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    sv.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    _add_config_args(sv)
    sv.set_defaults(func=cmd_serve)

    c = sub.add_parser("config", help="print the resolved config (or --show every field's documentation)")
    c.add_argument("--show", action="store_true")
    _add_config_args(c)
    c.set_defaults(func=cmd_config)

    pl = sub.add_parser("plan", help="write params.yaml for dvc.yaml: every knob and the unrolled stage list")
    pl.add_argument("--params", default="params.yaml", help="the params file to write (default: params.yaml)")
    pl.add_argument("--check", action="store_true", help="only check that the params file is up to date (exit 1 if not)")
    _add_config_args(pl)
    pl.set_defaults(func=cmd_plan)

    a = sub.add_parser("audit", help="query the rollout datasets of a workspace (DuckDB)")
    common = argparse.ArgumentParser(add_help=False)
    _add_config_args(common)
    common.add_argument("--format", "-f", choices=["table", "csv", "markdown", "json"], default="table",
                        help="output format (default: table)")
    common.add_argument("--output", "-o", default=None, help="write to this file instead of stdout")
    asub = a.add_subparsers(dest="audit", required=True)
    asub.add_parser("summary", parents=[common],
                    help="per step: samples, reward mean/std, correct rate, length, truncation, entropy, kept")
    g = asub.add_parser("groups", parents=[common], help="GRPO groups (prompt x step) and their reward spread")
    g.add_argument("--zero-variance", action="store_true", help="only groups whose rewards are all equal")
    g.add_argument("--step", type=int, default=None)
    pr = asub.add_parser("prompt", parents=[common], help="every sample of one prompt across steps (and eval)")
    pr.add_argument("prompt_id")
    li = asub.add_parser("lineage", parents=[common],
                         help="where one row came from: checkpoint, adapter, params, code version, flow run")
    li.add_argument("--step", type=int, default=None)
    li.add_argument("--row", type=int, default=None, help="row number in rollouts/step=I/rollouts.parquet")
    li.add_argument("--prompt-id", default=None)
    li.add_argument("--sample-idx", type=int, default=None)
    q = asub.add_parser("sql", parents=[common],
                        help="any SQL over the views rollouts, scored, samples, evals, updates")
    q.add_argument("query")
    a.set_defaults(func=cmd_audit)

    cp = sub.add_parser("compare", help="compare runs side by side: tables, CSVs and one curve per run")
    cp.add_argument("arms", nargs="+", metavar="NAME=WORKSPACE", help="e.g. bf16=runs/smollm2_arith/bf16")
    cp.add_argument("--out", "-o", required=True, help="directory for comparison.json, summary.md, CSVs, plots/")
    cp.add_argument("--early-steps", type=int, default=5, help="updates averaged as 'early' (default: 5)")
    cp.set_defaults(func=cmd_compare)
    return p


def main(argv: list[str] | None = None) -> int:
    from qerl_lib import env

    env.setup()
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    from qerl_lib.config import ConfigError
    from qerl_lib.run import ConfigMismatch, WorkspaceBusy
    from qerl_lib.audit import AuditError
    from qerl_lib.schema import SchemaError
    from qerl_lib.rollout.service import RolloutServerError

    try:
        return args.func(args)
    except RolloutServerError as e:  # transient: a re-run against a live server succeeds (exit 1, retried)
        print(f"qerl: error: {e}", file=sys.stderr)
        return 1
    except (ConfigError, SchemaError, FileNotFoundError, WorkspaceBusy, ConfigMismatch, AuditError) as e:
        print(f"qerl: error: {e}{_dvc_hint(args)}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"qerl: error: {e}{_dvc_hint(args)}", file=sys.stderr)
        return 2
    except OSError as e:
        message = environment_error(e)
        if message is None:
            raise
        print(f"qerl: error: {message}{_dvc_hint(args)}", file=sys.stderr)
        return 2


def _dvc_hint(args) -> str:
    """Under `dvc repro` (DVC sets DVC_STAGE for the stage's command), DVC has removed the stage's
    outputs before starting it; a refused stage says how to get them back from DVC's cache, where
    every output of the last successful run is (dvc.lock still records them)."""
    stage = os.environ.get("DVC_STAGE")
    if getattr(args, "command", None) != "stage" or not stage:
        return ""
    return f" (DVC removed the outputs of {stage} before starting it: `dvc checkout {stage}` restores the last ones)"


_ENVIRONMENT_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                       errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                       errno.EPERM: "operation not permitted"}


def environment_error(e: OSError) -> str | None:
    """One line for an OSError of the machine rather than of qerl (a full disk, a read-only or
    unwritable workspace), naming the file; None for any other OSError (a bug: traceback)."""
    if e.errno not in _ENVIRONMENT_ERRNOS:
        return None
    text = e.strerror or str(e)
    what = _ENVIRONMENT_ERRNOS[e.errno]
    if e.filename and str(e.filename) not in text:
        text = f"{text}: {e.filename}"
    if what not in text.lower():
        text = f"{what}: {text}"
    return text


if __name__ == "__main__":
    sys.exit(main())
