"""PEFT LoRA on a frozen base, NVFP4 or dense, saved as standard PEFT adapters.

`apply_lora` wraps q/k/v/o/gate/up/down (by default) in PEFT LoRA layers. Dense
`nn.Linear` targets use PEFT's own `lora.Linear`; `NVFP4Linear` targets use
`NVFP4LoraLinear`, registered through PEFT's custom-module hook
(`LoraConfig._register_custom_module`), which runs the packed base forward and adds
`B(A(dropout(x))) * alpha / r` exactly like PEFT does for a dense layer. Adapters are
float32 (PEFT's `autocast_adapter_dtype`) whatever the base dtype.

Initialisation is a pure function of (`init_seed`, module name): A ~ U(-1/sqrt(in),
1/sqrt(in)) (the distribution of PEFT's default kaiming_uniform(a=sqrt(5))), B = 0, so step
0 equals the base model.

Adapters are written with PEFT's `save_pretrained` (adapter_config.json +
adapter_model.safetensors, keys `base_model.model.<module>.lora_{A,B}.weight`), which both
vLLM and `PeftModel.from_pretrained` on a dense copy of the base load. Trained RMSNorm
weights (`train_norms`) are not part of a PEFT LoRA adapter; they go to
`norms.safetensors` beside it, keyed by the base model's parameter names (a consumer such
as vLLM must apply them separately).
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import torch
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from torch import nn

from qerl_lib.config import LoraConfig
from qerl_lib.hashing import adapter_hash  # noqa: F401  (re-exported)
from qerl_lib.tensor_files import NonFiniteAdapter, read_safetensors  # noqa: F401  (re-exported)
from qerl_lib.io import atomic_dir
from qerl_lib.paths import ADAPTER_WEIGHTS
from qerl_lib.nvfp4_linear import NVFP4Linear
from qerl_lib.seeds import generator

ADAPTER_NAME = "default"
ADAPTER_CONFIG = "adapter_config.json"
NORMS_FILE = "norms.safetensors"


class NVFP4LoraLinear(PeftLoraLinear):
    """PEFT LoRA layer around a frozen `NVFP4Linear`.

    forward(x [..., in]) = base(x) + lora_B(lora_A(dropout(x))) * scaling, inherited from
    PEFT's `lora.Linear` (only the base call differs, and it is the base module's own).
    Merging is refused: it would have to re-quantize the base to 4 bits, which changes
    the model; keep the adapter separate (vLLM applies it unmerged too).
    """

    def __init__(self, base_layer: nn.Module, adapter_name: str, config, **kwargs) -> None:
        if getattr(config, "use_dora", False):
            raise ValueError("DoRA needs a dense base weight; it is not supported on NVFP4Linear")
        super().__init__(base_layer, adapter_name, config=config, **kwargs)

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        raise NotImplementedError("cannot merge LoRA into a packed NVFP4 base (it would re-quantize it)")

    def unmerge(self) -> None:
        raise NotImplementedError("an NVFP4 base never holds a merged adapter")


def _lora_layers(peft_model: nn.Module):
    """(name relative to the transformers model, LoRA layer) for every LoRA-wrapped module."""
    from peft.tuners.lora import LoraLayer

    for name, module in peft_model.get_base_model().named_modules():
        if isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A:
            yield name, module


def _norm_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Weights of every RMSNorm / LayerNorm of the transformers model, by parameter name."""
    out = {}
    for name, module in model.named_modules():
        if type(module).__name__.endswith("RMSNorm") or isinstance(module, nn.LayerNorm):
            weight = getattr(module, "weight", None)
            if isinstance(weight, nn.Parameter):
                out[f"{name}.weight" if name else "weight"] = weight
    return out


@torch.no_grad()
def init_lora_weights(peft_model: nn.Module, seed: int) -> None:
    """Re-draw every A from (seed, module name) and zero every B, in place.

    A [r, in] ~ U(-1/sqrt(in), 1/sqrt(in)) drawn on the CPU in float32 from a generator
    seeded by `qerl_lib.seeds.generator(seed, "lora_A", name)`, so the draw does not
    depend on module order, device or the global RNG.
    """
    for name, layer in _lora_layers(peft_model):
        a = layer.lora_A[ADAPTER_NAME].weight
        bound = 1.0 / math.sqrt(a.shape[1])
        draw = torch.rand(a.shape, generator=generator(seed, "lora_A", name), dtype=torch.float32)
        a.copy_((draw * 2 - 1) * bound)
        layer.lora_B[ADAPTER_NAME].weight.zero_()


def apply_lora(model: nn.Module, cfg: LoraConfig):
    """Wrap `cfg.target_modules` of a frozen causal LM (NVFP4 or dense) with LoRA; return the PeftModel.

    Only the LoRA A/B matrices require grad, plus the RMSNorm weights when
    `cfg.train_norms`. A is seeded from `cfg.init_seed`, B = 0.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_cfg = PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_cfg._register_custom_module({NVFP4Linear: NVFP4LoraLinear})
    for p in model.parameters():
        p.requires_grad_(False)
    with warnings.catch_warnings():
        # PEFT warns for every layer type it does not know, even when a custom module handles it
        warnings.filterwarnings("ignore", message="Unsupported layer type .*NVFP4Linear")
        peft_model = get_peft_model(model, peft_cfg, adapter_name=ADAPTER_NAME)
    init_lora_weights(peft_model, cfg.init_seed)
    for name, p in peft_model.named_parameters():
        p.requires_grad_("lora_A" in name or "lora_B" in name)
    if cfg.train_norms:
        for p in _norm_parameters(peft_model.get_base_model()).values():
            p.requires_grad_(True)
    return peft_model


def trainable_parameters(peft_model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters that require grad, by name (what the optimizer should get)."""
    return {name: p for name, p in peft_model.named_parameters() if p.requires_grad}


def save_adapter(peft_model, out_dir: str | Path, base_model_name_or_path: str | None = None) -> Path:
    """Write a standard PEFT adapter to `out_dir` atomically (`write_adapter_files` into a
    temporary directory swapped in whole); return its path."""
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        write_adapter_files(peft_model, tmp, base_model_name_or_path)
    return out_dir


def write_adapter_files(peft_model, out_dir: str | Path, base_model_name_or_path: str | None = None) -> Path:
    """Write the adapter's files into the existing directory `out_dir`, in place.

    For a caller that builds the adapter directory itself inside `qerl_lib.io.atomic_dir` (the
    stages add optimizer and trainer state beside it): no second atomic directory is opened
    inside the caller's, so a kill leaves only the caller's one temporary directory.

    Files: adapter_config.json (explicit, sorted `target_modules`;
    `base_model_name_or_path` = the argument, else the loaded checkpoint's directory),
    adapter_model.safetensors (float32 lora_A/lora_B of the "default" adapter), and
    norms.safetensors with the RMSNorm weights when they are trainable.

    Raises `NonFiniteAdapter` (a ValueError) before writing anything when a LoRA or norm
    weight holds NaN or infinity: such an adapter would only fail later, in the next rollout.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    config = peft_model.peft_config[ADAPTER_NAME]
    base = base_model_name_or_path or config.base_model_name_or_path or getattr(peft_model.get_base_model(), "name_or_path", None)
    norms = {k: p for k, p in _norm_parameters(peft_model.get_base_model()).items() if p.requires_grad}
    bad = [name for name, p in peft_model.named_parameters()
           if ("lora_A" in name or "lora_B" in name or p.requires_grad) and not bool(torch.isfinite(p).all())]
    if bad:
        raise NonFiniteAdapter(f"{out_dir}: not written: the adapter holds NaN or infinite weights "
                               f"({len(bad)} tensor(s), first {bad[0]})")
    peft_model.save_pretrained(str(out_dir), selected_adapters=[ADAPTER_NAME])
    cfg_path = out_dir / ADAPTER_CONFIG
    cfg_json = json.loads(cfg_path.read_text())
    cfg_json["base_model_name_or_path"] = str(base) if base is not None else None
    cfg_json["target_modules"] = sorted(config.target_modules)
    cfg_path.write_text(json.dumps(cfg_json, indent=2, sort_keys=True, default=str) + "\n")
    if norms:
        save_file({k: p.detach().contiguous().cpu() for k, p in norms.items()}, str(out_dir / NORMS_FILE))
    return out_dir


def _check_compatible(peft_model, adapter_dir: Path) -> None:
    """Raise if the adapter on disk has another rank, alpha or target set than the live one."""
    from qerl_lib.io import read_json

    on_disk = read_json(adapter_dir / ADAPTER_CONFIG)
    if not isinstance(on_disk, dict):
        raise ValueError(f"{adapter_dir / ADAPTER_CONFIG}: not a JSON object")
    live = peft_model.peft_config[ADAPTER_NAME]
    for key, live_value in (("r", live.r), ("lora_alpha", live.lora_alpha)):
        if on_disk.get(key) != live_value:
            raise ValueError(f"{adapter_dir / ADAPTER_CONFIG}: {key}={on_disk.get(key)} but the model has {live_value}")
    disk_targets = on_disk.get("target_modules")
    disk_targets = set([disk_targets] if isinstance(disk_targets, str) else disk_targets or [])
    if disk_targets != set(live.target_modules):
        raise ValueError(
            f"{adapter_dir / ADAPTER_CONFIG}: target_modules {sorted(disk_targets)} but the model has {sorted(live.target_modules)}"
        )


@torch.no_grad()
def load_adapter_weights(peft_model, adapter_dir: str | Path) -> None:
    """Load a saved adapter into `peft_model` in place (same Parameter objects, so optimizer
    state stays attached); also loads norms.safetensors when present. Raises if rank,
    alpha or targets differ, or if any LoRA tensor is missing or unexpected."""
    from peft.utils import set_peft_model_state_dict

    adapter_dir = Path(adapter_dir)
    weights_path = adapter_dir / ADAPTER_WEIGHTS
    if not weights_path.is_file():
        raise FileNotFoundError(f"missing file: {weights_path}")
    _check_compatible(peft_model, adapter_dir)
    state = read_safetensors(weights_path)
    result = set_peft_model_state_dict(peft_model, state, adapter_name=ADAPTER_NAME)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"{weights_path}: missing LoRA tensors {missing[:3]}, unexpected {list(result.unexpected_keys)[:3]}")
    norms_path = adapter_dir / NORMS_FILE
    if norms_path.is_file():
        params = _norm_parameters(peft_model.get_base_model())
        for key, tensor in read_safetensors(norms_path).items():
            if key not in params:
                raise ValueError(f"{norms_path}: tensor {key} is not a norm weight of the model")
            if params[key].shape != tensor.shape:
                raise ValueError(f"{norms_path}: tensor {key} has shape {tuple(tensor.shape)}, expected {tuple(params[key].shape)}")
            params[key].copy_(tensor)


def load_adapter(model: nn.Module, adapter_dir: str | Path):
    """A PeftModel of `model` (NVFP4 or dense) carrying the adapter saved in `adapter_dir`.

    Unlike `PeftModel.from_pretrained`, this knows the NVFP4 LoRA layer: it rebuilds the
    LoRA config from adapter_config.json (norms trainable iff norms.safetensors exists),
    applies it, then loads the weights (and norms). Use it for evaluation of a saved step.
    """
    adapter_dir = Path(adapter_dir)
    saved = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    targets = saved["target_modules"]
    cfg = LoraConfig(
        r=saved["r"],
        alpha=saved["lora_alpha"],
        dropout=saved.get("lora_dropout", 0.0),
        target_modules=[targets] if isinstance(targets, str) else sorted(targets),
        train_norms=(adapter_dir / NORMS_FILE).is_file(),
    )
    peft_model = apply_lora(model, cfg)
    load_adapter_weights(peft_model, adapter_dir)
    return peft_model
