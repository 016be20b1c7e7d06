"""Every knob of a qerl run, in one typed config.

The config is a tree of pydantic models: `QerlConfig` here, its sections in
`qerl_lib.config_sections` (imported from here too). Each field's docstring (the string literal
under it) is its documentation: `qerl config --show` prints them, and pydantic keeps
them as field descriptions. Unknown keys are errors (`extra="forbid"`), so a typo in
a YAML file fails loudly, naming the key, instead of being silently ignored.

Load with `load_config(path, overrides)`; every stage writes the resolved config it
ran with beside its outputs (`save_config`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from qerl_lib.config_sections import (
    AlgoConfig,
    AQNConfig,
    DataConfig,
    EvalConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    _Section,
)


class PlanStep(_Section):
    """One RL step of the DVC stage list (`dvc.yaml` unrolls rollout/reward/update over these)."""

    step: int = Field(ge=0)
    """RL step i: the DVC stages `rollout@i`, `reward@i` and `update@i` (the list index equals i)."""
    prev: int | None = None
    """The step whose update wrote this step's adapter (i - 1); null for step 0, whose adapter
    comes from `init_adapter`. Named because DVC templating has no arithmetic."""
    next: int = Field(ge=1)
    """The adapter `update@i` writes (i + 1), likewise spelled out for `dvc.yaml`."""


class PlanConfig(_Section):
    """The unrolled stage list that `dvc.yaml` iterates over (`foreach`), written by `qerl plan`
    from `run.steps` and `eval.every`. Empty outside a DVC workspace. It only names stages:
    it is left out of the resolved config and its hash (`exclude`), so it never changes an output."""

    steps: list[PlanStep] = []
    """`{step: i, prev: i-1, next: i+1}` for i in 0..run.steps-1, in order."""
    evals: list[int] = []
    """Adapters that `eval@k` evaluates: 0, every `eval.every` steps, and run.steps
    (`qerl_lib.run.eval_steps`)."""


def expected_plan(cfg: "QerlConfig") -> PlanConfig:
    """The plan `qerl plan` writes for `cfg.run.steps` and `cfg.eval.every` (evals: `registry.eval_steps`)."""
    from qerl_lib.stages.registry import eval_steps

    steps = cfg.run.steps
    return PlanConfig(
        steps=[PlanStep(step=i, prev=i - 1 if i else None, next=i + 1) for i in range(steps)],
        evals=eval_steps(steps, cfg.eval.every, cfg.eval.base),
    )


class QerlConfig(_Section):
    """The whole configuration of a qerl run."""

    run: RunConfig = RunConfig()
    """Run-level settings."""
    data: DataConfig = DataConfig()
    """Dataset preparation."""
    model: ModelConfig = ModelConfig()
    """Base model and its weight format."""
    lora: LoraConfig = LoraConfig()
    """LoRA adapter."""
    rollout: RolloutConfig = RolloutConfig()
    """Rollout sampling."""
    reward: RewardConfig = RewardConfig()
    """Reward and answer grading."""
    algo: AlgoConfig = AlgoConfig()
    """Policy-gradient algorithm."""
    optim: OptimConfig = OptimConfig()
    """Optimizer and schedule."""
    aqn: AQNConfig = AQNConfig()
    """Adaptive Quantization Noise."""
    parallel: ParallelConfig = ParallelConfig()
    """Several processes and GPUs."""
    eval: EvalConfig = EvalConfig()
    """Evaluation."""
    plan: PlanConfig = Field(default_factory=PlanConfig, exclude=True)
    """DVC stage list (written by `qerl plan`; not part of the resolved config or its hash)."""

    @model_validator(mode="after")
    def _check(self) -> "QerlConfig":
        if self.rollout.backend == "vllm" and self.lora.r > self.rollout.vllm_max_lora_rank:
            raise ValueError(
                f"lora.r={self.lora.r} exceeds rollout.vllm_max_lora_rank={self.rollout.vllm_max_lora_rank}"
            )
        if self.optim.offload_activations and not self.optim.gradient_checkpointing:
            raise ValueError("optim.offload_activations=true needs optim.gradient_checkpointing=true "
                             "(it offloads the checkpointed layer inputs)")
        if self.optim.mlp_chunk_tokens and not self.optim.gradient_checkpointing:
            raise ValueError("optim.mlp_chunk_tokens needs optim.gradient_checkpointing=true "
                             "(the chunked MLP replaces the MLP of the checkpointed layer's recomputation)")
        return self

    @model_validator(mode="after")
    def _check_plan(self) -> "QerlConfig":
        # An empty plan is fine (no DVC workspace); a written one must match run.steps / eval.every,
        # or dvc.yaml would unroll another run than the stages compute (AQN schedule, LR schedule).
        plan = self.plan
        if plan.steps or plan.evals:
            want = expected_plan(self)
            if plan != want:
                raise ValueError(
                    f"plan does not match run.steps={self.run.steps} / eval.every={self.eval.every} "
                    f"(plan has {len(plan.steps)} steps, evals {plan.evals}; expected evals {want.evals}): "
                    "run `qerl plan` to rewrite it"
                )
        return self


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names file and key."""


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    node = tree
    keys = dotted.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {key!r} is not a section")
    node[keys[-1]] = value


def parse_overrides(pairs: list[str]) -> dict:
    """`["rollout.group_size=8", "aqn.enabled=false"]` -> nested dict (values parsed as YAML)."""
    tree: dict = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"override {pair!r} is not of the form section.key=value")
        key, raw = pair.split("=", 1)
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {pair!r}: the value is not valid YAML ({yaml_error(e)})") from None
        _set_dotted(tree, key.strip(), value)
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _explain(err: ValidationError, origin: str) -> str:
    """The message of an invalid config: one line for one error (the key, what is wrong, the value
    given), else a line per error under a heading."""
    items = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            items.append(f"unknown key {where!r}{did_you_mean(e['loc'])}")
        elif e["type"] == "value_error" and not e["loc"]:
            items.append(e["msg"].removeprefix("Value error, "))
        else:
            given = e.get("input")
            shown = f" (got {given!r})" if isinstance(given, (int, float, str, list)) and len(repr(given)) < 60 else ""
            items.append(f"{where}: {e['msg']}{shown}")
    if len(items) == 1:
        return f"invalid config ({origin}): {items[0]}"
    return "\n".join([f"invalid config ({origin}):", *(f"  {i}" for i in items)])


def did_you_mean(loc: tuple) -> str:
    """" (did you mean 'run.steps'?)" for an unknown key at `loc` (("run", "stepz")): the closest
    field name of the section it was given in (difflib), or "" when none is close."""
    import difflib

    model: type[BaseModel] = QerlConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        sub = field.annotation if field is not None else None
        if not (isinstance(sub, type) and issubclass(sub, BaseModel)):
            return ""
        model = sub
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    return f" (did you mean {'.'.join([*map(str, loc[:-1]), close[0]])!r}?)" if close else ""


def yaml_error(e: Exception) -> str:
    """A YAML parser's error in one line: where (line, column) and what."""
    mark = getattr(e, "problem_mark", None)
    what = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {what}" if mark is not None else what


def load_config(path: str | Path | None = None, overrides: list[str] | dict | None = None) -> QerlConfig:
    """Read a YAML config (or none: defaults), apply `section.key=value` overrides, validate."""
    tree: dict = {}
    origin = "defaults"
    if path is not None:
        path = Path(path)
        origin = str(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {yaml_error(e)}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        tree = loaded or {}
    if overrides:
        extra = overrides if isinstance(overrides, dict) else parse_overrides(list(overrides))
        tree = _merge(tree, extra)
        origin += " + overrides"
    try:
        return QerlConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_explain(e, origin)) from None


def config_to_dict(cfg: QerlConfig) -> dict:
    return cfg.model_dump(mode="json")


def save_config(cfg: QerlConfig, path: str | Path) -> Path:
    """Write the resolved config as YAML (atomically)."""
    from qerl_lib.io import atomic_write_text, sweep_dead_temporaries

    sweep_dead_temporaries(path)  # `.config.yaml.<pid>-*.tmp` of a killed command
    return atomic_write_text(Path(path), yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def describe(model: type[BaseModel] = QerlConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, docstring) for every field, for `qerl config --show`."""
    rows = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(describe(ann, f"{prefix}{name}."))
        else:
            doc = " ".join((field.description or "").split())
            rows.append((f"{prefix}{name}", repr(field.default), doc))
    return rows


def config_hash(cfg: QerlConfig) -> str:
    """Short hash of what a config makes: where the workspace lies, the thread count and
    the DVC plan do not change any output, so they are left out."""
    from qerl_lib.seeds import stable_id

    return stable_id(cfg.model_dump_json(exclude={"run": {"root", "threads"}}), length=16)
