"""The one place that knows the on-disk layout of a run.

```
<root>/
  config.yaml                       resolved config of the last command run here
  data/prepared/train.parquet       prompts with stable prompt_id and ground truth
  data/prepared/test.parquet
  models/base/                      plain HF copy of the source model (bf16 safetensors)
  models/<quant>/                   converted checkpoint: nvfp4 (compressed-tensors) or bf16
  models/<quant>/convert_report.json  bytes before/after, per-layer quantization error
  adapters/step=<i>/                PEFT adapter i (+ optimizer.pt, trainer_state.json)
  rollouts/step=<i>/rollouts.parquet  G samples per prompt, as sampled
  rewards/step=<i>/scored.parquet   the same rows with rewards, advantages, kept flags
  metrics/step=<i>/update.json      train metrics of update i (-> adapter i+1)
  eval/step=<k>/samples.parquet     per-sample eval records of adapter k
  eval/step=<k>/metrics.json        pass@1 / greedy accuracy of adapter k
  reports/metrics.json, plots/      aggregated curves
```

Stages only ever ask this module for paths, so the layout can change in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Layout:
    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root))

    # config
    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    # data
    @property
    def prepared_dir(self) -> Path:
        return self.root / "data" / "prepared"

    def prepared(self, split: str) -> Path:
        return self.prepared_dir / f"{split}.parquet"

    # models
    @property
    def base_model(self) -> Path:
        return self.root / "models" / "base"

    def checkpoint(self, quant: str) -> Path:
        return self.root / "models" / quant

    def convert_report(self, quant: str) -> Path:
        return self.checkpoint(quant) / "convert_report.json"

    # per step (each kind under one folder, one `step=<i>` folder per step)
    @property
    def adapters_root(self) -> Path:
        return self.root / "adapters"

    @property
    def rollouts_root(self) -> Path:
        return self.root / "rollouts"

    @property
    def rewards_root(self) -> Path:
        return self.root / "rewards"

    @property
    def metrics_root(self) -> Path:
        return self.root / "metrics"

    @property
    def eval_root(self) -> Path:
        return self.root / "eval"

    def adapter(self, step: int) -> Path:
        return self.adapters_root / f"step={step}"

    def rollouts_dir(self, step: int) -> Path:
        return self.rollouts_root / f"step={step}"

    def rollout_provenance(self, step: int) -> Path:
        return self.rollouts_dir(step) / "provenance.json"

    def rollouts(self, step: int) -> Path:
        return self.rollouts_dir(step) / "rollouts.parquet"

    def scored(self, step: int) -> Path:
        return self.rewards_root / f"step={step}" / "scored.parquet"

    def reward_metrics(self, step: int) -> Path:
        return self.rewards_root / f"step={step}" / "metrics.json"

    def update_metrics(self, step: int) -> Path:
        return self.metrics_root / f"step={step}" / "update.json"

    def eval_dir(self, step: int) -> Path:
        return self.eval_root / f"step={step}"

    def eval_provenance(self, step: int) -> Path:
        return self.eval_dir(step) / "provenance.json"

    def eval_samples(self, step: int) -> Path:
        return self.eval_dir(step) / "samples.parquet"

    def eval_metrics(self, step: int) -> Path:
        return self.eval_dir(step) / "metrics.json"

    # report
    @property
    def reports_dir(self) -> Path:
        return self.root / "reports"

    @property
    def report_metrics(self) -> Path:
        return self.reports_dir / "metrics.json"

    @property
    def report_steps(self) -> Path:
        return self.reports_dir / "steps.csv"

    @property
    def report_evals(self) -> Path:
        return self.reports_dir / "eval.csv"

    @property
    def plots_dir(self) -> Path:
        return self.reports_dir / "plots"

    def plot(self, name: str) -> Path:
        return self.plots_dir / f"{name}.png"

    @property
    def stage_times(self) -> Path:
        return self.reports_dir / "stage_times.jsonl"

    # process-level files beside the stages' outputs (never a stage output or a DVC param)
    @property
    def rollout_server_file(self) -> Path:
        """Where `qerl serve` announces its address (`qerl_lib.rollout.service`)."""
        return self.root / "rollout_server.json"

    @property
    def rollout_client_stats(self) -> Path:
        return self.root / "rollout_client.json"

    @property
    def vllm_engine_stats(self) -> Path:
        return self.root / "vllm_engine.json"

    @property
    def lock_file(self) -> Path:
        return self.root / ".qerl.lock"


# File names inside an adapter directory: PEFT's weights, and ours beside them.
ADAPTER_WEIGHTS = "adapter_model.safetensors"
OPTIMIZER_STATE = "optimizer.pt"
TRAINER_STATE = "trainer_state.json"
NORMS_FILE = "norms.safetensors"
