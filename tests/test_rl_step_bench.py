"""Pieces of `benchmarks/rl_step.py` (and its `rl_step_plan.py`) that run without a GPU or vLLM: the completion-length draw, the
rows and rewards of a step, the update phase on a tiny random NVFP4 model, the engine checkpoint, a whole
step against a fake engine, the KV sizing, the result file's keys and ratios, `--merge`, and the driver
when its child fails."""

from __future__ import annotations

import importlib
import json
import math
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
rs = importlib.import_module("benchmarks.rl_step")
rp = importlib.import_module("benchmarks.rl_step_plan")

TINY = {"hidden": 64, "inter": 128, "layers": 1, "heads": 2, "kv_heads": 1, "head_dim": 32, "vocab": 96}


def test_defaults_are_the_issues_step():
    a = rs.parse_args([])
    assert (a.arms, a.shape, a.prompts, a.group, a.prompt, a.max_completion, a.steps) == \
        (["bf16", "nvfp4", "nvfp4-aqn"], "7b", 64, 8, 256, 1024, 1)
    assert rs.shape_of(a) == rp.SHAPE_7B
    assert rs.shape_of(rs.parse_args(["--shape", "tiny", "--layers", "1"]))["layers"] == 1
    with pytest.raises(SystemExit):
        rs.parse_args(["--group", "1"])


def test_dense_above_and_engine_memory_reach_the_engine_config():
    assert rs.bench_config(rs.parse_args([])).rollout.vllm_dense_above == "auto"
    assert rs.bench_config(rs.parse_args(["--dense-above", "48"])).rollout.vllm_dense_above == 48
    assert rs.bench_config(rs.parse_args(["--dense-above", "off"])).rollout.vllm_dense_above == "off"
    assert rs.bench_config(rs.parse_args(["--engine-mem", "0.6"])).rollout.vllm_gpu_memory_utilization == 0.6
    assert rs.bench_config(rs.parse_args([])).rollout.vllm_gpu_memory_utilization == 0.5
    for bad in ("0", "-3", "many"):
        with pytest.raises(SystemExit):
            rs.parse_args(["--dense-above", bad])


def test_completion_lengths_are_seeded_lognormal_and_clipped():
    a = rp.completion_lengths(512, 1024, seed=0)
    assert a == rp.completion_lengths(512, 1024, seed=0)
    assert a != rp.completion_lengths(512, 1024, seed=1)
    assert min(a) >= 1 and max(a) <= 1024 and all(isinstance(x, int) for x in a)
    big = np.array(rp.completion_lengths(40_000, 1024, seed=3))
    assert abs(np.median(big) - 307.2) < 6  # median 0.3 x max
    at_cap = 0.5 * math.erfc(math.log(1024 / 307.2) / 0.6 / math.sqrt(2))  # P(exp(N(log 307.2, 0.6^2)) >= 1024)
    assert abs((big == 1024).mean() - at_cap) < 0.004
    assert 330 < big.mean() < 380
    s = rs.length_stats(a, 1024)
    assert s["tokens"] == sum(a) and s["rows"] == 512 and s["max"] == max(a)
    assert rp.completion_lengths(100, 50, seed=0, median=1000) == [50] * 100  # median past the cap


def test_kv_cache_and_padding_arithmetic():
    per_token = 2 * 28 * 4 * 128 * 2  # K and V, 28 layers, 4 KV heads of 128, bf16
    blocks = math.ceil((256 + 10) / 16) + math.ceil((256 + 100) / 16)  # 17 + 23
    want = math.ceil(blocks * 16 * per_token * 1.1 / 2**30 * 100) / 100
    assert rp.kv_cache_gib([10, 100], 256, rp.SHAPE_7B) == want
    rows = [{"prompt_token_ids": [1] * p, "completion_token_ids": [2] * c} for p, c in ((4, 3), (5, 1), (4, 7), (5, 2))]
    cfg = rs.bench_config(rs.parse_args(["--micro-batch", "2"]))
    # by length: (4, 7) and (4, 3) [totals 11, 7] pad to 4 + 7; (5, 2) and (5, 1) [7, 6] to 5 + 2
    assert rs.update_positions(rows, cfg) == {"update_positions": 7 + 6 + 11 + 7, "update_padded_positions": 2 * 11 + 2 * 7,
                                              "update_padded_positions_rollout_order": 2 * (5 + 3) + 2 * (5 + 7)}
    unsorted = rs.bench_config(rs.parse_args(["--micro-batch", "2", "--micro-batch-order", "rollout"]))
    assert unsorted.optim.sort_micro_batches is False and cfg.optim.sort_micro_batches is True
    assert rs.update_positions(rows, unsorted)["update_padded_positions"] == 2 * (5 + 3) + 2 * (5 + 7)
    cfg3 = rs.bench_config(rs.parse_args(["--micro-batch", "3"]))
    assert rs.update_positions(rows[:3], cfg3)["update_padded_positions"] == 3 * (5 + 7)


def _completions(inp):
    rng = np.random.default_rng(0)
    return [SimpleNamespace(token_ids=rng.integers(0, 96, n).tolist(), logprobs=(-rng.random(n) * 3).tolist())
            for n in inp["lengths"]]


def test_rows_and_rewards_keep_every_group():
    args = rs.parse_args(["--prompts", "3", "--group", "4", "--prompt", "6", "--max-completion", "12", "--seed", "5"])
    cfg = rs.bench_config(args)
    inp = rs.step_inputs(args, 96, 0)
    assert inp == rs.step_inputs(args, 96, 0) and inp["lengths"] == rp.completion_lengths(12, 12, 5)
    assert inp["lengths"] != rs.step_inputs(args, 96, 1)["lengths"]
    assert len(rs.step_inputs(args, 96, -1)["prompts"]) == 4  # the warm-up: --warmup-prompts (1) x G
    assert len(inp["prompts"]) == 12 and inp["prompts"][0] == inp["prompts"][3] != inp["prompts"][4]
    assert len(inp["prompts"][0]) == 6 and len(set(inp["seeds"])) == 12
    rows = rs.score_step(rs.rollout_rows(inp, _completions(inp), 12), cfg)
    assert all(r["kept"] for r in rows)
    for r, right, n in zip(rows, inp["right"], inp["lengths"]):
        fmt = cfg.reward.format_weight
        assert r["reward"] == pytest.approx(cfg.reward.correct_weight * right + fmt)  # correct (+ format)
        assert r["truncated"] == (n >= 12) and len(r["completion_token_ids"]) == n
        assert "_grader" not in r and r["temperature"] == 1.0
    for g in range(3):
        adv = [r["advantage"] for r in rows if r["group_id"] == g]
        assert abs(sum(adv)) < 1e-6 and max(adv) > 0 > min(adv)


def test_update_phase_trains_the_adapter_on_a_tiny_nvfp4_model(tmp_path):
    import torch

    from qerl_lib.aqn import fingerprint
    from qerl_lib.paths import OPTIMIZER_STATE

    torch.manual_seed(0)
    rs.register_shape("cpu-test", TINY)
    from benchmarks.train_step import build_model

    args = rs.parse_args(["--prompts", "2", "--group", "2", "--prompt", "6", "--max-completion", "8", "--micro-batch", "2"])
    cfg = rs.bench_config(args)
    device = torch.device("cpu")
    model = build_model("cpu-test", "nvfp4", 1, device)
    ckpt = rs.write_engine_checkpoint(model, TINY, "nvfp4", tmp_path / "ckpt")
    pol = rs.make_policy(model, cfg, device)
    inp = rs.step_inputs(args, TINY["vocab"], 1)
    rows = rs.score_step(rs.rollout_rows(inp, _completions(inp), 8), cfg)
    clean = fingerprint(pol.injector)
    lora_b = [p for n, p in pol.model.named_parameters() if "lora_B" in n]
    assert all(float(p.detach().abs().max()) == 0 for p in lora_b)

    metrics, opt = rs.update_phase(pol, rows, cfg, None, 0, sigma=0.01)
    assert metrics["tokens"] == sum(inp["lengths"]) and metrics["optimizer_steps"] == 1
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert any(float(p.detach().abs().max()) > 0 for p in lora_b)
    assert fingerprint(pol.injector) == clean  # the noise of the update was taken off again

    saved = rs.save_state(pol, opt, tmp_path / "v1", 1)
    assert (saved / OPTIMIZER_STATE).is_file() and (saved / "adapter_model.safetensors").is_file()
    assert json.loads((saved / "adapter_config.json").read_text())["r"] == 16
    metrics2, opt2 = rs.update_phase(pol, rows, cfg, saved, 1, sigma=0.0)
    assert math.isfinite(metrics2["loss"])
    assert int(next(iter(opt2.state.values()))["step"]) == 2  # the saved moments were loaded, then stepped

    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight_packed").shape == (64, 64)
    assert {"model.layers.0.self_attn.q_proj.weight_scale", "model.layers.0.self_attn.q_proj.weight_global_scale",
            "lm_head.weight", "model.embed_tokens.weight"} <= keys
    config = json.loads((ckpt / "config.json").read_text())
    assert config["quantization_config"]["format"] == "nvfp4-pack-quantized" and config["num_hidden_layers"] == 1


class _FakeEngine:
    """The `VLLMEngine` calls a step makes, recorded; the adapter must be on disk when it is set."""

    def __init__(self):
        self.stats, self.calls = SimpleNamespace(wake_seconds=0.0), []

    def set_policy(self, adapter_dir, version):
        assert (Path(adapter_dir) / "adapter_model.safetensors").is_file()
        self.stats.wake_seconds += 0.001
        self.calls.append(("policy", Path(adapter_dir).name, version))

    def set_noise(self, sigma, seed, step, mode="absolute"):
        self.calls.append(("noise", sigma, step))

    def sleep(self):
        self.calls.append(("sleep",))


def test_run_step_orders_the_phases_and_hands_each_adapter_over(tmp_path):
    import torch

    from benchmarks.train_step import build_model
    from qerl_lib.paths import OPTIMIZER_STATE

    rs.register_shape("cpu-test", TINY)
    args = rs.parse_args(["--prompts", "2", "--group", "2", "--prompt", "5", "--max-completion", "6", "--micro-batch", "2",
                          "--warmup-prompts", "1"])
    cfg = rs.bench_config(args)
    pol = rs.make_policy(build_model("cpu-test", "nvfp4", 1, torch.device("cpu")), cfg, torch.device("cpu"))
    eng = _FakeEngine()
    asked = []

    def generate(engine, prompts, seeds, lengths):
        assert engine is eng
        asked.append(list(lengths))
        return _completions({"lengths": lengths})

    ctx = SimpleNamespace(engine=eng, policy=pol, cfg=cfg, peak=SimpleNamespace(take=lambda: 0), version=0, max_len=6,
                          adapters=tmp_path / "adapters", engine_awake=3 * 2**30, generate=generate)
    rs.save_state(pol, None, ctx.adapters / "v0", 0)
    warm = rs.run_step(ctx, rs.step_inputs(args, TINY["vocab"], -1), aqn=False)
    inp = rs.step_inputs(args, TINY["vocab"], 0)
    rec = rs.run_step(ctx, inp, aqn=True)
    assert eng.calls == [("policy", "v0", 0), ("sleep",), ("policy", "v1", 1), ("noise", 0.01, 1), ("sleep",)]
    assert asked == [rs.step_inputs(args, 1, -1)["lengths"], inp["lengths"]]
    assert ctx.version == 2 and sorted(p.name for p in ctx.adapters.iterdir()) == ["v1", "v2"]
    assert (ctx.adapters / "v2" / OPTIMIZER_STATE).is_file()
    assert warm["rows"] == 2 and rec["rows"] == rec["kept_rows"] == 4 and rec["sigma"] == 0.01
    assert rec["metrics"]["tokens"] == rec["completion_tokens"] == sum(inp["lengths"])
    assert rec["metrics"]["optimizer_steps"] == 1 and rec["optimizer"] == "torch.optim.adamw.AdamW"
    assert set(rec["phases_s"]) == set(rp.PHASES)
    assert set(rec["handover_parts_s"]) == {"wake", "adapter", "noise", "sleep", "save"}
    assert rec["phases_s"]["handover"] == pytest.approx(sum(rec["handover_parts_s"].values()), abs=2e-3)
    assert rec["step_s"] == pytest.approx(sum(rec["phases_s"].values()), abs=2e-3)
    assert rec["memory"]["peak_sum_gib"] == 3.0  # no CUDA here: the trainer adds 0 to the engine's 3 GiB
    want = rs.positions_of_lengths(inp["lengths"], 5, cfg)
    assert {k: rec[k] for k in want} == want and want["update_positions"] == 4 * 5 + sum(inp["lengths"])
    assert rec["metrics"]["update_positions"] == rec["update_positions"]  # the trainer's count is the same
    assert rec["metrics"]["update_padded_positions"] == rec["update_padded_positions"]


def _step(step_s, phases, peak, peak_sum=50.0):
    return {"step_s": step_s, "phases_s": dict(zip(rp.PHASES, phases)), "memory": {"peak_gib": peak, "peak_sum_gib": peak_sum}}


def test_assemble_has_the_required_keys_and_ratio():
    parts = {
        "bf16": {"arms": {"bf16": {"steps": [_step(100.0, (2, 20, 1, 77), 60.0), _step(110.0, (2, 22, 1, 85), 61.5)]}}},
        "nvfp4": {"arms": {"nvfp4": {"steps": [_step(70.0, (3, 15, 1, 51), 40.0)]}, "nvfp4-aqn": {"steps": []}},
                  "skipped": {"nvfp4-aqn": "deadline"}, "errors": {"exit": "exit 1"}},
    }
    out = rs.assemble(parts, "python benchmarks/rl_step.py", {"shape": "x"})
    for key in ("nvfp4_s_per_step", "bf16_s_per_step", "ratio", "peak_gib", "phases_s", "command"):
        assert key in out
    assert out["bf16_s_per_step"] == 105.0 and out["nvfp4_s_per_step"] == 70.0
    assert out["ratio"] == 1.5  # BF16 seconds / NVFP4 seconds
    assert out["ratio_aqn"] is None and out["nvfp4_aqn_s_per_step"] is None
    assert out["peak_gib"] == {"bf16": 61.5, "nvfp4": 40.0, "nvfp4-aqn": None}
    assert out["phases_s"]["bf16"] == {"handover": 2.0, "rollout": 21.0, "reward": 1.0, "update": 81.0}
    assert out["skipped"] == {"nvfp4-aqn": "deadline"} and out["errors"] == {"nvfp4:exit": "exit 1"}
    assert "arms" not in out["children"]["nvfp4"]
    assert statistics.fmean(out["phases_s"]["bf16"].values()) * 4 == pytest.approx(out["bf16_s_per_step"])
    assert rs.assemble({}, "c", {})["ratio"] is None


def test_merge_folds_a_second_call_into_one_result(tmp_path):
    first = rs.assemble({"bf16": {"arms": {"bf16": {"steps": [_step(120.0, (2, 20, 1, 97), 60.0)]}}},
                         "nvfp4": {"arms": {"nvfp4": {"steps": [_step(100.0, (3, 15, 1, 81), 40.0)]}, "nvfp4-aqn": {"steps": []}},
                                   "skipped": {"nvfp4-aqn": "deadline"}}}, "call 1", {"shape": "x"})
    second = rs.assemble({"nvfp4": {"arms": {"nvfp4-aqn": {"steps": [_step(96.0, (3, 15, 1, 77), 41.0)]}}}}, "call 2", {})
    paths = []
    for i, r in enumerate((first, second)):
        paths.append(str(tmp_path / f"{i}.json"))
        Path(paths[-1]).write_text(json.dumps(r))
    out = rs.merge(paths, str(tmp_path / "merged.json"))
    assert json.loads((tmp_path / "merged.json").read_text())["ratio_aqn"] == out["ratio_aqn"] == 1.25
    assert out["ratio"] == 1.2 and out["command"] == ["call 1", "call 2"] and out["settings"] == {"shape": "x"}
    assert out["peak_gib"] == {"bf16": 60.0, "nvfp4": 40.0, "nvfp4-aqn": 41.0} and out["ratio_note"]


def test_driver_records_children_that_fail_and_still_writes_the_result(tmp_path):
    """On a machine without CUDA each child fails at its first CUDA call: the driver must still write the
    result file, with the child's exception and exit code, the command and the settings."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    out = tmp_path / "rl_step.json"
    argv = ["--arms", "nvfp4", "nvfp4-aqn", "--shape", "tiny", "--prompts", "2", "--group", "2", "--max-completion", "8",
            "--work", str(tmp_path / "w"), "--out", str(out), "--deadline-s", "300"]
    assert rs.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["command"].endswith(" ".join(argv)) and res["settings"]["max_completion"] == 8
    assert res["errors"]["nvfp4:exit"] == "exit 1" and res["errors"]["nvfp4:exception"]
    assert "bf16" not in res["children"]  # no BF16 arm asked: no BF16 child
    assert res["ratio"] is None and res["bf16_s_per_step"] is None and res["wall_s"] > 0


def test_settings_state_the_length_draw_and_kv():
    args = rs.parse_args(["--shape", "tiny", "--prompts", "4", "--max-completion", "64", "--steps", "2"])
    st = rs.settings_of(args)
    assert "lognormal, median 19.2" in st["lengths"]["distribution"]
    assert len(st["lengths"]["steps"]) == 2 and st["cuda_graph_sizes"][-3:] == [16, 24, 32]
    assert rs.capture_sizes(20) == [1, 2, 4, 8, 16, 20] and rs.capture_sizes(512)[-2:] == [448, 512]
    lengths = [rs.step_inputs(args, 8, s)["lengths"] for s in (-1, 0, 1)]  # the warm-up and both timed steps
    assert st["kv_cache_gib"] == 0.5  # the floor: the tiny shape's rows need a few MiB
    args7b = rs.parse_args(["--steps", "2"])
    need = [rp.kv_cache_gib(rs.step_inputs(args7b, 8, s)["lengths"], 256, rp.SHAPE_7B) for s in (-1, 0, 1)]
    assert rs.kv_gib_of(args7b) == max(need) > 15 and rs.kv_gib_of(rs.parse_args(["--kv-gib", "30"])) == 30
    assert st["lengths"]["steps"][1] == rs.length_stats(lengths[2], 64)
    assert st["config"]["optim"]["micro_batch_size"] == 8 and st["config"]["rollout"]["vllm_lora_dual_stream"] is True
    assert st["config"]["optim"]["gradient_checkpointing"] is True and st["config"]["algo"]["loss"] == "dapo"
    assert st["config"]["optim"]["sort_micro_batches"] is True and st["micro_batch_order"] == "length"
    assert st["update_positions"][1] == rs.positions_of_lengths(lengths[2], args.prompt, rs.bench_config(args))


def test_length_order_cuts_the_padding_of_the_issue_step():
    """The issue-17 step (512 rows, prompts of 256, log-normal completions up to 1024, micro-batch 8): the
    trainer's length grouping pads about 1 % where rollout-order slices padded 59 % (seed 0, step 0)."""
    args = rs.parse_args([])
    pos = rs.positions_of_lengths(rs.step_inputs(args, 2, 0)["lengths"], args.prompt, rs.bench_config(args))
    assert pos == {"update_positions": 314_029, "update_padded_positions": 317_448,
                   "update_padded_positions_rollout_order": 499_768}


_SAMPLER_AT_EXIT = """
import sys, torch
sys.path.insert(0, {root!r})
from benchmarks.rl_step import DevicePeak
a = torch.randn(800, 800)

def used():
    torch.mm(a, a)  # a torch call that releases the GIL, as torch.cuda.mem_get_info does
    return 1

peak = DevicePeak(period=0.0, used=used)
peak.take()
if sys.argv[1] == "close":
    peak.close()
    assert not peak._thread.is_alive()
print("done", flush=True)
"""


def test_device_peak_closes_its_sampler_so_the_child_exits_cleanly(tmp_path):
    """The rl_step child's abort at exit (SIGABRT after its results were written): a sampler thread left
    inside a GIL-releasing torch call while the interpreter finalizes is ended with pthread_exit, and the
    unwinding through torch's C++ frames calls std::terminate. Closed first, the process exits 0."""
    import subprocess

    script = tmp_path / "sampler.py"
    script.write_text(_SAMPLER_AT_EXIT.format(root=str(Path(__file__).resolve().parents[1])))
    run = dict(capture_output=True, text=True, timeout=120, cwd=tmp_path)  # a core dump, if enabled, stays in tmp_path
    closed = subprocess.run([sys.executable, str(script), "close"], **run)
    assert closed.returncode == 0 and closed.stdout.strip() == "done", closed.stderr[-2000:]
    if sys.version_info >= (3, 14):  # CPython 3.14 parks such a thread instead of ending it (gh-87135)
        return
    left = subprocess.run([sys.executable, str(script), "leave"], **run)
    assert left.stdout.strip() == "done"
    assert left.returncode == -6 and "terminate called without an active exception" in left.stderr, \
        (left.returncode, left.stderr[-2000:])


_CUDA_SAMPLER_AT_EXIT = """
import sys, torch
sys.path.insert(0, {root!r})
from benchmarks.rl_step import DevicePeak
x = torch.randn(4096, 4096, device="cuda")
peak = DevicePeak(period=0.0)  # the real cudaMemGetInfo, as fast as it goes
for _ in range(200):
    x = torch.tanh(x @ x)
torch.cuda.synchronize()
assert peak.take() > 0
if sys.argv[1] == "close":
    peak.close()
print("done", flush=True)
"""


@pytest.mark.gpu
def test_device_peak_on_cuda_exits_cleanly_once_closed(tmp_path):
    """The same on a GPU, with the sampler's real `torch.cuda.mem_get_info` (the form that aborted the rl_step
    children): closed, the process exits 0. Left running it may abort or not, by timing; the device call
    that ran this test counted that separately (docs/gpu.md, "Session 35")."""
    import subprocess

    script = tmp_path / "cuda_sampler.py"
    script.write_text(_CUDA_SAMPLER_AT_EXIT.format(root=str(Path(__file__).resolve().parents[1])))
    for _ in range(5):
        closed = subprocess.run([sys.executable, str(script), "close"], capture_output=True, text=True,
                                timeout=300, cwd=tmp_path)
        assert closed.returncode == 0 and closed.stdout.strip() == "done", (closed.returncode, closed.stderr[-2000:])
