"""Sampling supports and log-probs against an independent top-k/top-p computation (float64 numpy),
the configuration's validation, and the decode trace's per-row assembly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rollout_models import reference

from furlong.rollout.core.sampler import SamplingConfig, StepDraw, SupportBound, sample_step
from furlong.rollout.core.trace import DecodeTrace

pytestmark = pytest.mark.unit


CONFIGS = [
    SamplingConfig(temperature=1.0, top_k=0, top_p=1.0),
    SamplingConfig(temperature=0.7, top_k=5, top_p=1.0),
    SamplingConfig(temperature=1.3, top_k=0, top_p=0.9),
    SamplingConfig(temperature=0.8, top_k=10, top_p=0.75),
    SamplingConfig(temperature=2.0, top_k=0, top_p=0.3),
    SamplingConfig(temperature=1.0, top_k=1, top_p=1.0),
    SamplingConfig(temperature=1.0, top_k=50, top_p=1.0),  # top_k == vocab: off
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"t{c.temperature}-k{c.top_k}-p{c.top_p}")
def test_support_and_logprob_match_independent_computation(config):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 50, generator=gen) * 3.0
    draw = sample_step(logits, config, torch.Generator().manual_seed(1))
    assert draw.tokens.shape == (64,) and draw.logprobs.shape == (64,)
    for r in range(64):
        support, logps = reference(logits[r].numpy(), config.temperature, config.top_k, config.top_p)
        if draw.kept_ids is None:
            got = set(range(50))
        else:
            got = set(draw.kept_ids[r, : int(draw.kept_counts[r])].tolist())
        assert got == support, r
        tok = int(draw.tokens[r])
        assert tok in support
        assert abs(float(draw.logprobs[r]) - logps[tok]) < 1e-5
    if config.top_k == 1:
        assert torch.equal(draw.tokens, logits.argmax(-1))
        assert torch.all(draw.logprobs == 0.0)
    if config.top_k in (0, 50) and config.top_p == 1.0:
        assert draw.kept_ids is None


def test_draw_frequencies_follow_the_filtered_distribution():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0])
    config = SamplingConfig(temperature=0.9, top_k=5, top_p=0.9)
    support, logps = reference(logits.numpy(), 0.9, 5, 0.9)
    n = 40_000
    draw = sample_step(logits.expand(n, -1), config, torch.Generator().manual_seed(3))
    counts = np.bincount(draw.tokens.numpy(), minlength=7) / n
    for t in range(7):
        expected = np.exp(logps[t]) if t in support else 0.0
        assert abs(counts[t] - expected) < 0.01, (t, counts[t], expected)


def test_unfiltered_draws_over_a_vocabulary_of_several_blocks_follow_the_softmax():
    """Ids on both sides of block edges, a vocabulary that is not a whole number of blocks and
    impossible ids (-inf logits) that must never be drawn."""
    gen = torch.Generator().manual_seed(5)
    vocab = 700
    logits = torch.rand(vocab, generator=gen) * 2.0 - 2.0
    heavy = [3, 255, 256, 511, 512, 699]
    logits[heavy] = 3.0
    impossible = torch.randperm(vocab, generator=gen)[:100]
    impossible = impossible[~torch.isin(impossible, torch.tensor(heavy))]
    logits[impossible] = float("-inf")
    n = 40_000
    config = SamplingConfig(temperature=1.0)
    draw = sample_step(logits.expand(n, -1), config, torch.Generator().manual_seed(9))
    assert draw.kept_ids is None
    counts = np.bincount(draw.tokens.numpy(), minlength=vocab) / n
    expected = torch.softmax(logits.double(), -1).numpy()
    assert counts[impossible.numpy()].sum() == 0.0
    for t in heavy:
        assert abs(counts[t] - expected[t]) < 0.01, (t, counts[t], expected[t])
    for block in range(3):  # mass per 256-id block
        ids = slice(256 * block, 256 * (block + 1))
        assert abs(counts[ids].sum() - expected[ids].sum()) < 0.01, block
    reference = torch.log_softmax(logits.double(), -1)[draw.tokens]
    assert torch.allclose(draw.logprobs.double(), reference, atol=1e-6)


@pytest.mark.parametrize("filters", [{}, {"top_k": 5, "top_p": 0.5, "min_p": 0.2}])
def test_temperature_zero_is_the_argmax_with_a_support_of_one(filters):
    logits = torch.randn(64, 30, generator=torch.Generator().manual_seed(3))
    logits[7, :] = 0.0  # a tie: the first most probable id, as torch.argmax and transformers pick
    config = SamplingConfig(temperature=0.0, **filters)
    draw = sample_step(logits, config, torch.Generator().manual_seed(1), SupportBound(1))
    assert torch.equal(draw.tokens, logits.argmax(dim=-1)) and int(draw.tokens[7]) == 0
    assert draw.kept_ids is not None and draw.kept_counts is not None
    assert torch.equal(draw.kept_ids[:, 0], draw.tokens) and draw.kept_counts.tolist() == [1] * 64
    assert draw.logprobs.tolist() == [0.0] * 64 and draw.full_logprobs is not None
    assert draw.full_logprobs.tolist() == [0.0] * 64
    other = sample_step(logits, config, torch.Generator().manual_seed(2))
    assert torch.equal(other.tokens, draw.tokens)  # the seed plays no part


def test_same_generator_seed_same_draws_and_different_seed_differs():
    logits = torch.randn(128, 30, generator=torch.Generator().manual_seed(0))
    config = SamplingConfig(top_p=0.95)
    a = sample_step(logits, config, torch.Generator().manual_seed(5)).tokens
    b = sample_step(logits, config, torch.Generator().manual_seed(5)).tokens
    c = sample_step(logits, config, torch.Generator().manual_seed(6)).tokens
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("temperature", -0.1, "temperature"),
        ("temperature", float("nan"), "temperature"),
        ("temperature", float("inf"), "temperature"),
        ("top_k", -1, "top_k"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("max_new_tokens", 0, "max_new_tokens"),
        ("seed", -1, "seed"),
        ("seed", 2**63, "seed"),
        ("top_k", 2.5, "top_k"),
    ],
)
def test_sampling_config_rejects_bad_values(field, value, needle):
    with pytest.raises(ValueError, match=needle) as info:
        SamplingConfig(**{field: value})
    assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_trace_reassembles_rows_that_left_the_batch():
    def draw(tokens, kept):
        counts = torch.tensor([len(k) for k in kept])
        width = int(counts.max())
        ids = torch.tensor([k + [0] * (width - len(k)) for k in kept])
        return StepDraw(
            tokens=torch.tensor(tokens),
            logprobs=-torch.arange(len(tokens), dtype=torch.float32) - 0.5,
            kept_ids=ids,
            kept_counts=counts,
        )

    trace = DecodeTrace(num_rows=3, vocab_size=10)
    trace.add(torch.tensor([0, 1, 2]), draw([5, 6, 7], [[5, 1], [6], [9, 7, 3]]))
    trace.add(torch.tensor([0, 2]), draw([8, 4], [[8], [4, 2]]))
    trace.add(torch.tensor([2]), draw([1], [[1, 0, 9, 8]]))
    rows = trace.rows()
    assert trace.num_tokens == 6
    assert [r.token_ids for r in rows] == [[5, 8], [6], [7, 4, 1]]
    assert [r.logprobs for r in rows] == [[-0.5, -0.5], [-1.5], [-2.5, -1.5, -0.5]]
    assert rows[0].support.to_lists() == [[1, 5], [8]]
    assert rows[1].support.to_lists() == [[6]]
    assert rows[2].support.to_lists() == [[3, 7, 9], [2, 4], [0, 1, 8, 9]]
    assert all(r.support.vocab_size == 10 for r in rows)


def test_trace_full_vocab_supports():
    trace = DecodeTrace(num_rows=2, vocab_size=4)

    def full(toks):
        return StepDraw(
            tokens=torch.tensor(toks), logprobs=torch.zeros(len(toks)), kept_ids=None, kept_counts=None
        )

    trace.add(torch.tensor([0, 1]), full([3, 2]))
    trace.add(torch.tensor([1]), full([0]))
    rows = trace.rows()
    assert rows[0].support.to_lists() == [[0, 1, 2, 3]]
    assert rows[1].support.to_lists() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert [r.token_ids for r in rows] == [[3], [2, 0]]
