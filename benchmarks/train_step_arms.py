"""Arm names of `benchmarks/train_step.py --mode step` and the ratios of its summary (no GPU needed)."""

from __future__ import annotations

import argparse

VARIANTS = ("", ":full", ":offload")
"""Arm suffixes: none = the trainer's path (chunked log-probs); ':full' = log-probs from the full
logits; ':offload' = chunked, with the checkpointed layer inputs in pinned host memory
(`optim.offload_activations`). Any of them may be followed by ':mlpchunk[N]' (`split_mlp_chunk`)."""
ARM_NAMES = ("nvfp4-triton", "nvfp4-torch", "nvfp4-auto", "nvfp4-dq", "bf16", "nf4")
MLP_CHUNK = ":mlpchunk"


def split_mlp_chunk(arm: str, default: int = 0) -> tuple[str, int]:
    """'bf16:offload:mlpchunk1152' -> ('bf16:offload', 1152); 'bf16' -> ('bf16', 0); a bare
    ':mlpchunk' -> `default` tokens per chunk."""
    base, sep, n = arm.partition(MLP_CHUNK)
    if not sep:
        return arm, 0
    return base, int(n) if n else default


def arm_parts(arm: str) -> tuple[str, str | None, str]:
    """'nvfp4-triton:full' -> ('nvfp4', 'triton', 'full'); 'bf16' -> ('bf16', None, 'chunked')
    (a ':mlpchunkN' suffix is ignored here: `split_mlp_chunk`)."""
    name, _, variant = split_mlp_chunk(arm)[0].partition(":")
    quant, _, backend = name.partition("-")
    return quant, backend or None, variant or "chunked"


def arm_name(text: str) -> str:
    """argparse type of --arms: ARM[:full|:offload][:mlpchunk[N]], N >= 1."""
    base, sep, n = text.partition(MLP_CHUNK)
    if base not in [a + v for a in ARM_NAMES for v in VARIANTS] or (sep and n and not (n.isdigit() and int(n) > 0)):
        raise argparse.ArgumentTypeError(f"{text!r}: expected ARM[:full|:offload][{MLP_CHUNK}[N]] with ARM one of "
                                         f"{', '.join(ARM_NAMES)} and N a positive token count")
    return text


def step_summary(arms: dict, micro_batches) -> dict:
    """{micro-batch: {arm: {ms, peak_gib, ratios}}} from the per-arm results of `mode_step`.

    time_vs_bf16 / peak_vs_bf16: against `bf16` with the same suffixes (log-prob path, offload, MLP
    chunks: like for like). ':mlpchunkN' arms also get peak_vs_unchunked_mlp, time_vs_unchunked_mlp and
    peak_saved_gib (against the same arm without the chunks) and peak_vs_bf16_unchunked_mlp (against
    BF16 without the chunks: not like for like, for reference).
    """
    summary = {}
    for mb in map(str, micro_batches):
        row = {}
        for arm, res in arms.items():
            r = res.get("micro_batch", {}).get(mb, {})
            if "ms_median" in r:
                row[arm] = {"ms": round(r["ms_median"], 1), "peak_gib": r["peak_gib"]}
        for arm, r in row.items():
            variant = arm_parts(arm)[2]
            unchunked, mlp_chunk = split_mlp_chunk(arm)
            suffix = ("" if variant == "chunked" else ":" + variant) + (f"{MLP_CHUNK}{mlp_chunk}" if mlp_chunk else "")
            bf = row.get("bf16" + suffix)  # against BF16 on the same log-prob, offload and MLP-chunk path
            if bf:
                r["time_vs_bf16"] = round(r["ms"] / bf["ms"], 3)
                r["peak_vs_bf16"] = round(r["peak_gib"] / bf["peak_gib"], 3)
            plain = row.get(unchunked) if mlp_chunk else None
            if plain:  # what the chunks change in this arm itself
                r["peak_vs_unchunked_mlp"] = round(r["peak_gib"] / plain["peak_gib"], 3)
                r["time_vs_unchunked_mlp"] = round(r["ms"] / plain["ms"], 3)
                r["peak_saved_gib"] = round(plain["peak_gib"] - r["peak_gib"], 2)
            bf_plain = row.get("bf16" + suffix.partition(MLP_CHUNK)[0]) if mlp_chunk else None
            if bf_plain:  # not like for like (BF16 could chunk its MLP too): for reference only
                r["peak_vs_bf16_unchunked_mlp"] = round(r["peak_gib"] / bf_plain["peak_gib"], 3)
            torch_arm = "nvfp4-torch" + suffix
            if arm.startswith("nvfp4-triton") and torch_arm in row:
                r["speedup_vs_torch_dequant"] = round(row[torch_arm]["ms"] / r["ms"], 3)
            full = row.get(arm + ":full")
            if full:
                r["peak_vs_full_logits"] = round(r["peak_gib"] / full["peak_gib"], 3)
                r["time_vs_full_logits"] = round(r["ms"] / full["ms"], 3)
        summary[mb] = row
    return summary
