"""Placement of rollout engines and trainer ranks, and the data-parallel LoRA update (gloo on CPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import copy_workspace

from qerl_lib.config import ParallelConfig, load_config
from qerl_lib.distributed import DistContext, check_tensor_parallel, placement, shard
from qerl_lib.paths import Layout

QWEN7B = {"num_attention_heads": 28, "num_key_value_heads": 4}
QWEN72B = {"num_attention_heads": 64, "num_key_value_heads": 8}


def test_colocated_placement_shares_gpus_and_separate_placement_does_not():
    assert placement(ParallelConfig(rollout_tensor_parallel=2, train_world_size=2), 2, QWEN7B) == \
        {"rollout": [[0, 1]], "train": [0, 1], "gpus_used": 2}
    assert placement(ParallelConfig(rollout_tensor_parallel=2, train_world_size=2, colocate=False), 4, QWEN72B) == \
        {"rollout": [[0, 1]], "train": [2, 3], "gpus_used": 4}
    assert placement(ParallelConfig(), 1) == {"rollout": [[0]], "train": [0], "gpus_used": 1}
    assert placement(ParallelConfig(rollout_replicas=2, train_world_size=2), 2) == \
        {"rollout": [[0], [1]], "train": [0, 1], "gpus_used": 2}
    assert placement(ParallelConfig(rollout_tensor_parallel=2, rollout_replicas=2, colocate=False), 8, QWEN7B) == \
        {"rollout": [[0, 1], [2, 3]], "train": [4], "gpus_used": 5}


def test_placement_refuses_what_does_not_fit_and_says_why():
    with pytest.raises(ValueError, match="rollout_replicas \\+ train_world_size = 3 GPUs, but 2"):
        placement(ParallelConfig(rollout_tensor_parallel=2, train_world_size=1, colocate=False), 2)
    with pytest.raises(ValueError, match="= 4 GPUs, but 2 are visible"):
        placement(ParallelConfig(train_world_size=4), 2)
    with pytest.raises(ValueError, match="need GPUs"):
        placement(ParallelConfig(rollout_tensor_parallel=2), 0)
    with pytest.raises(ValueError, match="rollout_replicas, train_world_size\\) = 4 GPUs, but 2"):
        placement(ParallelConfig(rollout_tensor_parallel=2, rollout_replicas=2), 2)
    assert placement(ParallelConfig(train_world_size=2), 0) == {"rollout": [], "train": [None, None], "gpus_used": 0}


def test_tensor_parallel_must_split_the_heads():
    check_tensor_parallel(QWEN7B, 2)
    check_tensor_parallel(QWEN7B, 4)
    check_tensor_parallel(QWEN72B, 8)
    with pytest.raises(ValueError, match="28 attention heads"):
        check_tensor_parallel(QWEN7B, 8)
    with pytest.raises(ValueError, match="KV heads"):
        check_tensor_parallel({"num_attention_heads": 24, "num_key_value_heads": 6}, 4)


def test_parallel_config_rejects_zero_and_unknown_fields():
    with pytest.raises(Exception):
        ParallelConfig(train_world_size=0)
    with pytest.raises(Exception):
        ParallelConfig(rollout_workers=2)


def test_shard_gives_every_item_to_exactly_one_rank():
    items = list("abcdefg")
    parts = [shard(items, DistContext(r, 3, torch.device("cpu"))) for r in range(3)]
    assert sorted(i for p in parts for i, _ in p) == list(range(7))
    assert parts[1] == [(1, "b"), (4, "e")]
    assert shard(items, None) == list(enumerate(items))


def test_two_rank_update_equals_the_one_process_update(scored_workspace, tmp_path):
    from safetensors.torch import load_file

    from qerl_lib.stages import update_stage

    cfg, layout = scored_workspace
    out = {}
    for world in (1, 2):
        work = copy_workspace(layout, tmp_path / f"w{world}")
        c = cfg.model_copy(deep=True)
        c.run.root = str(work.root)
        c.parallel.train_world_size = world
        out[world] = (update_stage(c, work, 0), load_file(str(work.adapter(1) / "adapter_model.safetensors")))
    (m1, a1), (m2, a2) = out[1], out[2]
    assert m2["world_size"] == 2 and m1["world_size"] == 1 and m2["optimizer_steps"] == 2
    assert a1.keys() == a2.keys()
    moved = 0
    before = load_file(str(layout.adapter(0) / "adapter_model.safetensors"))
    for k in a1:
        # Summation order differs (ranks' partial sums); AdamW's g / sqrt(v) amplifies that on
        # near-zero gradients, measured up to 1.8e-5 on at most 0.1 % of the elements (lr 1e-2).
        d = (a1[k] - a2[k]).abs()
        assert float(d.max()) < 1e-4 and float((d > 1e-6).float().mean()) < 0.005, k
        moved += int(not torch.equal(a1[k], before[k]))
    assert moved > 0
    for key in ("loss", "entropy", "grad_norm", "tokens", "mismatch_kl"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key


def test_vllm_engine_gets_tensor_parallel_and_no_dense_copies(tiny_qwen2_dir, tmp_path, monkeypatch):
    """`parallel.rollout_tensor_parallel` reaches vLLM as `tensor_parallel_size`, turns the dense
    regime off, sets NVLink multicast off, and is refused with a reason when the GPUs are too few."""
    import qerl_lib.policy as policy_mod
    import qerl_lib.rollout.vllm_engine as engine_mod

    seen = {}

    class FakeEngine:
        def __init__(self, checkpoint, **kwargs):
            seen.update(kwargs)

        def close(self):
            pass

    monkeypatch.setattr(engine_mod, "VLLMEngine", FakeEngine)
    for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        monkeypatch.delenv(k, raising=False)
    cfg = load_config(None, {"run": {"root": str(tmp_path)}, "model": {"base": str(tiny_qwen2_dir)},
                             "rollout": {"backend": "vllm"}, "parallel": {"rollout_tensor_parallel": 2}})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="2 GPUs, but 1 are visible"):
        policy_mod.get_engine(cfg, tiny_qwen2_dir)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    policy_mod.get_engine(cfg, tiny_qwen2_dir)
    policy_mod.close_engines()
    assert seen["tensor_parallel_size"] == 2 and seen["dense_above"] is None
    from qerl_lib.distributed import MULTICAST_OFF, multicast_off

    multicast_off()
    import os

    assert all(os.environ[k] == v for k, v in MULTICAST_OFF.items())


# ----------------------------------------------------------------------------- rollout replicas


class EchoEngine:
    """A stand-in engine for replica processes: completions are a function of (prompt, seed, the
    adapter version and noise it was told), plus the GPUs its process sees."""

    def __init__(self, tag: str):
        import os

        self.tag, self.version, self.noise = tag, None, None
        self.gpus = os.environ.get("CUDA_VISIBLE_DEVICES")

    def set_policy(self, adapter_dir, version):
        self.version = version

    def set_noise(self, sigma, seed, step, force=False, mode="absolute"):
        self.noise = (sigma, seed, step)

    def generate(self, prompts, seeds, params, stop_token_ids=()):
        from qerl_lib.rollout.sampling import Completion

        if any(s < 0 for s in seeds):
            raise ValueError("negative seed")
        return [Completion([len(p), s, self.version, int(self.gpus)], [-self.noise[0]] * 4, "length")
                for p, s in zip(prompts, seeds)]

    def sleep(self, level=1):
        pass

    def stats_dict(self):
        return {"tag": self.tag, "gpus": self.gpus}

    def close(self):
        pass


def test_share_bounds_cover_the_rows_in_order():
    from qerl_lib.rollout.replicas import share_bounds

    assert share_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert share_bounds(2, 3) == [(0, 1), (1, 2), (2, 2)]


def test_replica_pool_broadcasts_state_and_keeps_row_order():
    from qerl_lib.rollout.replicas import ReplicaPool
    from qerl_lib.rollout.sampling import SamplingParams

    pool = ReplicaPool(2, EchoEngine, ("echo",), gpu_groups=[[3], [5]])
    try:
        pool.set_policy("/nowhere", 7)
        pool.set_noise(0.25, 1, 2)
        prompts = [[1] * (i + 1) for i in range(5)]
        comps = pool.generate(prompts, [10, 11, 12, 13, 14], SamplingParams(1.0, 1.0, 4))
        assert [c.token_ids for c in comps] == [[1, 10, 7, 3], [2, 11, 7, 3], [3, 12, 7, 3], [4, 13, 7, 5],
                                                [5, 14, 7, 5]]
        assert all(c.logprobs == [-0.25] * 4 for c in comps)
        assert pool.generate(prompts[:1], [1], SamplingParams(1.0, 1.0, 4))[0].token_ids == [1, 1, 7, 3]
        assert pool.stats_dict() == {"replicas": [{"tag": "echo", "gpus": "3"}, {"tag": "echo", "gpus": "5"}]}
        with pytest.raises(RuntimeError, match="replica 1 \\(generate\\)[\\s\\S]*negative seed"):
            pool.generate(prompts[:2], [0, -1], SamplingParams(1.0, 1.0, 4))
        assert len(pool.generate(prompts[:2], [0, 1], SamplingParams(1.0, 1.0, 4))) == 2  # still serving
    finally:
        pool.close()


def test_replica_pool_reports_an_engine_that_fails_to_start():
    from qerl_lib.rollout.replicas import ReplicaPool

    with pytest.raises(RuntimeError, match="replica 0 \\(start\\)"):
        ReplicaPool(1, EchoEngine, ())  # missing argument: the factory raises in the replica
