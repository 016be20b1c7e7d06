"""Inverse-CDF nucleus sampling (`qerl_lib.rollout.sampling`): the right distribution, the nucleus
only, and rows that do not depend on their batch."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from qerl_lib.rollout import sampling
from qerl_lib.rollout.sampling import SamplingParams, inverse_cdf_sample, sample_batch, shared_prefix_length


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Reference: the renormalised top-p distribution of one row `probs` [V]."""
    sorted_p, order = torch.sort(probs, descending=True, stable=True)
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order[keep_sorted]] = True
    out = torch.where(keep, probs, torch.zeros_like(probs))
    return out / out.sum()


def test_inverse_cdf_sample_draws_the_nucleus_distribution():
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15], dtype=torch.float64)
    for top_p in (1.0, 0.8, 0.5):
        want = nucleus(probs, top_p)
        # A fine grid of u stands in for the uniform: the share of each token is its mass.
        n = 100_000
        u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
        toks = inverse_cdf_sample(probs.expand(n, -1), u, top_p)
        got = torch.bincount(toks, minlength=5).double() / n
        assert torch.allclose(got, want, atol=2e-5), (top_p, got, want)
        assert set(toks.tolist()) == set(torch.nonzero(want).flatten().tolist())


def test_inverse_cdf_sample_edges():
    probs = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    # u at both ends stays inside the nucleus; ties go to the lower id first.
    assert inverse_cdf_sample(probs, torch.tensor([0.0, 0.0])).tolist() == [0, 2]
    assert inverse_cdf_sample(probs, torch.tensor([1.0 - 1e-12, 1.0 - 1e-12])).tolist() == [1, 2]
    assert inverse_cdf_sample(probs, torch.tensor([0.99, 0.5]), top_p=0.3).tolist() == [0, 2]


@pytest.fixture(scope="module")
def tiny_llama(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def test_rows_are_independent_of_the_batch_and_repeat(tiny_llama):
    model = tiny_llama
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12)
    a, b = [5, 6, 7, 8], [9, 10]
    alone = sample_batch(model, [a], [42], params, eos_ids=set(), pad_id=0)[0]
    mixed = sample_batch(model, [b, a, b], [1, 42, 2], params, eos_ids=set(), pad_id=0)
    again = sample_batch(model, [b, a, b], [1, 42, 2], params, eos_ids=set(), pad_id=0)
    assert mixed[1].token_ids == alone.token_ids
    assert [c.token_ids for c in again] == [c.token_ids for c in mixed]
    assert mixed[0].token_ids != mixed[2].token_ids  # different seeds, same prompt
    for c in mixed:
        assert len(c.token_ids) == len(c.logprobs) == 12 and c.finish_reason == "length"
        assert all(lp <= 0 for lp in c.logprobs)


def test_greedy_takes_the_argmax_and_records_its_logprob(tiny_llama):
    model = tiny_llama
    prompt = [3, 4, 5]
    c = sample_batch(model, [prompt], [0], SamplingParams(0.0, 1.0, 1), eos_ids=set(), pad_id=0)[0]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    assert c.token_ids == [int(logits.argmax())]
    assert abs(c.logprobs[0] - float(torch.log_softmax(logits, -1).max())) < 1e-5


def test_shared_prefix_length_leaves_every_row_a_token_of_its_own():
    assert shared_prefix_length([[1, 2, 3]]) == 0  # one row: nothing to share
    assert shared_prefix_length([[1, 2, 3, 4], [1, 2, 5]]) == 2
    assert shared_prefix_length([[1, 2, 3], [1, 2, 3]]) == 2  # identical prompts keep their last token
    assert shared_prefix_length([[7, 2], [1, 2]]) == 0


def test_a_shared_prefix_is_prefilled_once_with_the_same_samples(tiny_llama, monkeypatch):
    """Rows whose prompts share >= MIN_SHARED_PREFIX tokens sample what they sample without the
    sharing (the prefix's KV cache repeated over the rows, suffixes padded behind it): same tokens,
    logprobs equal up to float rounding; and the prefix runs as one row."""
    model = tiny_llama
    prefix = [(11 * i) % 200 + 20 for i in range(20)]
    prompts = [prefix + [5, 6, 7], prefix + [9], prefix + [5, 6, 7], prefix + [30, 31]]
    seeds = [3, 4, 5, 6]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10)
    widths = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, a, o: widths.append(tuple(a[0].shape)))
    try:
        shared = sample_batch(model, prompts, seeds, params, eos_ids=set(), pad_id=0)
    finally:
        hook.remove()
    assert widths[0] == (1, 20) and widths[1] == (4, 3)  # the prefix once, then the suffixes
    monkeypatch.setattr(sampling, "MIN_SHARED_PREFIX", 10**9)
    plain = sample_batch(model, prompts, seeds, params, eos_ids=set(), pad_id=0)
    for a, b in zip(shared, plain):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
