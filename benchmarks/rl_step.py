"""Seconds and peak GPU memory of one whole GRPO/DAPO RL step on the H200, BF16 + LoRA against NVFP4 +
LoRA (+ AQN), Qwen2.5-7B shape with random weights, in one call (issue 17, part 2).

    python benchmarks/rl_step.py --out $OUT/rl_step.json
    python benchmarks/rl_step.py --shape tiny --prompts 4 --max-completion 64 --out /tmp/rl_step_smoke.json

The step is `qerl run`'s with `rollout.backend: vllm`, the project's code paths, timed phase by phase
after one small untimed warm-up step (`--warmup-prompts` x G rows), `--steps` times per arm:
- handover: `VLLMEngine.set_policy` (wake-up, adapter swap by id; on the NVFP4 engine the re-merge into
  the dense copies used above `dense_above` rows), the AQN noise written into vLLM's norms (aqn arm),
  `sleep()` after the rollout, and after the update adapter i+1 with its optimizer state, written as
  `update@i` writes them;
- rollout: `--prompts` x `--group` rows of `--prompt` random tokens at T = 1, per-row seeds, logprobs.
  Random weights never emit EOS, so row i gets exactly L_i tokens (per-row `max_tokens`, `ignore_eos`):
  L_i = round(exp(N(log m, 0.6^2))), m = 0.3 x `--max-completion` (307 at 1024), clipped to [1, max],
  numpy default_rng(seed + step): mean about 360, 2 % at the cap. The project's GSM8K runs measured
  medians of 190-260 tokens with log-sd 0.2-0.37 at a 384 cap (`experiments/qwen05_gsm8k/results`);
  the wider spread stands for a mix of prompts. Every arm gets the same lengths, prompts and seeds;
- reward: a stand-in decode (no tokenizer: a word per token id, then `#### N`), `scoring.score_rows`
  (GSM8K grader), group advantages, DAPO's dynamic-sampling mask. Half the rows of each group (at least
  one, never all) end with the right N, so every row trains: the most update work a step can have;
- update: the optimizer rebuilt from the saved state, `trainer.train_on_rollouts` under `aqn.noised` as
  `update@i` runs it: the project's DAPO defaults (KL-metric pass with the adapter off, chunked log-prob
  head, non-reentrant gradient checkpointing, `--micro-batch` rows per micro-batch, grouped by length as
  the trainer groups them (`optim.sort_micro_batches`; `--micro-batch-order rollout` for the earlier
  rollout-order slices), clipping, one optimizer step). NVFP4 linears take the layer's CUDA backend (Triton,
  `docs/kernels.md`), BF16 ones plain bf16 `nn.Linear`.
Not timed (reported apart where measured): imports, the random model, the NVFP4 checkpoint (written
from the trainer's own packed weights), the engine start, the warm-up; not done: the stage files
(Parquet) that `qerl run` also writes, tokenization, evaluation.

Engines as `qerl_lib.policy.get_engine` builds them from the rollout defaults: LoRA r16, dual-stream
LoRA kernels ON in both arms (the best BF16 configuration too), `vllm_dense_above` auto (48 for 7B on
an H200; off on an 80 GB card, where the dense copies exceed a quarter of the engine's share; `--dense-above`),
on NVFP4 the decode GEMM of `rollout.vllm_gemv_rows` / `vllm_gemv_kernel` (`--gemv-rows`, `--gemv-kernel`; the
step recorded in `benchmarks/results/rl_step.json` ran before they defaulted to 8 / auto, with Marlin
at every small batch: its engine's `linear_info` says so), sleep mode; plus max_num_seqs = all rows, a KV cache of the blocks the rows need + 10 % (no
preemption, the same in both arms) and CUDA graphs for 23 batch sizes up to 512. The BF16 engine
loads vLLM's dummy weights (no 15 GB file; its trainer's random weights differ, which no timing sees).

Memory of a timed step: `peak_gib` = the GPU's used memory (cudaMemGetInfo total - free, sampled every
20 ms by a thread of the trainer process and at each phase boundary), so everything the arm holds: the
trainer process (context, caching-allocator reserve: base, LoRA, optimizer state, activations) and the
engine's processes (context, weights, dense copies, KV cache, CUDA graphs, what stays while asleep).
`peak_sum_gib` = the trainer's torch.cuda.max_memory_allocated over the step + the engine's awake
footprint (used memory after its start minus before): an upper bound that ignores the sleep. Each base
format runs in its own child process, one after the other: vLLM's memory lives in processes of its own
that only an exit frees for certain, and a fresh process gives a clean baseline. The AQN arm shares
the NVFP4 child and engine.

Run time (estimated from the project's measurements, not run yet): per child about 20 s of imports,
60-120 s of engine start, 10 s of warm-up; a 7B step is 60-85 s (85-110 s in rollout order): rollout 10-20 s
(183k completion tokens), update 70-90 s in rollout order (each micro-batch, here one group, padded to its
longest row: 500k positions for 314k real ones, at about 7k positions/s with the KL-metric pass), 45-60 s
grouped by length (317k positions; each step records `update_positions`, `update_padded_positions` and the
rollout-order count `update_padded_positions_rollout_order`). BF16 runs first, then NVFP4, then NVFP4 +
AQN. A child's first timed step always runs; each later one (the AQN arm's too) only if 1.2x the previous
step + 20 s fits in the child's share of the time left before `--deadline-s` (510 s: BF16 gets half, NVFP4
the rest); children are killed 30 s after the deadline. At the 7B defaults expect 8-8.5 min; when the AQN
step is cut (`skipped`), run it in a second call and combine:
    python benchmarks/rl_step.py --arms nvfp4-aqn --out $OUT/rl_step_aqn.json          (about 5 min)
    python benchmarks/rl_step.py --merge rl_step.json rl_step_aqn.json --out rl_step.json
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import shlex
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# the step's inputs, sizes, config and result file: pure functions, tested without a GPU
from benchmarks.rl_step_plan import (ARMS, GIB, SHAPES, assemble, bench_config, capture_sizes,  # noqa: E402
                                     kv_gib_of, length_stats, positions_of_lengths, register_shape, rollout_rows,
                                     score_step, shape_of, step_inputs, update_positions)


# ----------------------------------------------------------------------------- trainer side (CPU or GPU)


def make_policy(model, cfg, device) -> SimpleNamespace:
    """What `train_on_rollouts` reads of a `qerl_lib.policy.Policy`: the PEFT model, device, AQN injector, pad id."""
    from qerl_lib.aqn import NoiseInjector
    from qerl_lib.lora import apply_lora

    peft = apply_lora(model, cfg.lora)
    return SimpleNamespace(model=peft, device=device, injector=NoiseInjector(peft), tokenizer=SimpleNamespace(pad_token_id=0))


def save_state(policy, optimizer, out: Path, step: int) -> Path:
    """Adapter `step` and the optimizer state beside it, as `update@i` writes them."""
    import torch

    from qerl_lib.io import atomic_dir, atomic_write_json
    from qerl_lib.lora import write_adapter_files
    from qerl_lib.paths import OPTIMIZER_STATE, TRAINER_STATE

    with atomic_dir(out) as tmp:
        write_adapter_files(policy.model, tmp)
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / OPTIMIZER_STATE)
        atomic_write_json(tmp / TRAINER_STATE, {"step": step, "optimizer_steps": step})
    return out


def update_phase(policy, rows: list[dict], cfg, state_dir: Path | None, step: int, sigma: float):
    """`update@i` in memory: the optimizer from the saved state, `train_on_rollouts` under the step's noise."""
    from qerl_lib.aqn import noised
    from qerl_lib.optim import build_optimizer, make_scheduler
    from qerl_lib.paths import OPTIMIZER_STATE
    from qerl_lib.stages.update import load_optimizer_state
    from qerl_lib.trainer import train_on_rollouts

    optimizer = build_optimizer([p for p in policy.model.parameters() if p.requires_grad], cfg.optim, policy.device)
    if state_dir is not None and (state_dir / OPTIMIZER_STATE).is_file():
        optimizer.load_state_dict(load_optimizer_state(state_dir / OPTIMIZER_STATE, policy.device))
    scheduler = make_scheduler(optimizer, cfg.run.steps * cfg.algo.mini_batches, cfg.optim, step)
    with noised(policy.injector, float(sigma), cfg.aqn.seed, step, cfg.aqn.sigma_mode):
        metrics = train_on_rollouts(policy, optimizer, scheduler, [r for r in rows if r["kept"]], cfg)
    return metrics, optimizer


def write_engine_checkpoint(model, shape: dict, quant: str, out: Path) -> Path:
    """The engine's checkpoint: NVFP4, the trainer's own tensors in compressed-tensors layout; BF16,
    config.json alone (the engine loads vLLM's dummy weights)."""
    from safetensors.torch import save_file

    from benchmarks.rollout_checkpoints import qwen7b_config

    out.mkdir(parents=True, exist_ok=True)
    if quant == "nvfp4" and not (out / "model.safetensors").is_file():
        t = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if "rotary" not in k}
        save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(qwen7b_config(quant == "nvfp4", shape), indent=1))
    return out


# ----------------------------------------------------------------------------- GPU side (child process)


class DevicePeak:
    """Largest device-wide used memory (cudaMemGetInfo total - free) since the last `take`, sampled by a thread.

    `close` stops and joins the thread. It must run before the process exits: a daemon thread caught inside
    a torch call (which releases the GIL) when the interpreter finalizes is ended by CPython with
    pthread_exit, whose unwinding through torch's C++ frames calls std::terminate ("terminate called without
    an active exception", SIGABRT), after the results are written."""

    def __init__(self, period: float = 0.02, used: Callable[[], int] | None = None):
        if used is not None:  # the tests' stand-in for cudaMemGetInfo
            self.used = used
        self.period, self.peak = period, self.used()  # fails here, not in the thread, where CUDA is missing
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="device-peak", daemon=True)
        self._thread.start()

    @staticmethod
    def used() -> int:
        import torch

        free, total = torch.cuda.mem_get_info()
        return total - free

    def _run(self):
        while not self._stop.wait(self.period):
            self.peak = max(self.peak, self.used())

    def take(self) -> int:
        now = self.used()
        peak, self.peak = max(self.peak, now), now
        return peak

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def start_engine(ckpt: Path, quant: str, cfg, rows: int):
    from qerl_lib.policy import dense_above_for, gemv_rows_for, vllm_memory_kwargs
    from qerl_lib.rollout.vllm_engine import VLLMEngine

    rc = cfg.rollout
    kw = {"max_num_seqs": rows, "compilation_config": {"cudagraph_capture_sizes": capture_sizes(rows)},
          **vllm_memory_kwargs(rc), **({"load_format": "dummy"} if quant == "bf16" else {})}
    return VLLMEngine(ckpt, max_lora_rank=rc.vllm_max_lora_rank, gpu_memory_utilization=rc.vllm_gpu_memory_utilization,
                      enforce_eager=rc.vllm_enforce_eager, seed=cfg.run.seed, max_model_len=rc.vllm_max_model_len,
                      dense_above=dense_above_for(cfg, ckpt), lora_dual_stream=rc.vllm_lora_dual_stream,
                      # the config is shared by the arms; the arm's format decides whether the GEMM applies
                      gemv_rows=gemv_rows_for(cfg, quant), gemv_kernel=rc.vllm_gemv_kernel,
                      gemv_pdl=rc.vllm_gemv_pdl,
                      gemv_repack=rc.vllm_gemv_repack, engine_kwargs=kw)


def generate_rows(engine, prompts: list[list[int]], seeds: list[int], lengths: list[int]) -> list:
    """`VLLMEngine.generate` at T = 1, with one `max_tokens` per row and `ignore_eos` (it takes one cap for all)."""
    from vllm import SamplingParams as VSamplingParams

    from qerl_lib.rollout.sampling import SamplingParams
    from qerl_lib.rollout.vllm_engine import to_completion, vllm_sampling_kwargs

    engine.wake_up()
    base = SamplingParams(1.0, 1.0, max(lengths))  # T = 1: logit scale 1, the engine's own
    sps = [VSamplingParams(**{**vllm_sampling_kwargs(base, s, ()), "max_tokens": int(n), "ignore_eos": True})
           for s, n in zip(seeds, lengths)]
    outs = engine.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sps,
                               lora_request=engine.lora_request, use_tqdm=False)
    comps = [to_completion(o) for o in outs]
    bad = sum(len(c.token_ids) != n for c, n in zip(comps, lengths))
    if bad:
        raise RuntimeError(f"{bad} of {len(comps)} rows did not get their drawn length")
    return comps


def run_step(ctx: SimpleNamespace, inp: dict, aqn: bool) -> dict:
    """One RL step: adapter i (written by the last update) to the engine, rollout, sleep, reward, update,
    adapter i+1 and optimizer state written as `update@i` writes them."""
    import torch

    eng, pol, cfg, version = ctx.engine, ctx.policy, ctx.cfg, ctx.version
    sigma = cfg.aqn.sigma_start if aqn else 0.0
    adapter = ctx.adapters / f"v{version}"
    cuda = pol.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sync()
    ctx.peak.take()
    clock = [time.perf_counter()]

    def lap():
        sync()
        now = time.perf_counter()
        dt, clock[0] = now - clock[0], now
        return round(dt, 3)

    parts, mem = {}, {}
    wake0 = eng.stats.wake_seconds
    eng.set_policy(adapter, version)
    parts["wake"] = round(eng.stats.wake_seconds - wake0, 3)
    parts["adapter"] = round(lap() - parts["wake"], 3)
    if aqn:
        eng.set_noise(sigma, cfg.aqn.seed, version, mode=cfg.aqn.sigma_mode)
    parts["noise"] = lap()
    comps = ctx.generate(eng, inp["prompts"], inp["seeds"], inp["lengths"])
    rollout_s = lap()
    mem["handover_rollout_device_gib"] = round(ctx.peak.take() / GIB, 2)
    eng.sleep()
    parts["sleep"] = lap()
    rows = score_step(rollout_rows(inp, comps, ctx.max_len), cfg)
    reward_s = lap()
    metrics, optimizer = update_phase(pol, rows, cfg, adapter, version, sigma)
    update_s = lap()
    save_state(pol, optimizer, ctx.adapters / f"v{version + 1}", version + 1)
    parts["save"] = lap()
    mem["sleep_reward_update_device_gib"] = round(ctx.peak.take() / GIB, 2)
    shutil.rmtree(ctx.adapters / f"v{version - 1}", ignore_errors=True)  # swapped out of the engine above
    ctx.version += 1
    trainer = torch.cuda.max_memory_allocated() if cuda else 0
    mem.update(peak_gib=max(mem.values()), trainer_max_allocated_gib=round(trainer / GIB, 2),
               trainer_max_reserved_gib=round(torch.cuda.max_memory_reserved() / GIB, 2) if cuda else 0,
               peak_sum_gib=round((trainer + ctx.engine_awake) / GIB, 2))
    phases = {"handover": round(sum(parts.values()), 3), "rollout": rollout_s, "reward": reward_s, "update": update_s}
    kept = [r for r in rows if r["kept"]]
    return {"step_s": round(sum(phases.values()), 3), "phases_s": phases, "handover_parts_s": parts, "memory": mem,
            "rows": len(rows), "kept_rows": len(kept), "completion_tokens": sum(inp["lengths"]),
            "rollout_tok_s": round(sum(inp["lengths"]) / max(rollout_s, 1e-9), 1),
            **update_positions(kept, cfg), "sigma": sigma,
            "optimizer": type(optimizer).__module__ + "." + type(optimizer).__name__,
            "metrics": {k: metrics.get(k) for k in ("loss", "grad_norm", "kl", "mismatch_kl", "tokens", "optimizer_steps",
                                                    "update_positions", "update_padded_positions")}}


def child(args) -> None:
    """One base format in its own process: its trainer and engine, the warm-up, its arms' timed steps."""
    from qerl_lib.io import atomic_write_json

    out = Path(args.work) / f"part-{args.child}.json"
    res = {"group": args.child, "arms": {}, "errors": {}, "skipped": {}}
    # A SIGABRT prints every Python thread's stack, and the threads still alive at the end are named below.
    # Session 34 found only the memory sampler alive at an NVFP4 child's abort at exit (DevicePeak says why).
    faulthandler.enable(all_threads=True)
    peak = None
    try:
        peak = DevicePeak()
        _child(args, res, out, peak)
    except BaseException as e:  # the part file keeps what was measured and says why it stopped
        res["errors"]["exception"] = f"{type(e).__name__}: {str(e)[:2000]}"
        atomic_write_json(out, res)
        raise
    finally:
        if peak is not None:
            peak.close()
        alive = [f"{t.name} (daemon={t.daemon})" for t in threading.enumerate() if t is not threading.main_thread()]
        print(f"[{args.child}] threads alive at the child's end: {alive}", flush=True)


def _child(args, res: dict, out: Path, peak: DevicePeak) -> None:
    import torch

    from benchmarks.train_step import base_weight_bytes, build_model, lora_bytes
    from benchmarks.train_step import versions as lib_versions
    from qerl_lib.io import atomic_write_json

    group, deadline, work, shape = args.child, float(args.deadline), Path(args.work), shape_of(args)
    arms = [a for a in args.arms if (a == "bf16") == (group == "bf16")]
    register_shape(args.shape, SHAPES[args.shape])
    cfg = bench_config(args, kv_gib_of(args))
    res.update(versions=lib_versions(), kv_cache_gib=cfg.rollout.vllm_kv_cache_gib)
    res["device_used_at_start_gib"] = round(peak.used() / GIB, 2)
    t0 = time.perf_counter()
    model = build_model(args.shape, group, shape["layers"], torch.device("cuda"), seed=args.seed)
    ckpt = write_engine_checkpoint(model, shape, group, work / f"ckpt-{group}-{args.shape}-L{shape['layers']}-s{args.seed}")
    pol = make_policy(model, cfg, torch.device("cuda"))
    res["trainer"] = {"build_s": round(time.perf_counter() - t0, 1), "base_weight_gib": round(base_weight_bytes(pol.model) / GIB, 2),
                      "lora_gib": round(lora_bytes(pol.model) / GIB, 3)}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    u0 = peak.used()
    eng = start_engine(ckpt, group, cfg, args.prompts * args.group)
    u1 = peak.used()
    eng.sleep()
    res["engine"] = {"startup_s": eng.stats.startup_seconds, "awake_gib": round((u1 - u0) / GIB, 2),
                     "asleep_gib": round((peak.used() - u0) / GIB, 2), "dense_above": eng.dense_above,
                     "lora_dual_stream": eng.lora_dual_stream, "linear_info": eng.rpc("qerl_linear_info")}
    res["versions"]["vllm"] = getattr(sys.modules.get("vllm"), "__version__", None)
    print(f"[{group}] engine up in {eng.stats.startup_seconds:.0f} s: {res['engine']}", flush=True)
    ctx = SimpleNamespace(engine=eng, policy=pol, cfg=cfg, peak=peak, version=0, max_len=args.max_completion,
                          adapters=work / f"adapters-{group}", engine_awake=u1 - u0, generate=generate_rows)
    shutil.rmtree(ctx.adapters, ignore_errors=True)
    save_state(pol, None, ctx.adapters / "v0", 0)  # init_adapter: B = 0, no optimizer state yet
    t = time.perf_counter()
    run_step(ctx, step_inputs(args, shape["vocab"], -1), aqn=arms == ["nvfp4-aqn"])
    res["warmup_s"] = round(time.perf_counter() - t, 1)
    atomic_write_json(out, res)
    last = None
    for arm in arms:
        res["arms"][arm] = {"steps": []}
        for s in range(args.steps):
            if last is not None and time.time() + 1.2 * last + 20 > deadline:
                res["skipped"][arm] = f"deadline: {deadline - time.time():.0f} s left, a step took {last:.0f} s"
                print(f"[{arm}] skipped: {res['skipped'][arm]}", flush=True)
                break
            rec = run_step(ctx, step_inputs(args, shape["vocab"], s), aqn=arm.endswith("-aqn"))
            last = rec["step_s"]
            res["arms"][arm]["steps"].append(rec)
            print(f"[{arm}] step {s}: {rec['step_s']} s {rec['phases_s']}, peak {rec['memory']['peak_gib']} GiB", flush=True)
            atomic_write_json(out, res)
    res["engine"]["stats"] = eng.stats_dict()
    atomic_write_json(out, res)
    eng.close()


# ----------------------------------------------------------------------------- driver


def settings_of(args) -> dict:
    med = args.len_median or 0.3 * args.max_completion
    return {"shape": f"Qwen2.5-{args.shape}", **shape_of(args), "prompts": args.prompts, "group": args.group,
            "prompt_tokens": args.prompt, "max_completion": args.max_completion, "timed_steps": args.steps,
            "warmup_rows": args.warmup_prompts * args.group, "micro_batch": args.micro_batch,
            "micro_batch_order": args.micro_batch_order, "seed": args.seed,
            "lengths": {"distribution": f"lognormal, median {med:g}, log-sd {args.len_sigma}, rounded, clipped to "
                                        f"[1, {args.max_completion}], numpy default_rng(seed + step)",
                        "steps": [length_stats(step_inputs(args, 2, s)["lengths"], args.max_completion)
                                  for s in range(args.steps)]},
            "update_positions": [positions_of_lengths(step_inputs(args, 2, s)["lengths"], args.prompt, bench_config(args))
                                 for s in range(args.steps)],
            "kv_cache_gib": kv_gib_of(args), "cuda_graph_sizes": capture_sizes(args.prompts * args.group),
            "config": bench_config(args).model_dump(mode="json", include={"lora", "rollout", "algo", "optim", "aqn", "reward"}),
            "deadline_s": args.deadline_s}


def driver(args, argv: list[str]) -> dict:
    from benchmarks.bench_children import run_child
    from qerl_lib.io import atomic_write_json

    t0 = time.time()
    deadline = t0 + args.deadline_s
    Path(args.work).mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).as_posix(), *argv])
    settings, parts, result = settings_of(args), {}, {}
    groups = [g for g in ("bf16", "nvfp4") if any((a == "bf16") == (g == "bf16") for a in args.arms)]
    for i, group in enumerate(groups):
        left = deadline - time.time()
        share = time.time() + left / (len(groups) - i)  # a child's steps after its first must end within it
        part = Path(args.work) / f"part-{group}.json"
        part.unlink(missing_ok=True)
        if left < 60:
            parts[group] = {"errors": {"start": f"not started: {left:.0f} s left"}}
        else:
            print(f"== {group} ({left:.0f} s left)", flush=True)
            rc = run_child([sys.executable, str(Path(__file__).resolve()), *argv, "--child", group,
                            "--deadline", str(share)], timeout=left + 30)
            parts[group] = json.loads(part.read_text()) if part.is_file() else {}
            if rc != 0:
                parts[group].setdefault("errors", {})["exit"] = f"exit {rc}"
        result = dict(assemble(parts, command, settings), wall_s=round(time.time() - t0, 1))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(args.out), result)
    print(json.dumps({k: result.get(k) for k in ("bf16_s_per_step", "nvfp4_s_per_step", "nvfp4_aqn_s_per_step", "ratio",
                                                  "ratio_aqn", "peak_gib", "phases_s", "errors", "skipped")}, indent=1))
    return result


def merge(paths: list[str], out: str) -> dict:
    """One result from several calls' result files (e.g. `--arms nvfp4-aqn` run apart); a later file's
    arm replaces an earlier one's, `command` lists every call, and ratios across calls are marked."""
    from qerl_lib.io import atomic_write_json

    runs = [json.loads(Path(f).read_text()) for f in paths]
    parts = {}
    for i, r in enumerate(runs):
        for g, rec in r.get("children", {}).items():
            parts[f"{g}#{i}"] = dict(rec, arms={a: v for a, v in r.get("arms", {}).items() if (a == "bf16") == (g == "bf16")})
    result = dict(assemble(parts, [r["command"] for r in runs], runs[0].get("settings", {})), merged_from=list(paths))
    result["ratio_note"] = "arms measured in different calls, on machines that may differ" if len(runs) > 1 else None
    atomic_write_json(Path(out), result)
    return result


def dense_above_arg(text: str) -> int | str:
    """`--dense-above`: a row count (at least 1), `auto` or `off`, as `rollout.vllm_dense_above` takes it."""
    if text in ("auto", "off"):
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a row count, auto or off, got {text!r}")
    return int(text)


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group", type=int, default=8, help="G: completions per prompt (at least 2)")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    p.add_argument("--max-completion", type=int, default=1024)
    p.add_argument("--len-median", type=float, default=None, help="median completion length (default 0.3 x max)")
    p.add_argument("--len-sigma", type=float, default=0.6, help="log-sd of the completion lengths")
    p.add_argument("--steps", type=int, default=1, help="timed steps per arm, after one untimed warm-up step")
    p.add_argument("--warmup-prompts", type=int, default=1, help="prompts of the warm-up step (x group rows)")
    p.add_argument("--micro-batch", type=int, default=8, help="optim.micro_batch_size (the project's GPU runs: 8)")
    p.add_argument("--micro-batch-order", choices=("length", "rollout"), default="length",
                   help="optim.sort_micro_batches: rows grouped by length (the default), or rollout-order slices")
    p.add_argument("--gemv-rows", type=int, default=None,
                   help="rollout.vllm_gemv_rows of the NVFP4 engine (default: the config's; 0: Marlin at every batch)")
    p.add_argument("--gemv-kernel", choices=("auto", "triton", "cuda"), default=None,
                   help="rollout.vllm_gemv_kernel (default: the config's)")
    p.add_argument("--dense-above", type=dense_above_arg, default=None,
                   help="rollout.vllm_dense_above of the NVFP4 engine: rows, auto or off (default: the config's, auto, "
                        "which turns the dense copies off on an 80 GB card at this benchmark's memory share)")
    p.add_argument("--engine-mem", type=float, default=None,
                   help="rollout.vllm_gpu_memory_utilization (default: the config's, 0.5); the dense copies of "
                        "--dense-above need more than 0.5 of an 80 GB card beside the KV cache")
    p.add_argument("--kv-gib", type=float, default=None, help="engine KV cache (default: what the rows need + 10 %%)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline-s", type=float, default=510.0, help="no step starts that would end after this")
    p.add_argument("--work", default="/dev/shm/qerl-rl-step" if Path("/dev/shm").is_dir() else "/tmp/qerl-rl-step")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/rl_step.json"))
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON", help="combine these result files into --out")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.group < 2:
        p.error("--group must be at least 2 (a group of one has no advantage)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.merge:
        merge(args.merge, args.out)
    elif args.child:
        child(args)
    else:
        driver(args, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
