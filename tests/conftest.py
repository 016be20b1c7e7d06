"""Shared fixtures: tiny random causal LMs (dense and NVFP4A16) with a tiny tokenizer.

The NVFP4 checkpoints are made the real way: the dense model is saved with
`save_pretrained` and llm-compressor's `oneshot` (data-free NVFP4A16, `ignore=["lm_head"]`)
writes a compressed-tensors checkpoint from that directory. Everything is session-scoped,
so each conversion runs once per test session (about a second each on two CPU cores).
"""

from __future__ import annotations

import os
import shutil
import string

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")  # as qerl_lib sets it; before torch loads MKL
import warnings
from pathlib import Path

import pytest
import torch

TINY_SPECIAL_TOKENS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_VOCAB = 256
_CORPUS = [
    "What is 3 + 4? The answer is 7. #### 7",
    "Compute 12 * 5 step by step: 12 * 5 = 60. \\boxed{60}",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May.",
    "The final answer is 1,234. #### 1234",
    "system\nYou are a helpful assistant. user\nSolve the problem. assistant\n",
]


def build_tiny_tokenizer():
    """A ChatML-style `PreTrainedTokenizerFast` of at most 256 tokens.

    BPE over every printable ASCII character (so any arithmetic prompt encodes without
    <unk>) with merges learnt from a few strings; spaces become the Metaspace symbol,
    so decode(encode(text)) == text exactly (chat markup included). eos = `<|im_end|>`, pad = `<|endoftext|>`, no bos;
    the chat template renders `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    # No prepended or split-on spaces: decode(encode(text)) == text, special tokens included.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never", split=False)
    tok.decoder = decoders.Metaspace(prepend_scheme="never", split=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=TINY_SPECIAL_TOKENS,
        initial_alphabet=list(string.printable) + ["\u2581"],
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    assert len(fast) <= TINY_VOCAB
    return fast


def _tiny_config(kind: str, tokenizer):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        # Wider than the default 0.02 so that the tiny models' logits are not all ~0.
        initializer_range=0.1,
    )
    if kind == "llama":
        return LlamaConfig(tie_word_embeddings=True, **common)
    if kind == "qwen2":
        return Qwen2Config(tie_word_embeddings=False, **common)  # Qwen2 also has q/k/v biases
    raise ValueError(kind)


def build_tiny_dense(kind: str, out_dir: Path, seed: int = 0) -> Path:
    """Random tiny `LlamaForCausalLM` (tied embeddings) or `Qwen2ForCausalLM` (untied, qkv
    bias) saved in bfloat16 with its tokenizer and a generation config (eos = <|im_end|>)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_tiny_config(kind, tokenizer)).to(torch.bfloat16)
    if kind == "qwen2":  # non-zero biases, so that bias handling is really tested
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0, 0.1)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def convert_nvfp4(dense_dir: Path, out_dir: Path) -> Path:
    """llm-compressor NVFP4A16 (data-free) of `dense_dir` into `out_dir`, tokenizer included."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    with warnings.catch_warnings():
        # llm-compressor's CPU "offloading" makes transformers warn about a 50 GB shard size
        warnings.filterwarnings("ignore", message="Attempting to save a model with offloaded modules")
        oneshot(
            model=str(dense_dir),
            recipe=QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=["lm_head"]),
            output_dir=str(out_dir),
        )
    if not (out_dir / "tokenizer.json").is_file():
        build_tiny_tokenizer().save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """Dense bf16 tiny LlamaForCausalLM dir (hidden 64, 2 layers, 4 heads / 2 kv heads,
    vocab 256, tied embeddings) with config, generation_config, tokenizer (ChatML chat
    template, eos `<|im_end|>`, pad `<|endoftext|>`)."""
    return build_tiny_dense("llama", tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """Dense bf16 tiny Qwen2ForCausalLM dir (as tiny_llama_dir but untied lm_head and
    non-zero q/k/v biases)."""
    return build_tiny_dense("qwen2", tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="session")
def tiny_llama_nvfp4_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """llm-compressor NVFP4A16 checkpoint of tiny_llama_dir (compressed-tensors
    `nvfp4-pack-quantized`, lm_head ignored), with the same tokenizer files."""
    return convert_nvfp4(tiny_llama_dir, tmp_path_factory.mktemp("tiny_llama_nvfp4"))


@pytest.fixture(scope="session")
def tiny_qwen2_nvfp4_dir(tiny_qwen2_dir, tmp_path_factory) -> Path:
    """llm-compressor NVFP4A16 checkpoint of tiny_qwen2_dir (biases and lm_head stay bf16)."""
    return convert_nvfp4(tiny_qwen2_dir, tmp_path_factory.mktemp("tiny_qwen2_nvfp4"))


def write_ct_dequantized_dense(nvfp4_dir: Path, out_dir: Path, dtype: torch.dtype) -> Path:
    """Dense checkpoint whose quantized linears hold compressed-tensors' own dequantization.

    Every `<m>.weight_packed/weight_scale/weight_global_scale` triple becomes `<m>.weight`
    of `dtype`: for bfloat16 via `NVFP4PackedCompressor.decompress` (which unpacks to
    bfloat16), otherwise via `unpack_fp4_from_uint8(..., dtype)` + `dequantize(...,
    dtype=dtype)`. Other tensors are copied unchanged; config.json loses its
    quantization_config; tokenizer and generation config are copied. Used as the
    independent "same model, built dense" reference for the NVFP4 loader and LoRA.
    """
    import json
    import shutil

    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor, unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors.torch import load_file, save_file

    config = json.loads((nvfp4_dir / "config.json").read_text())
    quant = config.pop("quantization_config")
    (group,) = quant["config_groups"].values()
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
    tensors = load_file(str(nvfp4_dir / "model.safetensors"))
    dense = {}
    for key, tensor in tensors.items():
        if key.endswith(".weight_packed"):
            prefix = key.removesuffix("weight_packed")
            parts = {n: tensors[prefix + n] for n in ("weight_packed", "weight_scale", "weight_global_scale")}
            if dtype == torch.bfloat16:
                weight = NVFP4PackedCompressor.decompress(parts, scheme)["weight"]
            else:
                m, half = parts["weight_packed"].shape
                unpacked = unpack_fp4_from_uint8(parts["weight_packed"], m, 2 * half, dtype=dtype)
                weight = dequantize(
                    unpacked, parts["weight_scale"].to(dtype), args=scheme.weights,
                    global_scale=parts["weight_global_scale"], dtype=dtype,
                )
            assert weight.dtype == dtype
            dense[prefix + "weight"] = weight.contiguous()
        elif not key.endswith((".weight_scale", ".weight_global_scale")):
            dense[key] = tensor
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(dense, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (nvfp4_dir / name).is_file():
            shutil.copy(nvfp4_dir / name, out_dir / name)
    return out_dir


@pytest.fixture(scope="session")
def ct_dequantized_dir(tmp_path_factory):
    """Factory `(nvfp4_dir, dtype) -> dense dir` (cached per pair) built by
    `write_ct_dequantized_dense`: the NVFP4 model as a plain checkpoint, dequantized by
    compressed-tensors itself."""
    cache: dict[tuple[str, torch.dtype], Path] = {}

    def make(nvfp4_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
        key = (str(nvfp4_dir), dtype)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ct_dense_{Path(nvfp4_dir).name}_{str(dtype).removeprefix('torch.')}")
            cache[key] = write_ct_dequantized_dense(Path(nvfp4_dir), out, dtype)
        return cache[key]

    return make


# ----------------------------------------------------------------------------------------------
# Pipeline workspaces for the DVC, resume and audit tests (tests/test_dvc.py, test_resume.py,
# test_audit.py). Every subprocess runs with telemetry off and unbuffered output.

import os as _os
import shutil as _shutil
import subprocess as _subprocess
import sys as _sys

REPRODUCES_RERUNS = 1
"""How many times a `reproduces` test runs again after an AssertionError.

Those tests compare bytes made by separate processes (a resumed run, `dvc repro`, a rollout server,
a flow) with a reference run. On the CI machine a fresh process has, rarely, computed one stage's
floats differently in the last bits (twice in the eight full suites before this rule), while
rerunning that very stage on the same inputs gave the reference bytes every time
(docs/reliability.md, "One-off deviations"). A rerun of the test runs every door again, so a
difference the code makes fails twice; pytest's summary counts the rerun ("1 rerun")."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("reproduces") is not None and item.get_closest_marker("flaky") is None:
            item.add_marker(pytest.mark.flaky(reruns=REPRODUCES_RERUNS, only_rerun=["AssertionError"]))


PROJECT_ROOT = Path(__file__).resolve().parents[1]
QUIET_ENV = {
    "DVC_NO_ANALYTICS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
    "GIT_TERMINAL_PROMPT": "0", "GIT_AUTHOR_NAME": "qerl-test", "GIT_AUTHOR_EMAIL": "qerl-test@example.invalid",
    "GIT_COMMITTER_NAME": "qerl-test", "GIT_COMMITTER_EMAIL": "qerl-test@example.invalid",
}


def quiet_env(**extra: str) -> dict:
    """os.environ with telemetry off (DVC, Prefect, HF), unbuffered Python and a git identity,
    the venv's bin first on PATH (so `qerl` and `dvc` resolve even without activation), and this
    checkout first on PYTHONPATH: a child (`qerl ...`, `python -m qerl_lib`) then imports the tree
    under test, not the one the venv was installed from (a worktree sharing the venv of another
    checkout would otherwise test its own code in-process and the other's in every child)."""
    env = {**_os.environ, **QUIET_ENV, **extra}
    env["PATH"] = str(Path(_sys.executable).parent) + _os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = _os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def sh(args: list[str], cwd: Path, timeout: float = 600, check: bool = True, **extra_env: str):
    """Run a command (list form) in `cwd` with `quiet_env`; returns the CompletedProcess."""
    res = _subprocess.run(args, cwd=cwd, env=quiet_env(**extra_env), capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({res.returncode}):\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}")
    return res


# Token ids that end a completion besides <|im_end|> in `tiny_stoppy_llama_dir`.
STOP_IDS = list(range(4, 256, 6))


@pytest.fixture(scope="session")
def tiny_stoppy_llama_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """tiny_llama_dir whose generation config lists 42 stop tokens besides `<|im_end|>`, so its
    sampled completions end at varied lengths. With the DAPO overlong penalty over the whole
    length (`reward.overlong_buffer` = `rollout.max_new_tokens`) the samples of a group then get
    different rewards and every update really trains (a random model is never right, so
    correctness alone gives flat groups, which dynamic sampling drops)."""
    import json

    out = tmp_path_factory.mktemp("tiny_stoppy_llama")
    for f in Path(tiny_llama_dir).iterdir():
        if f.is_file():
            _shutil.copy(f, out / f.name)
    gen = json.loads((out / "generation_config.json").read_text())
    eos = gen["eos_token_id"]
    gen["eos_token_id"] = [eos] + [i for i in STOP_IDS if i != eos]
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out


# The tests' pipeline (`tiny_pipeline_tree`): its RL steps, the steps it evaluates after, and the files whose
# bytes must not depend on the door (dvc repro / qerl run). update.json and the provenance files hold
# wall-clock seconds; tests compare them without those keys.
STEPS = 2
EVALS = [0, 2]
SAME_BYTES = (
    [f"data/prepared/{s}.parquet" for s in ("train", "test")]
    + ["models/nvfp4/model.safetensors", "models/nvfp4/convert_report.json"]
    + [f"rollouts/step={i}/rollouts.parquet" for i in range(STEPS)]
    + [f"rewards/step={i}/{n}" for i in range(STEPS) for n in ("scored.parquet", "metrics.json")]
    + [f"adapters/step={i}/{n}" for i in range(STEPS + 1)
       for n in ("adapter_model.safetensors", "adapter_config.json", "trainer_state.json")]
    + [f"adapters/step={i}/optimizer.pt" for i in range(1, STEPS + 1)]
    + [f"eval/step={k}/samples.parquet" for k in EVALS]
)


def tiny_pipeline_tree(base: Path) -> dict:
    """Config tree of the small two-step pipeline the DVC / resume / audit tests run (root '.')."""
    return {
        "run": {"root": ".", "steps": STEPS, "seed": 0},
        "model": {"base": str(base)},
        "data": {"synthetic_train": 16, "synthetic_test": 4},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8, "batch_size": 8},
        "reward": {"overlong_buffer": 8, "format_weight": 0.1},  # the tiny models are never right
        "eval": {"max_prompts": 2, "k": 1, "max_new_tokens": 6},
        "aqn": {"enabled": True, "stages": 2},
    }


def write_params(ws: Path, tree: dict) -> Path:
    """`qerl plan` in `ws` from `tree` (written to ws/tiny.yaml): ws/params.yaml."""
    import yaml

    ws.mkdir(parents=True, exist_ok=True)
    (ws / "tiny.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    sh(["qerl", "plan", "-c", "tiny.yaml"], cwd=ws, timeout=120)
    return ws / "params.yaml"


@pytest.fixture(scope="session")
def tiny_pipeline(tiny_stoppy_llama_dir) -> dict:
    """The config tree of the tests' pipeline (see `tiny_pipeline_tree`)."""
    return tiny_pipeline_tree(tiny_stoppy_llama_dir)


def first_deviation(a: Path, b: Path, rels) -> str | None:
    """The first of `rels` (paths relative to a workspace) whose bytes differ between a and b, or None."""
    return next((rel for rel in rels if (a / rel).read_bytes() != (b / rel).read_bytes()), None)


@pytest.fixture(scope="session")
def reference_run(tiny_pipeline, tmp_path_factory) -> Path:
    """A finished, uninterrupted `qerl run -c params.yaml` of the tests' pipeline (run.root '.')
    in its own directory: what DVC and every resumed run must equal byte for byte.

    It runs twice, in two processes (a few seconds each): a one-off deviation in the last bits
    (docs/reliability.md, "One-off deviations") inside the reference would fail every test compared
    against it, rerun or not. When the two runs' `SAME_BYTES` differ, a third run decides, and the
    first of the two that agrees with it is returned, with a warning that names the file. Three
    different results mean that the code itself does not repeat, and the fixture fails."""
    def run(name: str) -> Path:
        ws = tmp_path_factory.mktemp(name)
        write_params(ws, tiny_pipeline)
        sh(["qerl", "run", "-c", "params.yaml"], cwd=ws, timeout=600)
        return ws

    first, second = run("reference_run"), run("reference_run_check")
    deviation = first_deviation(first, second, SAME_BYTES)
    if deviation is None:
        return first
    third = run("reference_run_vote")
    for ws in (first, second):
        if first_deviation(ws, third, SAME_BYTES) is None:
            warnings.warn(f"reference_run: {deviation} differs between two runs; {ws.name} agrees with a third",
                          stacklevel=1)
            return ws
    pytest.fail(f"reference_run: three runs of the pipeline give three different {deviation}")


def make_dvc_repo(dest: Path, tree: dict) -> Path:
    """A git + DVC repository laid out like the project: its dvc.yaml, .dvcignore, .gitignore and
    .dvc/config, a copy of qerl_lib/ (the stages' library dependencies: the code that runs is the
    installed package, the copy only keeps concurrent edits from making stages stale mid-test),
    and params.yaml written by `qerl plan` from `tree`."""
    dest.mkdir(parents=True, exist_ok=True)
    sh(["git", "init", "-q", "-b", "main"], cwd=dest)
    sh(["dvc", "init", "-q"], cwd=dest)
    for name in ("dvc.yaml", ".dvcignore", ".gitignore"):
        _shutil.copy(PROJECT_ROOT / name, dest / name)
    _shutil.copy(PROJECT_ROOT / ".dvc" / "config", dest / ".dvc" / "config")
    _shutil.copytree(PROJECT_ROOT / ".dvc" / "plots", dest / ".dvc" / "plots")  # dvc.yaml's plot templates
    _shutil.copytree(PROJECT_ROOT / "qerl_lib", dest / "qerl_lib",
                     ignore=_shutil.ignore_patterns("__pycache__", "*.pyc"))
    write_params(dest, tree)
    return dest


@pytest.fixture(scope="session")
def dvc_repro_done(tiny_pipeline, reference_run, tmp_path_factory) -> Path:
    """A git + DVC repository (`make_dvc_repo`) of the tests' pipeline after a whole `dvc repro`.
    Tests that change it work on a copy (`copy_repo`).

    A stage in a fresh process now and then computes its floats differently in the last bits
    (docs/reliability.md, "One-off deviations"); twice, in CI and in a local suite at 3c27b22, it was
    this repository's update@1, and every test compared against it failed, rerun or not. So this
    reference gets the rerun that `flow_done` has: when its bytes differ from `reference_run`'s
    (`qerl run`, one process), `dvc repro` runs once more in a fresh repository, with a warning that
    names the file. A difference the code makes comes back in the second run, and
    `test_dvc_repro_gives_the_bytes_of_qerl_run` fails on it."""
    for attempt in ("dvc_done", "dvc_done_rerun"):
        repo = make_dvc_repo(tmp_path_factory.mktemp(attempt) / "repo", tiny_pipeline)
        res = sh(["dvc", "repro"], cwd=repo, timeout=900)
        assert "Running stage 'report'" in res.stdout, res.stdout[-3000:]
        deviation = first_deviation(repo, reference_run, SAME_BYTES)
        if deviation is None:
            break
        warnings.warn(f"{attempt}: {deviation} differs from qerl run's bytes", stacklevel=1)
    return repo


def copy_repo(src: Path, dest: Path) -> Path:
    """A copy of a workspace (git, DVC cache and lock included) that a test may change."""
    _shutil.copytree(src, dest, symlinks=True)
    return dest


def stages_run(dvc_output: str) -> list[str]:
    """Names of the stages a `dvc repro` ran, in order, from its output."""
    import re

    return re.findall(r"Running stage '([^']+)'", dvc_output)


@pytest.fixture(scope="session")
def scored_workspace(tiny_llama_dir, tmp_path_factory):
    """Step 0 rolled out and scored on the tiny Llama, with hand-set advantages on every row."""
    from qerl_lib.config import load_config
    from qerl_lib.paths import Layout
    from qerl_lib.schema import read_metadata, read_rollouts, to_table, write_rollouts
    from qerl_lib.stages import convert_stage, init_adapter_stage, prepare_stage, reward_stage, rollout_stage

    root = tmp_path_factory.mktemp("dist")
    cfg = load_config(None, {
        "run": {"root": str(root), "steps": 2},
        "model": {"base": str(tiny_llama_dir)},
        "data": {"synthetic_train": 16, "synthetic_test": 4},
        "rollout": {"prompts_per_step": 3, "group_size": 4, "max_new_tokens": 8, "batch_size": 12},
        "optim": {"lr": 1e-2, "micro_batch_size": 2},
        "algo": {"mini_batches": 2},
    })
    layout = Layout(root)
    prepare_stage(cfg, layout)
    convert_stage(cfg, layout)
    init_adapter_stage(cfg, layout)
    rollout_stage(cfg, layout, 0)
    reward_stage(cfg, layout, 0)
    rows = read_rollouts(layout.scored(0), scored=True).to_pylist()
    for i, r in enumerate(rows):  # 12 rows -> 2 mini-batches of 3 micro-batches: uneven over 2 ranks
        r["advantage"], r["kept"] = (1.0 if i % 3 == 0 else -0.5), True
    write_rollouts(to_table(rows), layout.scored(0), read_metadata(layout.scored(0)), scored=True)
    return cfg, layout


def copy_workspace(layout, dest):
    """A copy of a workspace's inputs to the update stage (models, adapters, rewards, data) under `dest`."""
    from qerl_lib.paths import Layout

    for sub in ("models", "adapters", "rewards", "data"):
        shutil.copytree(layout.root / sub, dest / sub)
    return Layout(dest)


@pytest.fixture(scope="session")
def fault_ws(tiny_stoppy_llama_dir, tmp_path_factory) -> Path:
    """The fault tests' workspace (`tests/faultkit.py`): the tests' two-step pipeline with
    prepare, convert, init_adapter, rollout@0 and reward@0 done through `qerl stage` in this
    process. Tests work on a copy (`faultkit.copy_ws`)."""
    from faultkit import build_workspace

    return build_workspace(tiny_stoppy_llama_dir, tmp_path_factory.mktemp("fault") / "ws",
                           ("prepare", "convert", "init_adapter", "rollout@0", "reward@0"))


@pytest.fixture(scope="session")
def fault_ref(fault_ws, tmp_path_factory) -> Path:
    """`fault_ws` plus update@0 and eval@0, uninterrupted: what a resumed stage must equal."""
    from faultkit import copy_ws, stage_argv

    from qerl_lib.cli import main

    ref = copy_ws(fault_ws, tmp_path_factory.mktemp("fault_ref") / "ws")
    for label in ("update@0", "eval@0"):
        assert main(stage_argv(ref, label)) == 0, label
    return ref
