"""`qerl`: one command per stage, and `qerl run` for a whole local training run.

    qerl run [--config FILE] [--set section.key=value ...]
    qerl stage NAME [--step I] [--config FILE] [--set ...]   NAME in: prepare convert init_adapter
                                                             rollout reward update eval report
    qerl config [--show]                                     resolved config, or every field's doc

Every command takes the same `--config` / `--set` and writes the resolved config to
`<run.root>/config.yaml`. Errors in input (missing file, bad row, unknown key) print
one clear line and exit 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

STAGES = ["prepare", "convert", "init_adapter", "rollout", "reward", "update", "eval", "report"]
STEP_STAGES = {"rollout", "reward", "update", "eval"}


def _telemetry_off() -> None:
    for k, v in {
        "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DVC_NO_ANALYTICS": "1",
        "VLLM_NO_USAGE_STATS": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false",
    }.items():
        os.environ.setdefault(k, v)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", type=Path, default=None, help="YAML config file (default: built-in defaults)")
    p.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one field, e.g. --set rollout.group_size=8 (repeatable)")
    p.add_argument("--root", type=str, default=None, help="workspace directory (same as --set run.root=...)")


def _load(args):
    from qerl_lib.config import load_config
    from qerl_lib.model import set_threads

    overrides = list(args.overrides)
    if args.root:
        overrides.append(f"run.root={args.root}")
    cfg = load_config(args.config, overrides)
    set_threads(cfg.run.threads)
    return cfg


def _setup_logging(verbose: bool) -> None:
    from rich.logging import RichHandler

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(show_path=False, rich_tracebacks=False)])
    for noisy in ("llmcompressor", "httpx", "transformers", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("qerl_lib").setLevel(logging.INFO)


def cmd_run(args) -> int:
    from rich.console import Console

    from qerl_lib.paths import Layout
    from qerl_lib.run import plan, run_all

    cfg = _load(args)
    console = Console()
    layout = Layout(cfg.run.root)
    calls = plan(cfg, layout)
    console.print(f"[bold]qerl run[/bold]: {cfg.run.steps} steps, base={cfg.model.base} quant={cfg.model.quant} "
                  f"loss={cfg.algo.loss} aqn={'on' if cfg.aqn.enabled else 'off'} -> {layout.root}")
    state = {"i": 0}

    def on_event(kind, call, info):
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
    t.add_row("rollouts", str(layout.root / "rollouts") + f"/step=0..{steps - 1}/rollouts.parquet")
    t.add_row("scored rollouts", str(layout.root / "rewards") + f"/step=0..{steps - 1}/scored.parquet")
    t.add_row("adapters (PEFT)", str(layout.root / "adapters") + f"/step=0..{steps}")
    t.add_row("update metrics", str(layout.root / "metrics") + f"/step=0..{steps - 1}/update.json")
    t.add_row("evaluation", str(layout.root / "eval") + "/step=K/{samples.parquet,metrics.json}")
    t.add_row("report", str(layout.reports_dir) + " (metrics.json, steps.csv, plots/*.png)")
    console.print(t)


def cmd_stage(args) -> int:
    from qerl_lib.config import save_config
    from qerl_lib.paths import Layout
    from qerl_lib.run import StageCall, run_call

    cfg = _load(args)
    if args.name in STEP_STAGES and args.step is None:
        raise SystemExit(f"qerl stage {args.name} needs --step")
    layout = Layout(cfg.run.root)
    save_config(cfg, layout.config)
    result = run_call(StageCall(args.name, args.step, layout.root), cfg, layout)
    print(f"{args.name}{'' if args.step is None else '@' + str(args.step)}: {_summary(StageCall(args.name, args.step, layout.root), result) or 'done'}")
    return 0


def cmd_config(args) -> int:
    import yaml

    from qerl_lib.config import config_to_dict, describe

    if args.show:
        for key, default, doc in describe():
            print(f"{key} = {default}\n    {doc}")
        return 0
    print(yaml.safe_dump(config_to_dict(_load(args)), sort_keys=False), end="")
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

    c = sub.add_parser("config", help="print the resolved config (or --show every field's documentation)")
    c.add_argument("--show", action="store_true")
    _add_config_args(c)
    c.set_defaults(func=cmd_config)
    return p


def main(argv: list[str] | None = None) -> int:
    _telemetry_off()
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    from qerl_lib.config import ConfigError
    from qerl_lib.run import ConfigMismatch, WorkspaceBusy
    from qerl_lib.schema import SchemaError

    try:
        return args.func(args)
    except (ConfigError, SchemaError, FileNotFoundError, WorkspaceBusy, ConfigMismatch) as e:
        print(f"qerl: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"qerl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
