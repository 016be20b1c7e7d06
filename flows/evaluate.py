"""`qerl-evaluate`: evaluate the adapters of a workspace (the `eval@k` DVC stages) and
refresh its report.

    python flows/evaluate.py -w . -s eval.k=16 -s eval.max_prompts=null
    python flows/evaluate.py -w . --step 0 --step 8

The eval settings are DVC params of the eval stages: changing them (through `config`,
`overrides` or `settings`) makes DVC run those stages again; unchanged, DVC skips them.
`steps` picks adapters among the planned evaluations (`plan.evals` in params.yaml:
0, every `eval.every` steps, and run.steps); by default every planned one whose adapter
exists. The report stage runs last, so reports/ and the curves include the new numbers.
"""

from __future__ import annotations

import flows._env  # noqa: F401  (before Prefect is imported)

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from flows import common
from flows.rollout_server import rollout_service
from tasks.stage import RETRIES


def _run_name() -> str:
    from prefect.runtime import flow_run

    p = flow_run.parameters or {}
    ws = Path(p.get("workspace") or ".").expanduser().resolve().name or "workspace"
    return f"evaluate-{ws}"


@flow(name="qerl-evaluate", flow_run_name=_run_name, persist_result=False, validate_parameters=True,
      description="Evaluate the adapters of a qerl workspace (eval@k stages) and refresh its report.")
def evaluate(
    workspace: str = ".",
    config: str | None = None,
    overrides: list[str] | None = None,
    settings: dict[str, Any] | None = None,
    steps: list[int] | None = None,
    retries: int = RETRIES,
    rollout_server: str = "start",
) -> dict:
    """Evaluate adapters `steps` (default: every planned evaluation whose adapter exists).

    Args:
        workspace: the git + DVC repository holding dvc.yaml.
        config: qerl config YAML (default: the workspace's params.yaml).
        overrides: `section.key=value` settings, e.g. ["eval.k=16"].
        settings: nested dict of settings applied last.
        steps: adapters k to evaluate (each must be in params.yaml's plan.evals).
        retries: retries of a stage that failed for a reason that may pass.
    """
    from prefect.runtime import flow_run

    from qerl_lib.paths import Layout
    from qerl_lib.run import eval_steps

    log = get_run_logger()
    with common.workspace_run(workspace, config, overrides, settings, log) as (ws, cfg):
        planned = eval_steps(cfg)
        layout = Layout(ws)
        if steps:
            unknown = [k for k in steps if k not in planned]
            if unknown:
                raise common.WorkspaceError(
                    f"eval@{unknown[0]} is not a stage of this workspace (planned evaluations: {planned}); "
                    "evaluations follow eval.every and run.steps")
            missing = [k for k in steps if not (layout.adapter(k) / "adapter_model.safetensors").is_file()]
            if missing:
                raise common.WorkspaceError(f"adapter {missing[0]} does not exist yet in {ws} (train first)")
            chosen = sorted(set(steps))
        else:
            chosen = [k for k in planned if (layout.adapter(k) / "adapter_model.safetensors").is_file()]
            if not chosen:
                raise common.WorkspaceError(f"no adapter to evaluate in {ws} (train first)")
        stages = [f"eval@{k}" for k in chosen] + ["report"]
        common.check_stages(ws, stages)
        log.info("evaluating adapters %s of %s", chosen, ws)
        with rollout_service(ws, rollout_server, log) as before:
            records = common.run_stages(ws, stages, log, retries, "qerl-evaluate-progress", f"evaluate {ws.name}",
                                        fast_skip=False, before=before)
        rows = [r for r in common.eval_rows(ws, cfg.run.steps) if r["step"] in chosen]
        create_table_artifact(rows, key="qerl-evaluate", description=f"evaluation of {ws}: pass@1 over k samples "
                                                                     f"(k={cfg.eval.k}, T={cfg.eval.temperature}) "
                                                                     "and greedy accuracy per adapter")
        md = common.curves_markdown(ws, cfg, f"qerl evaluation: {ws.name}", plots=("accuracy", "reward", "entropy"))
        create_markdown_artifact(md + "\n" + common.timing_markdown(records), key="qerl-evaluate-report",
                                 description=f"evaluation report of {ws}")
        return {"workspace": str(ws), "flow_run_id": str(flow_run.id), "evals": rows, "stages": records,
                "overhead": common.overhead_summary(records)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python flows/evaluate.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--workspace", "-w", default=".")
    p.add_argument("--config", "-c", default=None)
    p.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--step", dest="steps", type=int, action="append", default=None,
                   help="adapter k to evaluate (repeatable; default: every planned one that exists)")
    p.add_argument("--retries", type=int, default=RETRIES)
    p.add_argument("--rollout-server", default="start",
                   help='"start" (one `qerl serve` for the flow run; default), an address, or "none"')
    args = p.parse_args(argv)
    if (refused := common.refuse_bad_config("qerl-evaluate", args.workspace, args.config, args.overrides)) is not None:
        return refused
    try:
        result = evaluate(workspace=str(Path(args.workspace).resolve()), config=args.config,
                          overrides=args.overrides, steps=args.steps, retries=args.retries,
                          rollout_server=args.rollout_server)
    except Exception as e:
        print(f"qerl-evaluate failed: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result["evals"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
