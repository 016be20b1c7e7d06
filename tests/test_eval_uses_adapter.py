"""Evaluation provably uses the adapter it names (QeRL issue 20: the reference evaluation never
passed the adapter, so it scored the base model).

On a tiny random NVFP4 Llama: `eval_stage` of a non-zero adapter gives other completions and other
logprobs than the base adapter (B = 0) at the same step (same sampling seeds), while evaluating the
base adapter twice gives the same samples exactly, so the difference is the adapter's and not the
seeds' or nondeterminism's.
"""

from __future__ import annotations

import shutil

import pyarrow.parquet as pq
import pytest
import torch

from qerl_lib.config import load_config
from qerl_lib.paths import Layout


@pytest.fixture(scope="module")
def workspace(tiny_llama_dir, tmp_path_factory):
    """prepare, convert, init_adapter (adapter 0: B = 0, the base model)."""
    from qerl_lib.stages import convert_stage, init_adapter_stage, prepare_stage

    root = tmp_path_factory.mktemp("eval_adapter")
    cfg = load_config(None, {
        "run": {"root": str(root), "steps": 2},
        "model": {"base": str(tiny_llama_dir)},
        "data": {"synthetic_train": 8, "synthetic_test": 4},
        "rollout": {"batch_size": 8},
        "eval": {"max_prompts": 3, "k": 2, "max_new_tokens": 8, "temperature": 1.0},
    })
    layout = Layout(root)
    prepare_stage(cfg, layout)
    convert_stage(cfg, layout)
    init_adapter_stage(cfg, layout)
    return cfg, layout


def write_nonzero_b(adapter_dir, seed: int = 0) -> int:
    """Overwrite every lora_B (zero after init_adapter) with N(0, 0.5^2) values; returns how many."""
    from safetensors.torch import load_file, save_file

    weights = adapter_dir / "adapter_model.safetensors"
    state = load_file(str(weights))
    g = torch.Generator().manual_seed(seed)
    n = 0
    for key, t in state.items():
        if "lora_B" in key:
            assert torch.count_nonzero(t) == 0  # init_adapter's B = 0: the adapter is the base
            state[key] = torch.randn(t.shape, generator=g, dtype=t.dtype) * 0.5
            n += 1
    save_file(state, str(weights), metadata={"format": "pt"})
    return n


def eval_rows(cfg, layout, step):
    from qerl_lib.stages import eval_stage

    eval_stage(cfg, layout, step)
    rows = pq.read_table(layout.eval_samples(step)).to_pylist()
    key = lambda r: (r["temperature"], r["prompt_id"], r["sample_idx"])  # noqa: E731
    return sorted(rows, key=key)


def test_eval_of_a_nonzero_adapter_differs_from_the_base(workspace):
    """eval@1 twice, with the same seeds: first with adapter 1 = a byte copy of the base adapter,
    then with adapter 1 given non-zero B. Only the adapter's bytes change between the two."""
    from qerl_lib.lora import adapter_hash

    cfg, layout = workspace
    shutil.copytree(layout.adapter(0), layout.adapter(1))
    base = eval_rows(cfg, layout, 1)
    base_again = eval_rows(cfg, layout, 1)
    base_hash = adapter_hash(layout.adapter(1))
    assert write_nonzero_b(layout.adapter(1)) > 0
    tuned = eval_rows(cfg, layout, 1)
    assert len(base) == len(tuned) == 3 * (2 + 1)  # k = 2 sampled + 1 greedy per prompt

    # each row names the adapter it was made with
    assert {r["adapter_hash"] for r in base} == {base_hash} == {adapter_hash(layout.adapter(0))}
    assert {r["adapter_hash"] for r in tuned} == {adapter_hash(layout.adapter(1))} != {base_hash}

    # Control: the same adapter gives the very same samples, so a difference below is the adapter's.
    for a, b in zip(base, base_again):
        assert (a["prompt_id"], a["sample_idx"], a["seed"]) == (b["prompt_id"], b["sample_idx"], b["seed"])
        assert a["completion_token_ids"] == b["completion_token_ids"]
        assert a["sampling_logprobs"] == b["sampling_logprobs"]

    # The non-zero adapter, same prompts and seeds: the first completion token's logprob differs on
    # every row (same context, other model), and the completions themselves differ.
    for a, t in zip(base, tuned):
        assert (a["prompt_token_ids"], a["seed"]) == (t["prompt_token_ids"], t["seed"])
        assert a["sampling_logprobs"][0] != pytest.approx(t["sampling_logprobs"][0], abs=1e-4)
    assert sum(a["completion_token_ids"] != t["completion_token_ids"] for a, t in zip(base, tuned)) >= len(base) // 2
    greedy = [(a, t) for a, t in zip(base, tuned) if a["temperature"] == 0.0]
    assert len(greedy) == 3 and any(a["completion_token_ids"] != t["completion_token_ids"] for a, t in greedy)
