"""The one-launch seeded sampler (qerl_lib.rollout.seeded_sampler) that can replace vLLM's per-row loop.

The kernel's checks run in Triton's interpreter on the CPU, in one subprocess (TRITON_INTERPRET must be
set before Triton decorates the kernel): draws follow `probs` (chi-square), never leave its support,
depend only on (seed, counter) and not on the row's place in the batch or on how the vocabulary is cut.
The host side (generator offsets, fall-backs, the patch of vLLM's module) runs here with stand-ins.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("triton")


def _interpreter_checks() -> dict[str, dict]:
    from qerl_lib.rollout.seeded_sampler import seeded_race

    out: dict[str, dict] = {}

    def record(name, ok, detail=""):
        out[name] = {"ok": bool(ok), "detail": str(detail)}

    v, rows, calls = 40, 16, 40
    probs = torch.zeros(rows, v)
    probs[:, 3:11] = torch.arange(1, 9, dtype=torch.float32)  # tokens 3..10, p proportional to 1..8
    probs /= probs.sum(dim=1, keepdim=True)
    counts = torch.zeros(v)
    for c in range(calls):
        tok = seeded_race(probs, torch.arange(rows) + 1000, torch.full((rows,), c))
        counts += torch.bincount(tok, minlength=v).float()
    n = rows * calls
    expected = probs[0, 3:11] * n
    chi2 = float(((counts[3:11] - expected) ** 2 / expected).sum())
    record("chi_square_7dof_below_p001", chi2 < 24.32, f"chi2 {chi2:.2f}, counts {counts[3:11].tolist()}")
    record("never_outside_support", counts.sum() - counts[3:11].sum() == 0, counts.tolist())

    gen = torch.Generator().manual_seed(1)
    p = torch.rand(5, 300, generator=gen) ** 4
    p /= p.sum(dim=1, keepdim=True)
    seeds, ctr = torch.tensor([7, 8, 9, 10, 11]), torch.tensor([0, 3, 3, 5, 2])
    a = seeded_race(p, seeds, ctr, block=64)
    record("same_inputs_same_tokens", torch.equal(a, seeded_race(p, seeds, ctr, block=64)), a.tolist())
    perm = torch.tensor([4, 2, 0, 3, 1])
    record("batch_position_independent", torch.equal(a[perm], seeded_race(p[perm], seeds[perm], ctr[perm], block=64)))
    one_chunk = seeded_race(p, seeds, ctr, block=32, min_programs=1)
    record("vocabulary_cut_does_not_matter", torch.equal(a, one_chunk), f"{a.tolist()} vs {one_chunk.tolist()}")
    steps = [int(seeded_race(p[:1], seeds[:1], torch.tensor([c]), block=64)) for c in range(12)]
    record("counter_moves_the_draw", len(set(steps)) > 1, steps)
    record("empty_batch", seeded_race(p[:0], seeds[:0], ctr[:0]).shape == (0,))
    return out


@pytest.fixture(scope="module")
def interpreter_results():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--interpreter"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"interpreter checks crashed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("check", ["chi_square_7dof_below_p001", "never_outside_support", "same_inputs_same_tokens",
                                   "batch_position_independent", "vocabulary_cut_does_not_matter",
                                   "counter_moves_the_draw", "empty_batch"])
def test_interpreter(interpreter_results, check):
    assert check in interpreter_results, f"check {check} did not run"
    assert interpreter_results[check]["ok"], interpreter_results[check]["detail"]


class FakeGenerator:
    """The two calls vLLM's CUDA generators offer that the sampler uses (CPU generators have no offset)."""

    def __init__(self, seed: int, offset: int = 0):
        self.seed, self.offset = seed, offset

    def initial_seed(self) -> int:
        return self.seed

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        self.offset = offset


def test_row_seeds_reads_and_advances_each_generator_like_one_exponential_call():
    from qerl_lib.rollout.seeded_sampler import OFFSET_STEP, row_seeds

    gens = {0: FakeGenerator(11, 0), 2: FakeGenerator(2**63 + 5, 8)}
    seeds, counters = row_seeds(3, gens, torch.device("cpu"))
    assert seeds.dtype == counters.dtype == torch.int64
    assert seeds[0] == 11 and seeds[2] == 5  # the top bit folded away: Philox keys on the rest
    assert counters[0] == 0 and counters[2] == 8 // OFFSET_STEP
    assert counters[1] == 0 and gens[0].offset == OFFSET_STEP and gens[2].offset == 8 + OFFSET_STEP
    # vLLM's rewind of a discarded token (set_offset(get_offset() - 4)) gives back the same counter
    gens[2].set_offset(gens[2].get_offset() - 4)
    assert row_seeds(3, gens, torch.device("cpu"))[1][2] == 2
    # a row without a generator gets a fresh seed per call
    free = {row_seeds(3, gens, torch.device("cpu"))[0][1].item() for _ in range(4)}
    assert len(free) > 1


def test_random_sample_hands_small_unseeded_and_cpu_batches_to_stock():
    from qerl_lib.rollout import seeded_sampler as ss

    calls = []

    def stock(probs, generators, use_fp64_gumbel=False):
        calls.append((probs.shape[0], len(generators), use_fp64_gumbel))
        return torch.zeros(probs.shape[0], dtype=torch.int64)

    probs = torch.full((ss.MIN_ROWS, 8), 1 / 8)
    ss.random_sample(probs, {}, _stock=stock)  # no seeded rows
    ss.random_sample(probs[:2], {0: FakeGenerator(1)}, _stock=stock)  # below MIN_ROWS
    ss.random_sample(probs, {0: FakeGenerator(1)}, True, _stock=stock)  # fp64 noise asked for
    ss.random_sample(probs, {i: FakeGenerator(i) for i in range(ss.MIN_ROWS)}, _stock=stock)  # CPU tensor
    assert calls == [(ss.MIN_ROWS, 0, False), (2, 1, False), (ss.MIN_ROWS, 1, True), (ss.MIN_ROWS, ss.MIN_ROWS, False)]


def test_chunk_plan_covers_the_vocabulary_in_whole_blocks():
    from qerl_lib.rollout.seeded_sampler import chunk_plan

    for rows, vocab in [(1, 152064), (8, 152064), (256, 152064), (3, 40), (1, 1)]:
        n, per = chunk_plan(rows, vocab, 1024)
        assert per % 1024 == 0 and n * per >= vocab > (n - 1) * per
    # one row spreads over 19 programs of 8 blocks; 256 rows already fill the GPU with 2 chunks each
    assert chunk_plan(1, 152064, 1024) == (19, 8192) and chunk_plan(8, 152064, 1024) == (19, 8192)
    assert chunk_plan(256, 152064, 1024) == (2, 76800) and chunk_plan(3, 40, 1024) == (1, 1024)


def test_patch_vllm_replaces_the_sampler_once(monkeypatch):
    from qerl_lib.rollout import seeded_sampler as ss

    mod = types.ModuleType("vllm.v1.sample.ops.topk_topp_sampler")
    stock_calls = []
    mod.random_sample = lambda probs, generators, use_fp64_gumbel=False: stock_calls.append(1) or "stock"
    names = ["vllm", "vllm.v1", "vllm.v1.sample", "vllm.v1.sample.ops"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(sys.modules["vllm.v1.sample.ops"], "topk_topp_sampler", mod, raising=False)
    assert ss.patch_vllm() is True
    patched = mod.random_sample
    assert patched._qerl_seeded and ss.patch_vllm() is True and mod.random_sample is patched
    assert patched(torch.ones(2, 3) / 3, {}) == "stock" and stock_calls == [1]  # unseeded: vLLM's own


def test_patch_vllm_without_vllm_patches_nothing(monkeypatch):
    from qerl_lib.rollout import seeded_sampler as ss

    monkeypatch.setitem(sys.modules, "vllm", None)
    assert ss.patch_vllm() is False


def test_the_switch_reaches_the_served_engine_and_keys_the_policy_engine(tmp_path, monkeypatch):
    """`rollout.vllm_seeded_sampler` (off by default) becomes QERL_VLLM_SEEDED_SAMPLER=1 for `vllm serve`'s
    workers, never inherited from the caller, and tells two in-process engines apart."""
    from qerl_lib.config import QerlConfig
    from qerl_lib.policy import _engine_key
    from qerl_lib.rollout.serve import vllm_command
    from qerl_lib.rollout.vllm_worker import SEEDED_SAMPLER_ENV

    (tmp_path / "config.json").write_text('{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}')
    monkeypatch.setenv(SEEDED_SAMPLER_ENV, "1")
    off = QerlConfig.model_validate({"rollout": {"backend": "vllm"}})
    on = QerlConfig.model_validate({"rollout": {"backend": "vllm", "vllm_seeded_sampler": True}})
    assert off.rollout.vllm_seeded_sampler is False
    assert SEEDED_SAMPLER_ENV not in vllm_command(off, tmp_path, "127.0.0.1", 8000)[1]
    assert vllm_command(on, tmp_path, "127.0.0.1", 8000)[1][SEEDED_SAMPLER_ENV] == "1"
    assert _engine_key(off, tmp_path) != _engine_key(on, tmp_path)


if __name__ == "__main__" and "--interpreter" in sys.argv:
    print(json.dumps(_interpreter_checks()))
