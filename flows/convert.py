"""`qerl-convert`: make the workspace's NVFP4A16 (or BF16) checkpoint: the `prepare` and
`convert` DVC stages (llm-compressor; data-free, or GPTQ on the prepared training prompts with
`model.nvfp4_calibration: gptq`), with the size / quantization-error report shown as a Prefect
artifact.

    python flows/convert.py -w . -s model.base=/models/Qwen2.5-7B-Instruct

Useful on its own to convert a large base once on the GPU machine before training, or to
check a new base; `qerl-train` runs the same stage (DVC skips it when it is up to date).
"""

from __future__ import annotations

import flows._env  # noqa: F401  (before Prefect is imported)

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from flows import common
from tasks.stage import RETRIES


def _run_name() -> str:
    from prefect.runtime import flow_run

    p = flow_run.parameters or {}
    ws = Path(p.get("workspace") or ".").expanduser().resolve().name or "workspace"
    return f"convert-{ws}"


def report_markdown(ws: Path, cfg) -> str:
    path = ws / "models" / cfg.model.quant / "convert_report.json"
    rep = json.loads(path.read_text())
    per_layer = rep.get("rel_error_per_layer") or {}
    worst = sorted(per_layer.items(), key=lambda kv: -kv[1])[:10]
    md = [f"# checkpoint of {ws.name}", "",
          f"base `{cfg.model.base}` → `{path.parent.relative_to(ws)}` ({rep.get('quant')}"
          f"{', ' + rep['recipe']['scheme'] if rep.get('recipe') else ''}, compressed-tensors)", "",
          "| | |", "| --- | --- |",
          f"| weight bytes before | {rep.get('bytes_before', 0) / 1e6:.1f} MB |",
          f"| weight bytes after | {rep.get('bytes_after', 0) / 1e6:.1f} MB |",
          f"| size ratio | {rep.get('size_ratio', float('nan')):.3f} |",
          f"| quantized layers | {rep.get('layers', 0)} |",
          f"| relative error, mean | {rep.get('rel_error_mean', 0.0):.4f} |",
          f"| relative error, max | {rep.get('rel_error_max', 0.0):.4f} |",
          f"| checkpoint sha256 | `{rep.get('checkpoint_hash', '')}` |"]
    recipe = rep.get("recipe") or {}
    if recipe.get("method") == "gptq":
        md.insert(-1, f"| rounding | GPTQ on {recipe.get('calibration_sequences')} sequences, "
                      f"{recipe.get('calibration_tokens')} tokens ({recipe.get('calibration_source')}) |")
    if worst:
        md += ["", "worst layers (||W - deq(q(W))|| / ||W||):", "", "| layer | rel. error |", "| --- | --- |"]
        md += [f"| `{name}` | {err:.4f} |" for name, err in worst]
    return "\n".join(md) + "\n"


@flow(name="qerl-convert", flow_run_name=_run_name, persist_result=False, validate_parameters=True,
      description="Convert the base model of a qerl workspace to NVFP4A16 (llm-compressor) or BF16.")
def convert(
    workspace: str = ".",
    config: str | None = None,
    overrides: list[str] | None = None,
    settings: dict[str, Any] | None = None,
    retries: int = RETRIES,
) -> dict:
    """Run the prepare and convert stages of `workspace` (DVC skips each when it is up to date).

    Args:
        workspace: the git + DVC repository holding dvc.yaml.
        config: qerl config YAML (default: the workspace's params.yaml).
        overrides: `section.key=value` settings, e.g. ["model.base=/models/x", "model.quant=nvfp4"].
        settings: nested dict of settings applied last.
        retries: retries of a stage that failed for a reason that may pass.
    """
    from prefect.runtime import flow_run

    log = get_run_logger()
    with common.workspace_run(workspace, config, overrides, settings, log) as (ws, cfg):
        # prepare first: convert depends on the training prompts (GPTQ's calibration set)
        common.check_stages(ws, ["prepare", "convert"])
        records = common.run_stages(ws, ["prepare", "convert"], log, retries, "qerl-convert-progress", f"convert {ws.name}",
                                    fast_skip=False)
        create_markdown_artifact(report_markdown(ws, cfg) + "\n" + common.timing_markdown(records),
                                 key="qerl-convert-report",
                                 description=f"checkpoint size and quantization error of {ws}")
        report = json.loads((ws / "models" / cfg.model.quant / "convert_report.json").read_text())
        report.pop("rel_error_per_layer", None)
        return {"workspace": str(ws), "flow_run_id": str(flow_run.id), "report": report, "stages": records}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python flows/convert.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--workspace", "-w", default=".")
    p.add_argument("--config", "-c", default=None)
    p.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--retries", type=int, default=RETRIES)
    args = p.parse_args(argv)
    if (refused := common.refuse_bad_config("qerl-convert", args.workspace, args.config, args.overrides)) is not None:
        return refused
    try:
        result = convert(workspace=str(Path(args.workspace).resolve()), config=args.config,
                         overrides=args.overrides, retries=args.retries)
    except Exception as e:
        print(f"qerl-convert failed: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result["report"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
