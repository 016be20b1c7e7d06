"""Summarize the issue-16 runs (experiments/qwen05_gsm8k, or another recipe's folder) into results/.

    python experiments/qwen05_gsm8k/summarize.py --archive DIR [--archive DIR ...]
    python experiments/qwen05_gsm8k/summarize.py --experiment qwen05_gsm8k_v2 --archive DIR \
        --base-from experiments/qwen05_gsm8k/results/summary.json
    python experiments/qwen05_gsm8k/summarize.py --experiment qwen05_gsm8k_v2 --base-evals DIR \
        --base-from experiments/qwen05_gsm8k/results/summary.json

`--experiment NAME` summarizes the runs of `experiments/NAME/ARM.yaml` into `experiments/NAME/results`
(default: this folder). Each DIR is an unpacked `qwen_arms_*.tgz` of `scripts/device_experiment.sh qwen-arms` (its `runs/ARM/seedS`
workspaces: reports, eval metrics, per-step metric files; and `logs/`). A run in an archive replaces
the same arm and seed in `results/runs` as a whole (an archive holds a workspace's full state, and a
re-run of a seed must not keep an earlier attempt's files); runs it does not hold stay. `--base-evals DIR`
takes the `$OUT` of `scripts/device_experiment.sh qwen-base-evals` (a base evaluated without training:
`ARM.step0_metrics.json` and `ARM.convert_report.json` per arm) into `results/base_evals/ARM`. Writes,
beside this file:

- `results/runs/ARM/seedS/`: the files that the figures come from (steps.csv, eval.csv, metrics.json,
  stage_times.jsonl, config.yaml, vllm_engine.json, convert_report.json, eval/step=K/metrics.json, and
  24 rows of each evaluation's samples); each JSON object gains `command`, the run's command line;
- `results/summary.json`: one row per (arm, seed) with `arm`, `seed`, `steps` (RL steps done),
  `greedy_acc`, `pass1` (pass@1 over k samples), their standard errors, `n_test`, wall-clock, `late`
  (training-step columns averaged over the run's second half, LATE_KEYS); the base
  rows (`arm: "base"` for BF16, `arm: "base_nvfp4"` for the NVFP4 base, `base_nvfp4_<observer>` for an
  NVFP4 base whose scales another `model.nvfp4_observer` chose, `..._gptq` appended for one that GPTQ
  rounded, `model.nvfp4_calibration`) from the step-0 evaluations, those of the runs and those of
  `results/base_evals` (`base_eval_rows`);
  runs without an evaluation at their last step are listed under `incomplete` with the steps they
  trained (`steps` = `planned` when only the final evaluation was cut); a run evaluated before its last
  step too (`eval.every`) carries `evals`, greedy accuracy and pass@1 at each evaluated step (`evals_by_step`),
  complete or not; `per_arm`, each arm's mean and standard deviation over its seeds (and, where a run
  has `evals`, their mean at each step over the seeds evaluated there); `paired`, the seed-against-seed differences between arms (the function `paired`);
- `results/curves.png`: reward, entropy, KL to the base and the samples' correct rate per step, one line per arm
  (the mean over its seeds that trained every step, evaluated or not, with a band of +- one standard
  deviation where there are two or more); an arm none of whose runs trained every step is drawn run by
  run, dashed, as far as each got.

An archive without `reports/` (taken while the run still held its workspace) gets its `steps.csv` and
`eval.csv` rebuilt from the run's metric files (`rebuild_reports`).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import re
import shutil
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXPERIMENTS = HERE.parent
DEFAULT_EXPERIMENT = HERE.name
ARMS = ["bf16", "nvfp4", "nvfp4_aqn", "bf16_aqn", "nvfp4_aqn_rel", "nf4", "nvfp4_aqn_mse", "nvfp4_gptq", "nvfp4_aqn_gptq"]
"""The order arms are listed and plotted in; an arm not named here follows them, by name. A reference
arm comes before the arms measured against it (`paired`: the later arm minus the earlier)."""


def arm_order(names) -> list[str]:
    """`names` (the arms that have runs), in ARMS order, then any others sorted."""
    names = set(names)
    return [a for a in ARMS if a in names] + sorted(names - set(ARMS))
KEEP = ["reports/steps.csv", "reports/eval.csv", "reports/metrics.json", "reports/stage_times.jsonl",
        "config.yaml", "vllm_engine.json"]


def _csv(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path) as f:
        return [{k: _num(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _num(v: str):
    try:
        x = float(v)
    except (TypeError, ValueError):
        return v
    return int(x) if x.is_integer() and "." not in v and "e" not in v.lower() else x


RUN_OVERRIDABLE = [("eval", "every")]
"""Fields a device run may override (`QWEN_RUN_SET`) without changing what it trains: `run_command`
names them when the run's `config.yaml` differs from its arm's file."""


def run_command(ws: Path, experiment: str = DEFAULT_EXPERIMENT) -> str:
    """The command that made workspace `ws`'s files (its own `config.yaml` says seed, base eval and any
    `RUN_OVERRIDABLE` field that differs from `experiments/<experiment>/<arm>.yaml`)."""
    import yaml

    arm, seed = ws.parent.name, int(ws.name[4:])
    cfg = yaml.safe_load((ws / "config.yaml").read_text()) if (ws / "config.yaml").is_file() else {}
    base = str(cfg.get("eval", {}).get("base", True)).lower()
    arm_file = EXPERIMENTS / experiment / f"{arm}.yaml"
    planned = yaml.safe_load(arm_file.read_text()) if arm_file.is_file() else {}
    extra = "".join(f" -s {sec}.{key}={cfg[sec][key]}" for sec, key in RUN_OVERRIDABLE
                    if key in cfg.get(sec, {}) and key in planned.get(sec, {})
                    and cfg[sec][key] != planned[sec][key])
    return (f"python -m qerl_lib run -c experiments/{experiment}/{arm}.yaml -s data.source=<gsm8k dir> "
            f"-s run.seed={seed} -s aqn.seed={1234 + seed} -s eval.base={base}{extra} --root <workspace> "
            "(through `scripts/device_experiment.sh qwen-arms`; calls in docs/results_qwen05_gsm8k.md)")


def _copy(src: Path, dest: Path, command: str) -> None:
    """Copy `src` to `dest`; a JSON object also gets the `command` that produced it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if src.suffix == ".json":
        obj = json.loads(src.read_text())
        if isinstance(obj, dict):
            dest.write_text(json.dumps({**obj, "command": command}, indent=2, sort_keys=True) + "\n")
            return
    shutil.copy2(src, dest)


def rebuild_reports(ws: Path, dest: Path) -> list[Path]:
    """Write `dest/steps.csv` and `dest/eval.csv` from the per-step metric files of workspace `ws`
    (`qerl_lib.report`, the report stage's own tables), for an archive that holds no `reports/`.

    An archive taken while `qerl run` still works in the workspace has none: the report stage is
    refused while a run holds the workspace lock, and `qwen-wait` archives every run, running or not.
    Its metric files (`metrics/step=I/update.json`, `rewards/step=I/metrics.json`,
    `eval/step=K/metrics.json`) are there, so the progress of a run that the machine lost mid-way is
    not lost with it. Rows lack `rollout_seconds` (the rollouts' provenance stays on the machine).
    Returns the files written (none when `ws` has no metric file)."""
    from qerl_lib import report
    from qerl_lib.io import atomic_write_text
    from qerl_lib.paths import Layout

    cfg = (ws / "config.yaml").read_text() if (ws / "config.yaml").is_file() else ""
    layout, planned = Layout(ws), _planned_steps(cfg)
    written = []
    for name, rows, columns in (("steps.csv", report.collect_steps(layout, planned), report.STEP_COLUMNS),
                                ("eval.csv", report.collect_evals(layout, planned), report.EVAL_COLUMNS)):
        if rows:
            dest.mkdir(parents=True, exist_ok=True)
            atomic_write_text(dest / name, report.to_csv(rows, columns))
            written.append(dest / name)
    return written


def collect(archives: list[Path], out: Path, experiment: str = DEFAULT_EXPERIMENT) -> None:
    """Copy the result files of every run in `archives` (later ones win) into `out/runs`."""
    for arc in archives:
        for ws in sorted(arc.glob("runs/*/seed*")):
            dest = out / "runs" / ws.parent.name / ws.name
            if dest.exists():
                shutil.rmtree(dest)
            command = run_command(ws, experiment)
            for rel in KEEP:
                if (ws / rel).is_file():
                    _copy(ws / rel, dest / Path(rel).name, command)
            for p in ws.glob("models/*/convert_report.json"):
                _copy(p, dest / "convert_report.json",
                      f"python -m qerl_lib stage convert -c experiments/{experiment}/{p.parent.name}.yaml "
                      "-s data.source=<gsm8k dir> --root <template workspace> (`scripts/device_experiment.sh "
                      "qwen-convert`, once per quantization; hard-linked into each run's workspace)")
            if not (dest / "steps.csv").is_file():
                rebuild_reports(ws, dest)
            for p in ws.glob("eval/step=*/metrics.json"):
                _copy(p, dest / "eval" / p.parent.name / "metrics.json", command)
            for p in ws.glob("samples/*.parquet"):
                (dest / "samples").mkdir(parents=True, exist_ok=True)
                shutil.copy2(p, dest / "samples" / p.name)
            log = arc / "logs" / f"{ws.parent.name}.{ws.name}.log"
            if log.is_file():  # the stage lines only: the progress of the run, call by call
                lines = [s for s in log.read_text(errors="replace").splitlines()
                         if re.match(r"^\[\d+/\d+\] |^run .* rc=", s)]
                dest.mkdir(parents=True, exist_ok=True)
                (dest / "stages.log").write_text("\n".join(lines) + "\n")


def collect_base_evals(dirs: list[Path], out: Path, experiment: str = DEFAULT_EXPERIMENT) -> None:
    """Copy every base evaluation in `dirs` (each the `$OUT` of `scripts/device_experiment.sh qwen-base-evals`)
    into `out/base_evals/ARM`: its metrics.json and convert_report.json, and the stage lines of its log.
    An arm whose evaluation did not finish (no `ARM.step0_metrics.json`) is not taken; one that did
    replaces an earlier copy as a whole."""
    found = [(src, m.name.removesuffix(".step0_metrics.json")) for src in dirs
             for m in sorted(src.glob("*.step0_metrics.json"))]
    for src, arm in found:  # all checked before anything is copied
        if not (src / f"{arm}.convert_report.json").is_file():
            raise ValueError(f"{src / f'{arm}.convert_report.json'}: missing beside {arm}.step0_metrics.json "
                             "(a base evaluation names its checkpoint by it)")
    for src, arm in found:
        metrics, report = src / f"{arm}.step0_metrics.json", src / f"{arm}.convert_report.json"
        dest = out / "base_evals" / arm
        if dest.exists():
            shutil.rmtree(dest)
        command = (f"python -m qerl_lib stage eval --step 0 -c experiments/{experiment}/{arm}.yaml "
                   "-s data.source=<gsm8k dir> -s run.seed=0 -s aqn.seed=1234 -s eval.base=true --root <workspace> "
                   f"(after `stage prepare` and `stage init_adapter`, through `scripts/device_experiment.sh "
                   f"qwen-base-evals {arm}`; calls in docs/results_qwen05_gsm8k.md)")
        _copy(metrics, dest / "metrics.json", command)
        _copy(report, dest / "convert_report.json",
              f"python -m qerl_lib stage convert -c experiments/{experiment}/{arm}.yaml -s data.source=<gsm8k dir> "
              "--root <template workspace> (`scripts/device_experiment.sh qwen-base-evals`)")
        log = src / f"{arm}.base.log"
        if log.is_file():
            lines = [s for s in log.read_text(errors="replace").splitlines()
                     if re.match(r"^(prepare|init_adapter|eval@\d+): ", s)]
            (dest / "stages.log").write_text("\n".join(lines) + "\n")


def _steps_done(run: Path, rows: list[dict]) -> int:
    """RL steps the run finished, from its steps.csv `rows` (else from its stage log)."""
    done = [r["step"] for r in rows if r.get("has_update") == 1]
    if done:
        return max(done) + 1
    log = run / "stages.log"  # a run stopped before its first report: count its update lines
    ups = re.findall(r"\] update@(\d+):", log.read_text()) if log.is_file() else []
    return max(map(int, ups)) + 1 if ups else 0


LATE_KEYS = ("correct_rate", "kept_frac", "zero_variance_groups", "clip_frac", "completion_len_mean", "truncated_frac")
"""Training-step columns averaged over the second half of a run (`late`): what the recipe spends its samples on."""


def late_means(steps: list[dict], planned: int) -> dict:
    """Means of LATE_KEYS over the rows of `steps` (a run's steps.csv) in the run's second half
    (step >= planned // 2) that have them."""
    rows = [r for r in steps if isinstance(r.get("step"), int) and r["step"] >= planned // 2]
    out = {"from_step": planned // 2}
    for key in LATE_KEYS:
        vals = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        out[key] = round(statistics.fmean(vals), 4) if vals else None
    return out


def evals_by_step(evals: dict[int, dict], planned: int) -> dict[str, dict]:
    """A run's evaluations after training began, {"K": {"greedy_acc", "pass1"}} for each step K in
    1..`planned` it was evaluated at (`evals`: step -> that step's eval metrics.json), when at least one
    came before the last step (`eval.every`); else {}, so a run evaluated only at its end adds no key."""
    steps = sorted(k for k in evals if 0 < k <= planned)
    if not any(k < planned for k in steps):
        return {}
    return {str(k): {"greedy_acc": evals[k]["greedy_acc"], "pass1": evals[k]["pass_at_1"]} for k in steps}


def _planned_steps(cfg: str) -> int:
    """`run.steps` of a run's saved `config.yaml` text (60, the first recipe's, when it has none)."""
    import yaml

    steps = ((yaml.safe_load(cfg) or {}).get("run") or {}).get("steps") if cfg else None
    return int(steps) if steps is not None else 60


def _checkpoint_hash(run: Path) -> str | None:
    """The hash of the converted base checkpoint that run `run` trained on (its convert_report.json)."""
    report = run / "convert_report.json"
    return json.loads(report.read_text()).get("checkpoint_hash") if report.is_file() else None


def reuse_base(base: list[dict], hashes: dict[str, str | None], base_from: Path) -> list[dict]:
    """Base rows of the summary at `base_from` for the quantizations (`hashes`: base arm name ->
    checkpoint hash its runs trained on) that `base` (this experiment's own base rows) lacks.

    A base row is reused only for the same checkpoint bytes, since the base's answers depend on
    the weights, the prompt and the evaluation settings alone (the experiments' `model`, `data`
    and `eval` sections must agree: `tests/test_qwen_packages.py`). Raises ValueError, naming the
    file and the hashes, when that summary measured a quantization's base on other bytes; a
    quantization it never measured stays without a base row."""
    have = {r["arm"] for r in base}
    other = json.loads(base_from.read_text()).get("base", [])
    reused = []
    for arm, digest in sorted(hashes.items()):
        if arm in have:
            continue
        mine = [r for r in other if r["arm"] == arm]
        if not mine:  # that summary never measured this base either (the first recipe's NF4)
            continue
        match = [r for r in mine if digest and r.get("checkpoint_hash") == digest]
        if not match:
            found = sorted({str(r.get("checkpoint_hash")) for r in mine})
            raise ValueError(f"{base_from}: no `{arm}` row for checkpoint {digest} (the runs' "
                             f"convert_report.json); its `{arm}` rows have {', '.join(found)}")
        reused.append({**match[0], "from_summary": str(base_from)})
    return reused


def paired(rows: list[dict]) -> dict:
    """Seed-against-seed differences between arms, from the final-evaluation `rows` (one per arm and seed).

    Arms run at the same seed draw the same training problems in the same order, so the difference
    at one seed leaves out the share of the spread that the seed's problems cause. For every two arms
    with at least two seeds in common, keyed "B - A" with A before B in ARMS order (a reference arm
    such as bf16 second): the shared `seeds`, and for `greedy_acc` and `pass1` the differences at
    those seeds (B's score minus A's), their mean (`_mean`) and sample standard deviation (`_std`)."""
    by_arm: dict[str, dict[int, dict]] = {}
    for r in rows:
        by_arm.setdefault(r["arm"], {})[r["seed"]] = r
    out = {}
    for a, b in itertools.combinations(arm_order(by_arm), 2):
        seeds = sorted(by_arm[a].keys() & by_arm[b].keys())
        if len(seeds) < 2:
            continue
        pair: dict = {"seeds": seeds}
        for key in ("greedy_acc", "pass1"):
            diffs = [by_arm[b][s][key] - by_arm[a][s][key] for s in seeds]
            pair[key] = diffs
            pair[f"{key}_mean"] = statistics.fmean(diffs)
            pair[f"{key}_std"] = statistics.stdev(diffs)
        out[f"{b} - {a}"] = pair
    return out


def base_arm_name(quant: str | None, observer: str | None = None, calibration: str | None = None) -> str:
    """The summary's name for the base checkpoint of `model.quant`, `model.nvfp4_observer` and
    `model.nvfp4_calibration` (None: the defaults): `base` for BF16, `base_<quant>` otherwise, and for
    NVFP4 `_<observer>` after another observer than min-max (other group scales) and `_<calibration>`
    after GPTQ's rounding: each is another checkpoint, whose base is measured on its own."""
    name = "base" if not quant or quant == "bf16" else f"base_{quant}"
    if name == "base_nvfp4" and observer and observer != "memoryless_minmax":
        name += f"_{observer}"
    if name.startswith("base_nvfp4") and calibration and calibration != "none":
        name += f"_{calibration}"
    return name


def _base_row(arm: str, m: dict, digest: str | None, seed: int = 0, **source) -> dict:
    """A summary base row from a step-0 evaluation's metrics.json `m`."""
    return {"arm": arm, **source, "seed": seed, "steps": 0, "greedy_acc": m["greedy_acc"], "greedy_se": m["greedy_acc_se"],
            "pass1": m["pass_at_1"], "pass1_se": m["pass_at_1_se"], "k": m["k"], "n_test": m["n_prompts"],
            "greedy_format_rate": m["greedy_format_rate"], "checkpoint_hash": digest}


def base_eval_rows(out: Path, have: set[str], hashes: dict[str, str | None]) -> list[dict]:
    """Base rows of `out/base_evals/ARM` (bases evaluated without training, `collect_base_evals`) for the
    base checkpoints that no run's own step-0 evaluation measured (`have`: their names). The name comes
    from the folder's convert_report.json (quantization, observer, GPTQ), never from the arm's name.
    Raises ValueError, naming the file, when runs of that base trained on other bytes (`hashes`)."""
    rows = []
    for d in sorted(p for p in (out / "base_evals").glob("*") if p.is_dir()):
        report_path = d / "convert_report.json"
        if not report_path.is_file():
            raise ValueError(f"{report_path}: missing (a base evaluation names its checkpoint by it)")
        report = json.loads(report_path.read_text())
        recipe_ = report.get("recipe") or {}
        arm = base_arm_name(report.get("quant"), recipe_.get("observer"),
                            "gptq" if recipe_.get("method") == "gptq" else None)
        digest = report.get("checkpoint_hash")
        if hashes.get(arm, digest) != digest:
            raise ValueError(f"{report_path}: checkpoint {digest}, but the {arm} runs of {out} trained on {hashes[arm]}")
        if arm in have:
            continue
        rows.append(_base_row(arm, json.loads((d / "metrics.json").read_text()), digest,
                              from_base_eval=f"base_evals/{d.name}"))
        have = have | {arm}
    return rows


def summarize(out: Path, experiment: str = DEFAULT_EXPERIMENT, base_from: Path | None = None) -> dict:
    rows, base, incomplete, hashes = [], [], [], {}
    for run in sorted(out.glob("runs/*/seed*")):
        arm, seed = run.parent.name, int(run.name[4:])
        cfg = (run / "config.yaml").read_text() if (run / "config.yaml").is_file() else ""
        planned = _planned_steps(cfg)
        quant, observer, calibration = (re.search(rf"^  {key}: (\w+)", cfg, re.M)
                                        for key in ("quant", "nvfp4_observer", "nvfp4_calibration"))
        base_arm = base_arm_name(*(m and m.group(1) for m in (quant, observer, calibration)))
        digest = _checkpoint_hash(run)
        hashes.setdefault(base_arm, digest)
        if hashes[base_arm] != digest:
            raise ValueError(f"{run / 'convert_report.json'}: checkpoint {digest}, but other {base_arm[5:] or 'bf16'} "
                             f"runs of {out} trained on {hashes[base_arm]}")
        evals = {int(p.parent.name.split("=")[1]): json.loads(p.read_text()) for p in run.glob("eval/step=*/metrics.json")}
        step_rows = _csv(run / "steps.csv")
        steps = _steps_done(run, step_rows)
        times = [json.loads(s) for s in (run / "stage_times.jsonl").read_text().splitlines()] \
            if (run / "stage_times.jsonl").is_file() else []
        by_stage: dict[str, float] = {}
        for t in times:
            by_stage[t["stage"]] = round(by_stage.get(t["stage"], 0.0) + t["seconds"], 1)
        if 0 in evals:
            base.append(_base_row(base_arm, evals[0], digest, seed, from_run=f"{arm}/seed{seed}"))
        trajectory = evals_by_step(evals, planned)
        extra = {"evals": trajectory} if trajectory else {}
        if planned not in evals:  # an evaluation before the deadline's cut is kept with the run's steps
            incomplete.append({"arm": arm, "seed": seed, "steps": steps, "planned": planned,
                               "seconds_by_stage": by_stage, **extra})
            continue
        m = evals[planned]
        rows.append({"arm": arm, "seed": seed, "steps": steps, "greedy_acc": m["greedy_acc"],
                     "greedy_se": m["greedy_acc_se"], "pass1": m["pass_at_1"], "pass1_se": m["pass_at_1_se"],
                     "k": m["k"], "n_test": m["n_prompts"], "greedy_format_rate": m["greedy_format_rate"],
                     "seconds_by_stage": by_stage, "seconds_total": round(sum(by_stage.values()), 1),
                     "late": late_means(step_rows, planned), **extra})
    per_arm = {}
    for arm in arm_order(r["arm"] for r in rows):
        rs = [r for r in rows if r["arm"] == arm]
        agg = {"seeds": [r["seed"] for r in rs]}
        for key in ("greedy_acc", "pass1"):
            vals = [r[key] for r in rs]
            agg[key] = statistics.fmean(vals)
            agg[f"{key}_std"] = statistics.stdev(vals) if len(vals) > 1 else None
        if any("evals" in r for r in rs):  # the mean over the seeds evaluated at each step (all, at the last)
            by_step = [r.get("evals") or {str(r["steps"]): {"greedy_acc": r["greedy_acc"], "pass1": r["pass1"]}}
                       for r in rs]
            agg["evals"] = {}
            for k in sorted({int(k) for e in by_step for k in e}):
                seen = [e[str(k)] for e in by_step if str(k) in e]
                agg["evals"][str(k)] = {key: statistics.fmean(e[key] for e in seen) for key in ("greedy_acc", "pass1")}
        per_arm[arm] = agg
    base = base + base_eval_rows(out, {r["arm"] for r in base}, hashes)
    if base_from is not None:
        base = base + reuse_base(base, hashes, base_from)
    flags = "" if experiment == DEFAULT_EXPERIMENT else f"--experiment {experiment} "
    if base_from is not None:
        flags += f"--base-from {base_from} "
    return {"base": base, "rows": base + rows, "per_arm": per_arm, "paired": paired(rows), "incomplete": incomplete,
            "command": f"python experiments/{DEFAULT_EXPERIMENT}/summarize.py {flags}--archive <unpacked "
                       "qwen_arms_*.tgz> (once per session's archive: each adds its runs to results/runs, then all of "
                       "results/runs is summarized; docs/results_qwen05_gsm8k.md lists the sessions)",
            "runs_made_by": "results/runs/*/seed*/*.json: their `command`"}


def recipe(experiment: str) -> tuple[int, int, str]:
    """(RL steps, samples per step, model title) of `experiments/<experiment>`, from its `bf16.yaml` (every
    experiment has that arm; its arms share steps, batch and model: tests/test_qwen_packages.py)."""
    import yaml

    from qerl_lib.registry_models import PACKAGED_MODELS

    cfg = yaml.safe_load((EXPERIMENTS / experiment / "bf16.yaml").read_text())
    base = cfg["model"]["base"]
    title = PACKAGED_MODELS[base].title.removesuffix(" Q4_K_M GGUF") if base in PACKAGED_MODELS else base
    return cfg["run"]["steps"], cfg["rollout"]["prompts_per_step"] * cfg["rollout"]["group_size"], title


def _value(row: dict, key: str) -> float:
    """Column `key` of a steps.csv row as a float (NaN where the step has no such value)."""
    v = row.get(key)
    return float(v) if v not in ("", None) else math.nan


def plot(out: Path, arms: list[str], experiment: str = DEFAULT_EXPERIMENT) -> list[str]:
    """Draw `out/curves.png` (see the module docstring); return the legend's labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, samples, model = recipe(experiment)
    keys = [("reward_mean", f"training reward (mean of the step's {samples} samples)"), ("entropy", "entropy (nats/token)"),
            ("kl", "KL to the base (measured, not penalized)"), ("correct_rate", "correct rate of the samples")]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, (key, title) in zip(axes.flat, keys):
        for arm in arms:
            seeds = {p: _csv(p / "steps.csv") for p in sorted((out / "runs" / arm).glob("seed*"))}
            runs = [r for r in seeds.values() if r and len(r) >= steps]
            if not runs:  # no run trained every step: each run that stopped, as far as it got
                for run, r in seeds.items():
                    if r:
                        ax.plot([row["step"] for row in r], [_value(row, key) for row in r], linestyle="--",
                                label=f"{arm} {run.name} (stopped: {_steps_done(run, r)} of {steps} steps)")
                continue
            n = min(len(r) for r in runs)
            xs = list(range(n))
            cols = [[_value(r[i], key) for i in xs] for r in runs]
            mean = [statistics.fmean(c[i] for c in cols) for i in xs]
            line, = ax.plot(xs, mean, label=f"{arm} ({len(runs)} seed{'s' if len(runs) > 1 else ''})")
            if len(runs) > 1:
                sd = [statistics.stdev(c[i] for c in cols) for i in xs]
                ax.fill_between(xs, [m - s for m, s in zip(mean, sd)], [m + s for m, s in zip(mean, sd)],
                                color=line.get_color(), alpha=0.2)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"{model} on GSM8K, {steps} steps x {samples} samples (experiments/{experiment})")
    fig.tight_layout()
    save_png_palette(fig, out / "curves.png", dpi=110)
    plt.close(fig)
    return axes.flat[0].get_legend_handles_labels()[1]


def save_png_palette(fig, path: Path, dpi: int) -> None:
    """Save `fig` as a 256-colour PNG: a third of the bytes of matplotlib's RGBA file for these plots. The
    GPU calls carry the whole working tree beside 48 MiB of vLLM, under a 63 MiB limit, so every tracked
    byte counts (`scripts/device_experiment.sh carry-check`)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    img = Image.open(buf).convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT)
    img.save(path, format="PNG", optimize=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archive", type=Path, action="append", default=[], help="an unpacked qwen_arms_*.tgz")
    ap.add_argument("--base-evals", type=Path, action="append", default=[],
                    help="the $OUT of a `qwen-base-evals` call (bases evaluated without training)")
    ap.add_argument("--experiment", default=DEFAULT_EXPERIMENT,
                    help="the folder of experiments/ whose runs these are (default: %(default)s)")
    ap.add_argument("--base-from", type=Path, default=None,
                    help="another experiment's summary.json whose base rows stand for bases these runs did not evaluate")
    ap.add_argument("--out", type=Path, default=None, help="default: experiments/EXPERIMENT/results")
    args = ap.parse_args()
    if not (EXPERIMENTS / args.experiment / "bf16.yaml").is_file():
        ap.error(f"--experiment {args.experiment}: {EXPERIMENTS / args.experiment} holds no bf16.yaml")
    out = args.out or EXPERIMENTS / args.experiment / "results"
    out.mkdir(parents=True, exist_ok=True)
    collect(args.archive, out, args.experiment)
    try:
        collect_base_evals(args.base_evals, out, args.experiment)
        summary = summarize(out, args.experiment, args.base_from)
    except ValueError as e:
        raise SystemExit(f"summarize: {e}") from None
    from qerl_lib.io import atomic_write_text  # a failed run never leaves half a summary

    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    plot(out, arm_order(p.name for p in (out / "runs").iterdir() if p.is_dir()), args.experiment)
    for r in summary["rows"]:
        print(f"{r['arm']:>14} seed {r['seed']} steps {r['steps']:>2}: greedy {r['greedy_acc']:.3f} ± {r['greedy_se']:.3f}"
              f"  pass@1 {r['pass1']:.3f} ± {r['pass1_se']:.3f}  (n={r['n_test']})")
        if r.get("evals"):
            print(" " * 22 + "evaluated at step " + ", ".join(
                f"{k}: {e['greedy_acc']:.3f} / {e['pass1']:.3f}" for k, e in r["evals"].items()))
    for name, p in summary["paired"].items():
        print(f"{name:>30}, seeds {p['seeds']}: greedy {100 * p['greedy_acc_mean']:+.1f} ± {100 * p['greedy_acc_std']:.1f}"
              f"  pass@1 {100 * p['pass1_mean']:+.1f} ± {100 * p['pass1_std']:.1f} points")
    for r in summary["incomplete"]:
        why = ("trained every step, its final evaluation did not finish" if r["steps"] >= r["planned"]
               else f"stopped after {r['steps']} of {r['planned']} steps")
        print(f"{r['arm']:>14} seed {r['seed']}: {why} (not counted)" + "".join(
            f"; step {k}: {e['greedy_acc']:.3f} / {e['pass1']:.3f}" for k, e in r.get("evals", {}).items()))


if __name__ == "__main__":
    main()
