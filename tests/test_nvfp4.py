"""qerl_lib.nvfp4 against llm-compressor / compressed-tensors, bit for bit."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor, pack_fp4_to_uint8, unpack_fp4_from_uint8
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import dequantize
from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4
from safetensors.torch import load_file

from qerl_lib.nvfp4 import (
    E2M1_VALUES,
    FUSED_PROJECTIONS,
    dequantize_nvfp4,
    fp4_codes,
    nvfp4_global_scale,
    pack_fp4_codes,
    quantize_nvfp4,
    unpack_fp4_codes,
)

SCHEME = preset_name_to_scheme("NVFP4A16", ["Linear"])


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a tensor (so -0.0 != 0.0 and NaNs compare)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    diff = (bits(a) != bits(b)).nonzero()
    assert diff.numel() == 0, f"{len(diff)} elements differ, first at {diff[0].tolist()}: {a[tuple(diff[0])]} vs {b[tuple(diff[0])]}"


def ct_quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """What llm-compressor does to one (unfused) weight: memoryless min-max observer ->
    qparams (global scale, FP8 block scales) -> NVFP4PackedCompressor.compress."""
    from llmcompressor.observers import Observer

    observer = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=SCHEME.weights.model_copy())
    observer(weight)
    qparams = observer.get_qparams()
    state = {
        "weight": weight,
        # llm-compressor copies the scale into the module's weight_scale parameter, which has the weight's dtype
        "weight_scale": qparams["scale"].to(weight.dtype),
        "weight_global_scale": qparams["global_scale"],
    }
    return NVFP4PackedCompressor.compress(state, SCHEME)


def ct_dequantize(packed, scale, global_scale, dtype):
    """compressed-tensors' dequantization: `decompress` (bf16) or the `dequantize(dtype=...)` path."""
    if dtype == torch.bfloat16:
        state = {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": global_scale}
        return NVFP4PackedCompressor.decompress(state, SCHEME)["weight"]
    m, half = packed.shape
    unpacked = unpack_fp4_from_uint8(packed, m, 2 * half, dtype=dtype)
    return dequantize(unpacked, scale.to(dtype), args=SCHEME.weights, global_scale=global_scale, dtype=dtype)


def _mixed(g: torch.Generator) -> torch.Tensor:
    """Blocks whose magnitudes span 1e-6 .. 10, plus an all-zero row and an all-zero block."""
    w = torch.randn(32, 64, generator=g)
    exps = torch.empty(32, 4).uniform_(-6, 1, generator=g)
    w = (w.unflatten(1, (4, 16)) * (10.0 ** exps).unsqueeze(-1)).flatten(1)
    w[3] = 0
    w[5, 16:32] = 0
    return w


def _saturating(g: torch.Generator) -> torch.Tensor:
    """Every block holds its +-amax (maps to +-6 * scale), values just below 5 and 6 scale
    units, ties, and tiny negatives that round to -0 (sign bit kept) and a -0.0."""
    w = (torch.randn(16, 64, generator=g) * 0.005).clamp(-0.04, 0.04)
    w[:, ::16] = 0.05
    w[:, 1::16] = -0.05
    w[:, 2::16] = 0.05 * 5.0 / 6.0  # at the 4 / 6 tie, up to the rounding of the FP8 scale
    w[:, 3::16] = -1e-9
    w[:, 4::16] = -0.0
    w[0] = torch.linspace(-0.05, 0.05, 64)
    return w


CASES = {
    "normal": lambda g: torch.randn(48, 64, generator=g) * 0.02,
    "zeros": lambda g: torch.zeros(16, 32),
    "zero_rows": lambda g: torch.randn(16, 32, generator=g) * torch.tensor([0.0, 1.0]).repeat(8).unsqueeze(1),
    "saturating": _saturating,
    "tiny_1e-8": lambda g: torch.randn(16, 64, generator=g) * 1e-8,
    "subnormal_amax": lambda g: torch.randn(16, 32, generator=g) * 1e-39,  # global scale overflows -> 1.0
    "mixed": _mixed,
    "huge": lambda g: torch.randn(16, 32, generator=g) * 1e4,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_quantize_matches_llmcompressor(case, dtype):
    if dtype == torch.float16 and case in ("tiny_1e-8", "subnormal_amax", "huge"):
        pytest.skip("outside float16's range")
    weight = CASES[case](torch.Generator().manual_seed(0)).to(dtype)
    ref = ct_quantize(weight)
    packed, scale, global_scale = quantize_nvfp4(weight)
    assert packed.dtype == torch.uint8 and packed.shape == (weight.shape[0], weight.shape[1] // 2)
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (weight.shape[0], weight.shape[1] // 16)
    assert global_scale.dtype == torch.float32 and global_scale.shape == (1,)
    assert_bits_equal(global_scale, ref["weight_global_scale"])
    assert_bits_equal(scale, ref["weight_scale"])
    assert_bits_equal(packed, ref["weight_packed"])
    for out_dtype in (torch.bfloat16, torch.float32, torch.float16):
        assert_bits_equal(dequantize_nvfp4(packed, scale, global_scale, out_dtype), ct_dequantize(packed, scale, global_scale, out_dtype))


def test_global_scale_is_computed_in_weight_dtype():
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    gs = nvfp4_global_scale(w)
    assert gs.to(torch.bfloat16).to(torch.float32).item() == gs.item()  # a bfloat16 number
    assert gs.item() == pytest.approx(448 * 6 / w.float().abs().max().item(), rel=1e-2)
    # fused: the group's amax decides, for each member
    big = w * 4
    assert nvfp4_global_scale(w, big).item() == nvfp4_global_scale(big).item()


def test_fp4_rounding_edges_match_cast_to_fp4():
    edges = torch.tensor([0.0, 0.25, 0.2500001, 0.5, 0.75, 0.7499999, 1.0, 1.25, 1.2500001, 1.5, 1.75, 2.0, 2.5, 2.5000002,
                          3.0, 3.5, 3.4999998, 4.0, 5.0, 5.0000005, 6.0, 7.0, 1e30, float("inf"), 1e-30])
    x = torch.cat([edges, -edges, torch.tensor([-0.0, 0.1])])  # even length, for the packer
    clamped = torch.clamp(x, -6.0, 6.0)
    expected = unpack_fp4_codes(pack_fp4_to_uint8(cast_to_fp4(clamped.clone()).reshape(1, -1)))
    assert torch.equal(fp4_codes(x).reshape(1, -1), expected)


def test_pack_unpack_layout_matches_compressed_tensors():
    codes = torch.arange(16, dtype=torch.uint8).repeat(4, 2)  # [4, 32], every code
    values = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES])[codes.long()]
    packed = pack_fp4_codes(codes)
    assert torch.equal(packed, pack_fp4_to_uint8(values))
    assert torch.equal(packed[0, 0], torch.tensor(0x10, dtype=torch.uint8))  # low nibble = even column
    assert torch.equal(unpack_fp4_codes(packed), codes)
    assert_bits_equal(unpack_fp4_from_uint8(packed, 4, 32, dtype=torch.float32), values.where(codes != 8, torch.tensor(-0.0)))


def test_tiny_negatives_keep_the_sign_bit():
    """A negative weight that rounds to zero is stored as code 8 (-0), a -0.0 weight as 0."""
    codes = unpack_fp4_codes(quantize_nvfp4(_saturating(torch.Generator().manual_seed(0)))[0])
    assert (codes[1:, 3::16] == 8).all() and (codes[1:, 4::16] == 0).all()
    assert (codes[1:, ::16] == 7).all() and (codes[1:, 1::16] == 15).all()  # +-amax -> +-6


def test_nan_is_rejected():
    w = torch.zeros(4, 16)
    w[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize_nvfp4(w)


def _quantized_modules(tensors):
    return sorted(k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed"))


def _fused_group(name: str) -> list[str]:
    parent, _, leaf = name.rpartition(".")
    for group in FUSED_PROJECTIONS:
        if leaf in group:
            return [f"{parent}.{member}" for member in group]
    return [name]


@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_llmcompressor_checkpoint_round_trip(model, request):
    dense_dir = request.getfixturevalue(f"tiny_{model}_dir")
    nvfp4_dir = request.getfixturevalue(f"tiny_{model}_nvfp4_dir")
    dense = load_file(str(dense_dir / "model.safetensors"))
    quant = load_file(str(nvfp4_dir / "model.safetensors"))
    names = _quantized_modules(quant)
    assert len(names) == 14 and not any("lm_head" in n for n in names)
    for name in names:
        weight = dense[f"{name}.weight"]
        assert weight.dtype == torch.bfloat16
        packed, scale, gscale = (quant[f"{name}.{s}"] for s in ("weight_packed", "weight_scale", "weight_global_scale"))
        # llm-compressor's output == our quantizer with the fused group's global scale
        group_scale = nvfp4_global_scale(*(dense[f"{member}.weight"] for member in _fused_group(name)))
        ours = quantize_nvfp4(weight, group_scale)
        for a, b in zip(ours, (packed, scale, gscale)):
            assert_bits_equal(a, b)
        # our dequantization of the file == compressed-tensors' decompression of the file
        for dtype in (torch.bfloat16, torch.float32):
            assert_bits_equal(dequantize_nvfp4(packed, scale, gscale, dtype), ct_dequantize(packed, scale, gscale, dtype))
        # ... and is close to the original: error <= one FP4 step at the block's top (2 units of
        # block_amax / 6, halved by rounding), with slack for the FP8 rounding of the scale
        deq = dequantize_nvfp4(packed, scale, gscale, torch.float32)
        block_amax = weight.float().abs().unflatten(1, (-1, 16)).amax(-1, keepdim=True)
        err = (deq - weight.float()).abs().unflatten(1, (-1, 16))
        assert (err <= block_amax / 6 * 1.07 + 1e-12).all(), name
        assert (deq - weight.float()).norm() / weight.float().norm() < 0.12


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_transformers_decompression_equals_ours(tiny_qwen2_nvfp4_dir):
    """compressed-tensors' whole-model decompression (transformers' run_compressed=False)
    produces the same bfloat16 weights as dequantize_nvfp4 on the file's tensors."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        tiny_qwen2_nvfp4_dir, dtype=torch.bfloat16, quantization_config=CompressedTensorsConfig(run_compressed=False)
    )
    quant = load_file(str(tiny_qwen2_nvfp4_dir / "model.safetensors"))
    for name in _quantized_modules(quant):
        ours = dequantize_nvfp4(*(quant[f"{name}.{s}"] for s in ("weight_packed", "weight_scale", "weight_global_scale")), torch.bfloat16)
        assert_bits_equal(ours, model.get_submodule(name).weight.data)
