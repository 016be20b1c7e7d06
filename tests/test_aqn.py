"""AQN: schedule values against the paper formula, targets by name, reproducible in-place noise."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from qerl_lib.aqn import (
    NoiseInjector,
    aqn_norms,
    fingerprint,
    noise_vector,
    noised,
    norm_key,
    sigma_at,
    stage_of,
)
from qerl_lib.config import AQNConfig

S, E = 1e-2, 5e-4


def cfg(**kw):
    """An enabled schedule (AQN is off in the code defaults: the embedded default runs without it)."""
    return AQNConfig(**{"enabled": True, "sigma_start": S, "sigma_end": E, **kw})


# --------------------------------------------------------------------------- schedule


def test_stage_of():
    assert [stage_of(i, 8, 4) for i in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [stage_of(i, 10, 4) for i in range(10)] == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]
    assert stage_of(12, 10, 4) == 3  # past the end stays in the last stage
    assert [stage_of(i, 3, 4) for i in range(3)] == [0, 1, 2]  # fewer steps than stages


def test_paper_schedule_k4():
    c = cfg(stages=4)
    got = [sigma_at(i, 8, c) for i in range(8)]
    # stage 0 = 0; stage k: S * (E/S)^((k-1)/3)
    want = [0, 0, S, S, S * (E / S) ** (1 / 3), S * (E / S) ** (1 / 3), S * (E / S) ** (2 / 3), S * (E / S) ** (2 / 3)]
    assert got == pytest.approx(want, rel=1e-12)
    # written out: (0.05)^(1/3) = 0.3684031499, (0.05)^(2/3) = 0.1357208808
    assert got[4] == pytest.approx(3.684031499e-3, rel=1e-9)
    assert got[6] == pytest.approx(1.357208808e-3, rel=1e-9)
    assert got[0] == 0.0 and got[-1] > E  # the paper's formula never reaches sigma_end


def test_paper_schedule_k5():
    c = cfg(stages=5)
    got = [sigma_at(k * 2, 10, c) for k in range(5)]  # one step per stage start
    want = [0.0] + [S * (E / S) ** ((k - 1) / 4) for k in range(1, 5)]
    assert got == pytest.approx(want, rel=1e-12)
    assert got[2] == pytest.approx(1e-2 * 0.05**0.25, rel=1e-12)  # 4.7287e-3
    assert got[2] == pytest.approx(4.728708045e-3, rel=1e-9)


def test_reach_end_variant():
    c = cfg(stages=4, reach_end=True)
    got = [sigma_at(i, 8, c) for i in range(0, 8, 2)]
    assert got == pytest.approx([0.0, S, S * (E / S) ** 0.5, E], rel=1e-12)
    assert sigma_at(7, 8, c) == pytest.approx(E, rel=1e-12)
    c5 = cfg(stages=5, reach_end=True)
    assert sigma_at(9, 10, c5) == pytest.approx(E, rel=1e-12)
    # K = 2: one noisy stage, which is sigma_start under both variants
    for reach in (False, True):
        c2 = cfg(stages=2, reach_end=reach)
        assert [sigma_at(i, 4, c2) for i in range(4)] == [0.0, 0.0, S, S]


def test_other_schedules():
    f = [0.0, 1 / 3, 2 / 3]  # K = 4, paper fractions for stages 1..3
    lin = [sigma_at(i, 4, cfg(stages=4, schedule="linear")) for i in (1, 2, 3)]
    assert lin == pytest.approx([S + (E - S) * x for x in f], rel=1e-12)
    cos = [sigma_at(i, 4, cfg(stages=4, schedule="cosine")) for i in (1, 2, 3)]
    assert cos == pytest.approx([E + (S - E) * (1 + math.cos(math.pi * x)) / 2 for x in f], rel=1e-12)
    lg = [sigma_at(i, 4, cfg(stages=4, schedule="log")) for i in (1, 2, 3)]
    assert lg == pytest.approx([S + (E - S) * math.log10(1 + 9 * x) for x in f], rel=1e-12)
    for sched in ("linear", "cosine", "log", "exponential"):
        vals = [sigma_at(i, 4, cfg(stages=4, schedule=sched, reach_end=True)) for i in (1, 2, 3)]
        assert vals[0] == pytest.approx(S) and vals[-1] == pytest.approx(E)
        assert vals[0] > vals[1] > vals[2]


def test_disabled_is_zero():
    c = cfg(enabled=False)
    assert all(sigma_at(i, 8, c) == 0.0 for i in range(8))


# --------------------------------------------------------------------------- targets


def test_norm_key():
    assert norm_key("model.layers.3.input_layernorm") == "layers.3.input_layernorm"
    assert norm_key("base_model.model.model.layers.12.post_attention_layernorm") == "layers.12.post_attention_layernorm"
    assert norm_key("layers.0.input_layernorm") == "layers.0.input_layernorm"
    assert norm_key("model.language_model.layers.1.input_layernorm") == "layers.1.input_layernorm"
    for other in ("model.norm", "model.layers.3.self_attn.q_proj", "model.layers.3.input_layernorm.weight",
                  "model.layers.3", "model.mylayers.3.input_layernorm", "model.layers.x.input_layernorm"):
        assert norm_key(other) is None, other


class CustomNorm(nn.Module):
    """Stands in for vLLM's RMSNorm: not a transformers class."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Layer(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.input_layernorm = CustomNorm(hidden)
        self.post_attention_layernorm = CustomNorm(hidden)
        self.proj = nn.Linear(hidden, hidden)


class Custom(nn.Module):
    def __init__(self, hidden=16, layers=11):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([Layer(hidden) for _ in range(layers)])
        self.model.norm = CustomNorm(hidden)


def tiny_llama(dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).to(dtype).eval()


def test_aqn_norms_custom_module_sorted():
    m = Custom()
    keys = [k for k, _ in aqn_norms(m)]
    assert len(keys) == 22 and "layers.10.input_layernorm" in keys
    assert keys[:3] == ["layers.0.input_layernorm", "layers.0.post_attention_layernorm", "layers.1.input_layernorm"]
    assert keys[-1] == "layers.10.post_attention_layernorm"  # numeric, not string, order
    assert all(isinstance(mod, CustomNorm) for _, mod in aqn_norms(m))


def test_aqn_norms_transformers_llama_and_peft():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    model = tiny_llama()
    norms = aqn_norms(model)
    assert [k for k, _ in norms] == ["layers.0.input_layernorm", "layers.0.post_attention_layernorm",
                                     "layers.1.input_layernorm", "layers.1.post_attention_layernorm"]
    assert all(isinstance(mod, LlamaRMSNorm) for _, mod in norms)
    assert all(mod is not model.model.norm for _, mod in norms)  # the final norm is not a target

    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert [k for k, _ in aqn_norms(peft_model)] == [k for k, _ in norms]


# --------------------------------------------------------------------------- noise


def test_noise_vector():
    a = noise_vector("layers.0.input_layernorm", 4096, 0.01, seed=7, step=3)
    b = noise_vector("layers.0.input_layernorm", 4096, 0.01, seed=7, step=3)
    assert a.dtype == torch.float32 and a.shape == (4096,)
    assert torch.equal(a, b)
    assert not torch.equal(a, noise_vector("layers.0.input_layernorm", 4096, 0.01, seed=7, step=4))
    assert not torch.equal(a, noise_vector("layers.0.input_layernorm", 4096, 0.01, seed=8, step=3))
    assert not torch.equal(a, noise_vector("layers.1.input_layernorm", 4096, 0.01, seed=7, step=3))
    assert a.std().item() == pytest.approx(0.01, rel=0.05)
    assert abs(a.mean().item()) < 0.01 * 4 / math.sqrt(4096)
    assert torch.equal(noise_vector("k", 8, 0.0, 1, 1), torch.zeros(8))
    # the global torch RNG plays no part
    torch.manual_seed(123)
    c = noise_vector("layers.0.input_layernorm", 4096, 0.01, seed=7, step=3)
    assert torch.equal(a, c)


def snapshot(model):
    return {k: mod.weight.detach().clone() for k, mod in aqn_norms(model)}


def test_injector_in_place_reset_exact_no_random_walk():
    m = Custom(hidden=32, layers=3)
    with torch.no_grad():
        for _, mod in aqn_norms(m):
            mod.weight.uniform_(0.5, 1.5)
    before = snapshot(m)
    params = {k: (mod.weight, mod.weight.data_ptr()) for k, mod in aqn_norms(m)}
    inj = NoiseInjector(m)

    inj.apply(0.05, seed=1, step=2)
    assert inj.state == (0.05, 1, 2)
    for k, mod in aqn_norms(m):
        assert mod.weight is params[k][0] and mod.weight.data_ptr() == params[k][1]  # same Parameter, storage
        assert torch.equal(mod.weight.detach(), before[k] + noise_vector(k, 32, 0.05, 1, 2))
    noisy = snapshot(m)

    inj.reset()
    assert inj.state is None
    for k, w in snapshot(m).items():
        assert torch.equal(w, before[k])  # bitwise

    for step in range(200):  # many cycles, including apply-over-apply without reset
        inj.apply(0.05, seed=1, step=step)
        if step % 3 == 0:
            inj.apply(0.05, seed=1, step=step + 1)
        inj.reset()
    for k, w in snapshot(m).items():
        assert torch.equal(w, before[k])

    inj.apply(0.05, seed=1, step=5)
    inj.apply(0.05, seed=1, step=2)  # replaces, never stacks
    for k, w in snapshot(m).items():
        assert torch.equal(w, noisy[k])
    inj.apply(0.0, seed=1, step=2)
    for k, w in snapshot(m).items():
        assert torch.equal(w, before[k])


def test_trainable_norms_noise_on_current_weight():
    m = Custom(hidden=8, layers=1)
    inj = NoiseInjector(m)
    (k, mod) = aqn_norms(m)[0]
    assert mod.weight.requires_grad
    with torch.no_grad():
        mod.weight.add_(0.25)  # an optimizer step on the clean weight
    current = mod.weight.detach().clone()
    inj.apply(0.1, seed=0, step=1)
    assert torch.equal(mod.weight.detach(), current + noise_vector(k, 8, 0.1, 0, 1))
    # the gradient under noise is the same as without: d/dw (w+z) x = x
    x = torch.randn(3, 8)
    (mod.weight * x).sum().backward()
    torch.testing.assert_close(mod.weight.grad, x.sum(0))
    inj.reset()
    assert torch.equal(mod.weight.detach(), current)


def test_frozen_norms_keep_first_clean_copy():
    m = Custom(hidden=8, layers=1)
    for p in m.parameters():
        p.requires_grad_(False)
    before = snapshot(m)
    inj = NoiseInjector(m)
    inj.apply(0.1, seed=0, step=1)
    inj.apply(0.1, seed=0, step=2)
    inj.reset()
    for k, w in snapshot(m).items():
        assert torch.equal(w, before[k])


def test_noised_context_always_resets_and_fingerprint():
    m = Custom(hidden=16, layers=2)
    clean_fp = fingerprint(m)
    inj = NoiseInjector(m)
    with pytest.raises(RuntimeError):
        with noised(inj, 0.01, seed=3, step=1):
            noisy_fp = fingerprint(m)
            assert noisy_fp != clean_fp and inj.fingerprint() == noisy_fp
            raise RuntimeError("boom")
    assert fingerprint(m) == clean_fp and inj.state is None
    with noised(m, 0.01, seed=3, step=1):  # from a model: same noise, same fingerprint
        assert fingerprint(m) == noisy_fp
    twin = Custom(hidden=16, layers=2)
    twin.load_state_dict(m.state_dict())
    with noised(twin, 0.01, seed=3, step=1):
        assert fingerprint(twin) == noisy_fp  # another model instance gets the identical noise
    with noised(m, 0.01, seed=3, step=2):
        assert fingerprint(m) != noisy_fp


def test_tiny_llama_logits():
    model = tiny_llama()
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model(ids).logits
        inj = NoiseInjector(model)
        inj.apply(0.05, seed=11, step=3)
        noisy = model(ids).logits
        again = model(ids).logits
        inj.reset()
        inj.apply(0.05, seed=11, step=3)  # re-applied after a reset: the same noise
        again2 = model(ids).logits
        inj.reset()
        back = model(ids).logits
    assert not torch.allclose(base, noisy, atol=1e-4)
    assert torch.equal(noisy, again) and torch.equal(noisy, again2)
    assert torch.equal(base, back)


def test_bf16_model():
    model = tiny_llama(torch.bfloat16)
    before = snapshot(model)
    with noised(model, 0.02, seed=0, step=1):
        k, mod = aqn_norms(model)[0]
        assert mod.weight.dtype == torch.bfloat16
        want = (before[k].float() + noise_vector(k, 64, 0.02, 0, 1)).bfloat16()
        assert torch.equal(mod.weight.detach(), want)
    for k, w in snapshot(model).items():
        assert torch.equal(w, before[k])


def test_no_targets_is_an_error():
    with pytest.raises(ValueError, match="no AQN targets"):
        NoiseInjector(nn.Linear(3, 3))


# --------------------------------------------------------------------------- relative sigma


def test_relative_noise_scales_with_each_element_of_the_weight():
    from qerl_lib.aqn import noise_for

    key = "layers.2.post_attention_layernorm"
    g = torch.Generator().manual_seed(5)
    w = torch.rand(4096, generator=g) * 2 - 1  # both signs, some near 0
    abs_noise = noise_for(w, 0.01, seed=7, step=3, key=key)
    rel = noise_for(w, 0.01, seed=7, step=3, key=key, mode="relative")
    # absolute: the paper's noise, whatever the weight
    assert torch.equal(abs_noise, noise_vector(key, 4096, 0.01, 7, 3))
    assert torch.equal(noise_for(3 * w, 0.01, 7, 3, key), abs_noise)
    # relative: the same standard normal draw, times |w| elementwise
    assert torch.equal(rel, abs_noise * w.abs())
    assert torch.allclose(noise_for(3 * w, 0.01, 7, 3, key, "relative"), 3 * rel, rtol=1e-6, atol=0)
    assert torch.equal(noise_for(-w, 0.01, 7, 3, key, "relative"), rel)  # std sigma*|w|: sign-free
    # its std relative to the weight is sigma, on every element
    ratio = rel / w
    assert ratio.std().item() == pytest.approx(0.01, rel=0.05)
    # a constant weight c gives the absolute noise of sigma * c
    c = torch.full((64,), 0.25)
    assert torch.allclose(noise_for(c, 0.04, 1, 1, key, "relative"), noise_vector(key, 64, 0.01, 1, 1), atol=1e-9)


def test_relative_noise_is_reproducible_and_zero_at_sigma_zero():
    from qerl_lib.aqn import noise_for, noisy_weight

    key = "layers.0.input_layernorm"
    w = torch.linspace(-2, 2, 33).to(torch.bfloat16)
    a = noise_for(w, 0.02, seed=1, step=4, key=key, mode="relative")
    assert a.dtype == torch.float32 and a.shape == (33,)
    assert torch.equal(a, noise_for(w.clone(), 0.02, seed=1, step=4, key=key, mode="relative"))
    assert not torch.equal(a, noise_for(w, 0.02, seed=1, step=5, key=key, mode="relative"))
    assert not torch.equal(a, noise_for(w, 0.02, seed=2, step=4, key=key, mode="relative"))
    for mode in ("absolute", "relative"):
        assert torch.equal(noise_for(w, 0.0, 1, 4, key, mode), torch.zeros(33))
        clean = noisy_weight(w, 0.0, 1, 4, key, mode)
        assert clean.dtype == torch.bfloat16 and torch.equal(clean, w)
    want = (w.float() + a).to(torch.bfloat16)
    assert torch.equal(noisy_weight(w, 0.02, 1, 4, key, "relative"), want)
    with pytest.raises(ValueError, match="sigma_mode"):
        noise_for(w, 0.02, 1, 4, key, "percent")
    with pytest.raises(ValueError, match="1-D"):
        noise_for(w.view(3, 11), 0.02, 1, 4, key)


def test_injector_relative_mode_writes_clean_times_one_plus_noise_and_resets_exactly():
    m = Custom(hidden=32, layers=2)
    with torch.no_grad():
        for _, mod in aqn_norms(m):
            mod.weight.uniform_(-1.5, 1.5)
    before = snapshot(m)
    inj = NoiseInjector(m)
    with noised(inj, 0.05, seed=1, step=2, mode="relative"):
        assert inj.mode == "relative"
        for k, mod in aqn_norms(m):
            z = noise_vector(k, 32, 0.05, 1, 2)
            assert torch.equal(mod.weight.detach(), before[k] + z * before[k].abs())
    for k, w in snapshot(m).items():
        assert torch.equal(w, before[k])
    inj.apply(0.0, seed=1, step=2, mode="relative")
    for k, w in snapshot(m).items():
        assert torch.equal(w, before[k])
    with pytest.raises(ValueError, match="sigma_mode"):
        inj.apply(0.05, 1, 2, mode="rel")


def test_config_sigma_mode_default_is_the_papers():
    assert AQNConfig().sigma_mode == "absolute"
    assert AQNConfig(sigma_mode="relative").sigma_mode == "relative"
    with pytest.raises(Exception, match="sigma_mode"):
        AQNConfig(sigma_mode="percent")


# --------------------------------------------------------------------------- magnitudes


def test_norm_magnitudes():
    from qerl_lib.aqn import norm_magnitudes

    m = Custom(hidden=4, layers=2)
    with torch.no_grad():
        for i, (k, mod) in enumerate(aqn_norms(m)):
            mod.weight.copy_(torch.tensor([1.0, -1.0, 2.0, -2.0]) * (i + 1))
    st = norm_magnitudes(m)
    # input norms are targets 0 and 2 (scale 1 and 3), post-attention ones 1 and 3 (scale 2 and 4)
    assert st["input_layernorm"]["layers"] == 2 and st["all"]["n"] == 16
    assert st["input_layernorm"]["mean_abs"] == pytest.approx(1.5 * (1 + 3) / 2)
    assert st["post_attention_layernorm"]["max"] == pytest.approx(8.0)
    assert st["post_attention_layernorm"]["min"] == pytest.approx(-8.0)
    assert st["all"]["rms"] == pytest.approx(math.sqrt(2.5 * (1 + 4 + 9 + 16) / 4))
    assert st["all"]["layer_rms_min"] == pytest.approx(math.sqrt(2.5))
    assert st["all"]["layer_rms_max"] == pytest.approx(4 * math.sqrt(2.5))
    with pytest.raises(ValueError, match="no AQN targets"):
        norm_magnitudes(nn.Linear(3, 3))
