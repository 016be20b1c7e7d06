"""Checks a command makes before a stage starts, so that a run that cannot work is refused with
one line (`ConfigError`, exit 2) instead of failing half-way or spinning:

- `check_device`: `model.device` names a device this machine has (cuda on a CPU-only machine,
  or cuda:3 on a one-GPU machine, is refused);
- `check_backend`: `rollout.backend=vllm` needs vLLM importable here, unless the workspace's
  rollout server (`qerl serve`) does the sampling;
- `check_prompt_lengths`: the prompt-length rule (below) for the split a rollout or eval reads.

The prompt-length rule: a prompt is refused when its token count (the exact text the stage feeds
the model: chat template applied) plus the completion cap (`rollout.max_new_tokens`, or
`eval.max_new_tokens`) exceeds the model's context (`max_position_embeddings` of the converted
checkpoint's config.json). Prompts are never truncated silently: a cut question is another
question. The stage is refused before it samples anything, with the count of such prompts, the
first one's row and the longest one's length. The check needs the tokenizer, which exists only
after `convert`, so it runs at the start of every rollout and eval (not at prepare).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from qerl_lib.config import ConfigError, QerlConfig
from qerl_lib.paths import Layout

_CHECKED: dict[tuple, None] = {}
"""Splits already checked by this process: (file, size, mtime, cap, checkpoint) -> None."""


def check_device(device: str) -> None:
    """Refuse `model.device` when this machine lacks it (`auto` always works)."""
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"model.device={device}: no CUDA device is available on this machine "
                          "(torch.cuda.is_available() is False); use model.device=auto or cpu")
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise ConfigError(f"model.device={device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def check_backend(cfg: QerlConfig, layout: Layout) -> None:
    """Refuse `rollout.backend=vllm` where vLLM is not installed and no rollout server runs."""
    if cfg.rollout.backend != "vllm" or importlib.util.find_spec("vllm") is not None:
        return
    from qerl_lib.rollout.service import find_server

    if find_server(layout.root) is None:
        raise ConfigError("rollout.backend=vllm: vLLM is not installed here (pip install vllm, on a CUDA machine) "
                          "and no rollout server runs for this workspace; use rollout.backend=transformers")


def context_length(checkpoint: Path) -> int | None:
    """`max_position_embeddings` of a checkpoint's config.json (None when it does not say)."""
    from qerl_lib.io import read_json

    cfg = read_json(Path(checkpoint) / "config.json")
    if not isinstance(cfg, dict):
        raise ValueError(f"{Path(checkpoint) / 'config.json'}: not a JSON object")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    value = text.get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


def check_prompt_lengths(cfg: QerlConfig, layout: Layout, split: str, max_new_tokens: int, field: str,
                         max_rows: int | None = None) -> None:
    """Apply the prompt-length rule (module docstring) to the prompts of `split` (the first
    `max_rows` of them, when given: what an eval reads); `field` is the config key of the
    completion cap, for the message. A no-op before convert has run."""
    from qerl_lib.data import load_prepared

    checkpoint = layout.checkpoint(cfg.model.quant)
    path = layout.prepared(split)
    if not (checkpoint / "config.json").is_file() or not path.is_file():
        return  # the stage itself says what is missing
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, max_new_tokens, str(checkpoint.resolve()),
           cfg.model.chat_template, max_rows, cfg.data.prompt, cfg.rollout.backend, cfg.rollout.vllm_max_model_len)
    if key in _CHECKED:
        return
    limit, limit_name = context_length(checkpoint), "max_position_embeddings"
    cap = cfg.rollout.vllm_max_model_len if cfg.rollout.backend == "vllm" else None
    if cap is not None and (limit is None or cap < limit):
        limit, limit_name = cap, "rollout.vllm_max_model_len"
    if limit is None:
        return
    from qerl_lib.model import load_tokenizer
    from qerl_lib.rewards import format_row

    tok = load_tokenizer(checkpoint)
    rows = load_prepared(path)[:max_rows]
    too_long = []
    for i, row in enumerate(rows):
        text = format_row(tok, row, cfg.data.prompt, cfg.model.chat_template)
        # A token spans at least one byte of text (byte-level BPE, SentencePiece with byte
        # fallback; 8 spare for a tokenizer's added prefix): a prompt short in bytes fits without
        # being tokenized, so a large data set costs only its few long prompts.
        if len(text.encode()) + 8 + max_new_tokens <= limit:
            continue
        n = len(tok(text, add_special_tokens=False)["input_ids"])
        if n + max_new_tokens > limit:
            too_long.append((i, n))
    if too_long:
        first, longest = too_long[0], max(too_long, key=lambda t: t[1])
        raise ConfigError(
            f"{path}: {len(too_long)} of {len(rows)} prompt(s) do not fit the model's context: prompt tokens + "
            f"{field} ({max_new_tokens}) > {limit_name} ({limit}); first: row {first[0]} "
            f"({first[1]} tokens), longest: row {longest[0]} ({longest[1]} tokens). Shorten or drop them in the "
            f"source (data.source) or lower {field}"
        )
    _CHECKED[key] = None


def check_stage(cfg: QerlConfig, layout: Layout, name: str) -> None:
    """Every check that applies to stage `name` before it runs."""
    if name in ("init_adapter", "rollout", "update", "eval"):
        check_device(cfg.model.device)
    if name in ("rollout", "eval"):
        check_backend(cfg, layout)
    if name == "rollout":
        check_prompt_lengths(cfg, layout, "train", cfg.rollout.max_new_tokens, "rollout.max_new_tokens")
    elif name == "eval":
        check_prompt_lengths(cfg, layout, "test", cfg.eval.max_new_tokens, "eval.max_new_tokens", cfg.eval.max_prompts)
