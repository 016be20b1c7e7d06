"""`qerl-train`: the whole RL run as a Prefect flow over the DVC stages of a workspace.

    prepare -> convert -> init_adapter -> [eval@i] rollout@i -> reward@i -> update@i (i < run.steps)
            -> eval@run.steps -> report

Each stage is one Prefect task that runs `dvc repro --single-item STAGE` (the entry
`dvc repro` itself uses), so DVC decides what is up to date and both doors give the same
bytes. Resume = run the flow again: DVC skips every finished stage and the run continues
at the first unfinished one (stage outputs are written atomically; a killed stage is just
run again). A second flow on the same workspace is refused at once.

Parameters are the config's: `config` (a qerl config YAML, default: the workspace's
params.yaml), `overrides` (`section.key=value`, as `qerl --set`) and `settings` (a nested
dict, e.g. {"run": {"steps": 8}}); the flow writes them to params.yaml with `qerl plan`.

Run it
- here, with no Prefect server (a temporary one starts in-process):
      python flows/train.py --config my.yaml -s run.steps=8
- served, with a cron schedule and manual runs (needs `prefect server start` and
  PREFECT_API_URL; the ephemeral server runs no scheduler):
      python flows/train.py --serve --cron "0 2 * * *"
      prefect deployment run 'qerl-train/qerl-train-served' --param overrides='["run.steps=8"]'
- deployed to a work pool (prefect.yaml at the repository root):
      prefect deploy --all && prefect worker start --pool qerl-gpu
"""

from __future__ import annotations

import flows._env  # noqa: F401  (telemetry off, ephemeral start-up timeout: before Prefect is imported)

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from flows import common
from qerl_lib.paths import Layout
from flows.rollout_server import rollout_service
from tasks.stage import RETRIES


def _run_name() -> str:
    from prefect.runtime import flow_run

    p = flow_run.parameters or {}
    ws = Path(p.get("workspace") or ".").expanduser().resolve().name or "workspace"
    extra = " ".join(p.get("overrides") or [])
    return f"train-{ws}" + (f" [{extra}]" if extra else "")


@flow(
    name="qerl-train",
    flow_run_name=_run_name,
    description="QeRL RL run (GRPO/DAPO, NVFP4 base, LoRA, AQN) over the DVC stages of a workspace.",
    persist_result=False,
    validate_parameters=True,
)
def train(
    workspace: str = ".",
    config: str | None = None,
    overrides: list[str] | None = None,
    settings: dict[str, Any] | None = None,
    retries: int = RETRIES,
    rollout_server: str = "start",
) -> dict:
    """Run (or resume) the RL run of `workspace`.

    Args:
        workspace: the git + DVC repository holding dvc.yaml (the qerl repository root, or a copy).
        config: qerl config YAML (relative to the workspace or absolute); default: its params.yaml.
        overrides: `section.key=value` settings applied over `config`, e.g. ["run.steps=8"].
        settings: nested dict of settings applied last, e.g. {"rollout": {"group_size": 8}}.
        retries: retries of a stage that failed for a reason that may pass (never for bad input).
        rollout_server: "start" (one `qerl serve` for this flow run, started before the first
            rollout / eval stage and stopped at the end), an address of a running server, or "none"
            (every stage samples in its own process); `flows/rollout_server.py`.
    """
    from prefect.runtime import flow_run

    t_flow = common.now()
    log = get_run_logger()
    with common.workspace_run(workspace, config, overrides, settings, log) as (ws, cfg):
        stages = common.stage_list(cfg, ws)
        common.check_stages(ws, stages)
        setup_s = common.now() - t_flow
        log.info("workspace %s: %d steps, %d stages (%s ... %s); DVC skips what is up to date",
                 ws, cfg.run.steps, len(stages), stages[0], stages[-1])
        def on_done(stage: str, rec: dict) -> None:
            # One `qerl-train-steps` artifact per RL step, when its update ran in this flow run: the
            # step's own row (core columns; details in the description), so the run's artifact list
            # names each step once. The whole table goes into the report at the end.
            if stage.startswith("update@") and rec.get("status") == "ran":
                step = int(stage.split("@", 1)[1])
                made = common.step_artifact(ws, cfg.run.steps, step)
                if made is not None:
                    create_table_artifact(made[0], key="qerl-train-steps", description=made[1])

        with rollout_service(ws, rollout_server, log) as before:
            records = common.run_stages(ws, stages, log, retries, "qerl-train-progress", f"train {ws.name}", on_done,
                                        before=before)
        evals = common.eval_rows(ws, cfg.run.steps)
        if evals:
            create_table_artifact(evals, key="qerl-train-eval", description=f"evaluation of {ws} (adapter k)")
        report_md = (common.curves_markdown(ws, cfg, f"qerl run report: {ws.name}") + "\n"
                     + common.timing_markdown(records))
        create_markdown_artifact(report_md, key="qerl-train-report", description=f"reward / entropy curves of {ws}")
        overhead = common.overhead_summary(records)
        overhead["flow_setup_s"] = round(setup_s, 3)  # qerl plan + dvc stage list, once per flow run
        overhead["flow_s"] = round(common.now() - t_flow, 3)
        log.info("orchestration: %s", json.dumps(overhead))
        summary_path = Layout(ws).report_metrics
        return {
            "workspace": str(ws),
            "flow_run_id": str(flow_run.id),
            "stages": records,
            "overhead": overhead,
            "metrics": json.loads(summary_path.read_text()) if summary_path.is_file() else {},
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python flows/train.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--workspace", "-w", default=".", help="git + DVC workspace (default: .)")
    p.add_argument("--config", "-c", default=None, help="qerl config YAML (default: the workspace's params.yaml)")
    p.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one setting, e.g. -s run.steps=8 (repeatable)")
    p.add_argument("--retries", type=int, default=RETRIES)
    p.add_argument("--rollout-server", default="start",
                   help='"start" (one `qerl serve` for the flow run; default), an address, or "none"')
    p.add_argument("--serve", action="store_true",
                   help="serve the flow as a deployment (needs a Prefect server: PREFECT_API_URL)")
    p.add_argument("--name", default="qerl-train-served", help="deployment name with --serve")
    p.add_argument("--cron", default=None, help='cron schedule with --serve, e.g. "0 2 * * *" (default: none)')
    args = p.parse_args(argv)
    params = {"workspace": str(Path(args.workspace).resolve()), "config": args.config,
              "overrides": args.overrides, "retries": args.retries, "rollout_server": args.rollout_server}
    if (refused := common.refuse_bad_config("qerl-train", args.workspace, args.config, args.overrides)) is not None:
        return refused
    if args.serve:
        train.serve(name=args.name, cron=args.cron, parameters=params, tags=["qerl"], limit=1)
        return 0
    try:
        result = train(**params)
    except Exception as e:  # the flow run's log holds the details
        print(f"qerl-train failed: {e}", file=sys.stderr)
        return 1
    o = result["overhead"]
    print(f"qerl-train: {o['stages_ran']} stages ran, {o['stages_skipped']} up to date; "
          f"orchestration per executed stage: Prefect {o['prefect_s_per_stage']:.2f}s, DVC {o['dvc_s_per_stage']:.2f}s")
    from qerl_lib.config import load_config
    from qerl_lib.outcome import result_lines

    ws = Path(result["workspace"])
    steps = load_config(ws / "params.yaml").run.steps  # what the flow ran: params.yaml as it wrote it
    print("\n".join(result_lines(ws, steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
