"""The one list of stages: for each, its name, what it reads and writes (through `paths.Layout`),
the params it depends on, whether it needs the GPU, and the function that runs it.

Everything that knows about stages derives from `STAGES`: the CLI (`qerl stage NAME`), the local
runner (`qerl run`'s plan and dispatch), the Prefect tasks and flows (GPU slots, timings), the
sweep of a killed stage's temporaries, and `dvc.yaml` (`qerl_lib.dvc_yaml` renders its stage list
from here; a test checks the committed file).

    prepare -> convert -> init_adapter -> [rollout@i -> reward@i -> update@i]* -> eval@k -> report

This module is light (no torch): the doors import it to plan and dispatch, and import a stage's
own module (`qerl_lib.stages.<name>`) only to run it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from qerl_lib.paths import TRAINER_STATE, Layout

Step = Any
"""A step number, or a template string such as `${item.step}` when `dvc.yaml` is rendered."""
PathsFn = Callable[[Layout, str, Step], list[Path]]
"""(layout, model.quant, step) -> paths."""


@dataclass(frozen=True)
class Stage:
    name: str
    """Stage name, as `qerl stage NAME` and DVC (`NAME@step` for per-step stages) spell it."""
    doc: str
    """One line: what the stage makes from what."""
    steps: Literal["none", "train", "eval"]
    """What `--step` ranges over: nothing, the training steps 0..run.steps-1, or the evaluated adapters."""
    inputs: PathsFn
    """Artifacts the stage reads (DVC `deps` beside the code)."""
    outputs: PathsFn
    """Everything the stage writes, each through a temporary name (DVC `outs`; swept after a kill)."""
    done: PathsFn
    """The output written last: its existence means the stage finished (`qerl run` skips it)."""
    params: tuple[str, ...]
    """Exactly the config keys the stage reads (DVC `params`; `tests/test_dvc.py` traces the reads)."""
    gpu: bool
    """Whether it runs on the GPU when there is one (holds a `qerl-gpu` slot under Prefect)."""
    uses_policy: bool
    """Whether it takes the loaded policy (`qerl run` keeps one across stages)."""
    function: str
    """`module:function` of the stage; called as f(cfg, layout[, step][, policy])."""
    seconds_file: PathsFn | None = None
    """A JSON output whose "seconds" key is the stage's own measured work (orchestration timings)."""
    dvc_outs: PathsFn | None = None
    """DVC `outs` when they differ from `outputs` (report: its plots as one directory)."""
    dvc_metrics: PathsFn | None = None
    """DVC `metrics` (cached like outs; `dvc metrics show` reads them)."""

    def label(self, step: int | None) -> str:
        return self.name if step is None else f"{self.name}@{step}"

    def run(self, cfg, layout: Layout, step: int | None = None, policy=None):
        """Run the stage in this process (the function is imported only now)."""
        module, _, func = self.function.partition(":")
        fn = getattr(importlib.import_module(module), func)
        args: list = [cfg, layout]
        if self.steps != "none":
            if step is None:
                raise ValueError(f"stage {self.name} needs a step")
            args.append(step)
        if self.uses_policy:
            args.append(policy)
        return fn(*args)


STAGES: tuple[Stage, ...] = (
    Stage(
        "prepare", "dataset source -> prompts with stable ids and ground truth", "none",
        inputs=lambda lay, q, s: [],
        outputs=lambda lay, q, s: [lay.prepared("train"), lay.prepared("test")],
        # test.parquet is written last (`qerl_lib.data.prepare`)
        done=lambda lay, q, s: [lay.prepared("test")],
        params=("data", "run.seed"), gpu=False, uses_policy=False,
        function="qerl_lib.stages.prepare:prepare_stage",
    ),
    Stage(
        "convert", "base model -> plain HF copy + quantized checkpoint (llm-compressor NVFP4A16)", "none",
        # the training prompts: GPTQ's calibration set (model.nvfp4_calibration: gptq). DVC deps cannot
        # depend on a param, so a data change re-runs a data-free conversion too (same checkpoint hash).
        inputs=lambda lay, q, s: [lay.prepared("train")],
        outputs=lambda lay, q, s: [lay.base_model, lay.checkpoint(q)],
        done=lambda lay, q, s: [lay.convert_report(q)],
        params=("model.base", "model.gguf_file", "model.quant", "model.nvfp4_observer", "model.nvfp4_calibration",
                "model.nvfp4_calibration_samples", "data.prompt", "model.chat_template"), gpu=True, uses_policy=False,
        function="qerl_lib.stages.convert:convert_stage",
    ),
    Stage(
        "init_adapter", "checkpoint -> adapter 0 (seeded A, zero B)", "none",
        inputs=lambda lay, q, s: [lay.checkpoint(q)],
        outputs=lambda lay, q, s: [lay.adapter(0)],
        done=lambda lay, q, s: [lay.adapter(0) / TRAINER_STATE],
        params=("model.compute_dtype", "model.device", "model.quant", "lora"), gpu=False, uses_policy=False,
        function="qerl_lib.stages.init_adapter:init_adapter_stage",
    ),
    Stage(
        "rollout", "checkpoint + adapter i + AQN noise of step i -> G samples per prompt", "train",
        inputs=lambda lay, q, s: [lay.prepared("train"), lay.checkpoint(q), lay.adapter(s)],
        outputs=lambda lay, q, s: [lay.rollouts(s), lay.rollout_provenance(s)],
        done=lambda lay, q, s: [lay.rollouts(s)],
        params=("run.seed", "run.steps", "data.prompt", "model.base", "model.chat_template", "model.compute_dtype",
                "model.device", "model.quant", "lora", "rollout", "aqn"),
        gpu=True, uses_policy=True, function="qerl_lib.stages.rollout:rollout_stage",
        seconds_file=lambda lay, q, s: [lay.rollout_provenance(s)],
    ),
    Stage(
        "reward", "rollouts i -> rewards, group advantages, kept flags", "train",
        inputs=lambda lay, q, s: [lay.rollouts(s)],
        outputs=lambda lay, q, s: [lay.scored(s), lay.reward_metrics(s)],
        done=lambda lay, q, s: [lay.reward_metrics(s)],
        params=("reward", "algo.dynamic_sampling", "algo.scale_rewards", "algo.std_eps"),
        gpu=False, uses_policy=False, function="qerl_lib.stages.reward:reward_stage",
    ),
    Stage(
        "update", "checkpoint + adapter i + scored rollouts i -> adapter i+1", "train",
        inputs=lambda lay, q, s: [lay.checkpoint(q), lay.adapter(s), lay.scored(s)],
        outputs=lambda lay, q, s: [lay.adapter(_next(s)), lay.update_metrics(s)],
        done=lambda lay, q, s: [lay.update_metrics(s)],
        params=("run.seed", "run.steps", "model.compute_dtype", "model.device", "model.quant", "lora",
                "rollout.max_new_tokens", "algo.beta", "algo.eps_high", "algo.eps_low", "algo.kl_metric",
                "algo.loss", "algo.mini_batches", "algo.tis_cap", "optim", "aqn.seed", "aqn.sigma_mode", "aqn.stages",
                "parallel.train_world_size"),
        gpu=True, uses_policy=True, function="qerl_lib.stages.update:update_stage",
        seconds_file=lambda lay, q, s: [lay.update_metrics(s)],
    ),
    Stage(
        "eval", "checkpoint + adapter k + test set -> graded samples, pass@1, greedy accuracy", "eval",
        inputs=lambda lay, q, s: [lay.prepared("test"), lay.checkpoint(q), lay.adapter(s)],
        outputs=lambda lay, q, s: [lay.eval_samples(s), lay.eval_provenance(s), lay.eval_metrics(s)],
        done=lambda lay, q, s: [lay.eval_metrics(s)],
        params=("run.seed", "data.prompt", "model.base", "model.chat_template", "model.compute_dtype", "model.device",
                "model.quant", "lora", "rollout.backend", "rollout.batch_size", "rollout.dense_cache", "reward",
                "aqn.seed", "eval.greedy", "eval.k", "eval.max_new_tokens", "eval.max_prompts",
                "eval.temperature", "eval.top_p"),
        gpu=True, uses_policy=True, function="qerl_lib.stages.eval:eval_stage",
        seconds_file=lambda lay, q, s: [lay.eval_metrics(s)],
    ),
    Stage(
        "report", "every step's metrics -> metrics.json, CSVs, plots", "none",
        inputs=lambda lay, q, s: [lay.rollouts_root, lay.rewards_root, lay.metrics_root, lay.eval_root],
        outputs=lambda lay, q, s: _report_outputs(lay),
        done=lambda lay, q, s: [lay.report_metrics],
        params=("run.steps",), gpu=False, uses_policy=False, function="qerl_lib.stages.report:report_stage",
        dvc_outs=lambda lay, q, s: [lay.report_steps, lay.report_evals, lay.plots_dir],
        dvc_metrics=lambda lay, q, s: [lay.report_metrics],
    ),
)

BY_NAME: dict[str, Stage] = {s.name: s for s in STAGES}
NAMES: list[str] = [s.name for s in STAGES]


def _next(step: Step) -> Step:
    return step + 1 if isinstance(step, int) else "${item.next}"


def _report_outputs(lay: Layout) -> list[Path]:
    from qerl_lib.report import PLOTS

    return [lay.report_metrics, lay.report_steps, lay.report_evals, lay.reports_dir / "config.yaml",
            *(lay.plot(p) for p in PLOTS)]


def get(name: str) -> Stage:
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown stage {name!r} (stages: {', '.join(NAMES)})") from None


def parse_label(label: str) -> tuple[Stage, int | None]:
    """`rollout@3` -> (the rollout stage, 3); `report` -> (the report stage, None)."""
    name, _, step = label.partition("@")
    return get(name), (int(step) if step else None)


def outputs(name: str, step: int | None, quant: str, layout: Layout) -> list[Path]:
    st = get(name)
    if st.steps != "none" and step is None:
        raise ValueError(f"stage {name} needs a step")
    return st.outputs(layout, quant, step)


def eval_steps(steps: int, every: int | None, base: bool = True) -> list[int]:
    """Adapters to evaluate: 0 (the base; unless not `base`), every `every` steps, and the last."""
    out = {0, steps} if base else {steps}
    if every:
        out.update(range(every, steps, every))
    return sorted(out)


@dataclass(frozen=True)
class Call:
    """One stage at one step, in the order `qerl run` runs them."""

    stage: Stage
    step: int | None
    done_marker: Path

    @property
    def name(self) -> str:
        return self.stage.name

    @property
    def label(self) -> str:
        return self.stage.label(self.step)


def plan(steps: int, every: int | None, quant: str, layout: Layout, base_eval: bool = True) -> list[Call]:
    """Every stage call of a run of `steps` steps, in order (evaluations before the step they precede)."""

    def call(name: str, step: int | None = None) -> Call:
        st = BY_NAME[name]
        return Call(st, step, st.done(layout, quant, step)[0])

    calls = [call("prepare"), call("convert"), call("init_adapter")]
    evals = set(eval_steps(steps, every, base_eval))
    for i in range(steps):
        if i in evals:
            calls.append(call("eval", i))
        calls += [call("rollout", i), call("reward", i), call("update", i)]
    calls += [call("eval", steps), call("report")]
    return calls
