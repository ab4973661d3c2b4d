"""Sampling exactness over more than 10k generated tokens (top-k 50, top-p 0.9): every token lies in
its support, the recorded log-probs equal log-softmax over the support (and over the vocabulary) of
the very logits the engine sampled from, and the support equals what an independent float64
top-k/top-p filter keeps. Also min-p and the support-size bound."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from rollout_models import reference, tiny_model

import furlong.rollout.core.engine as engine_module
from furlong.rollout.core.engine import Engine
from furlong.rollout.core.sampler import SupportBound, SupportOverflowError, sample_step
from furlong.rollout.core.sampling import SamplingConfig

pytestmark = pytest.mark.unit

VOCAB = 256


@dataclass
class ByteTokenizer:
    pad_id: int = 0
    eos_id: int = 2

    def decode(self, ids, skip_special=True):
        return " ".join(str(i) for i in ids if not (skip_special and i in (0, 1, 2)))


def independent_supports(logits: np.ndarray, temperature: float, top_k: int, top_p: float):
    """Per row: the kept ids as a sorted array, and log-softmax over them (float64, numpy only)."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, axis=-1, kind="stable")[:, :top_k]
    zs = np.take_along_axis(z, order, axis=-1)
    p = np.exp(zs - zs[:, :1])
    p /= p.sum(-1, keepdims=True)
    before = np.cumsum(p, axis=-1) - p
    keep = before < top_p
    out = []
    for r in range(z.shape[0]):
        kept = order[r][keep[r]]
        zk = z[r, kept]
        lse = zk.max() + np.log(np.exp(zk - zk.max()).sum())
        out.append((np.sort(kept), {int(t): float(z[r, t] - lse) for t in kept}))
    return out


def test_ten_thousand_tokens_are_drawn_exactly_from_their_supports(monkeypatch):
    steps: list[tuple[torch.Tensor, object]] = []

    def recording_sample_step(logits, config, generator, bound=SupportBound()):
        draw = sample_step(logits, config, generator, bound)
        steps.append((logits.detach().clone(), draw))
        return draw

    monkeypatch.setattr(engine_module, "sample_step", recording_sample_step)
    config = SamplingConfig(temperature=1.0, top_k=50, top_p=0.9, max_new_tokens=120, seed=123)
    rng = np.random.default_rng(0)
    prompts = [[1] + rng.integers(3, VOCAB, size=int(rng.integers(2, 8))).tolist() for _ in range(176)]
    model = tiny_model(31, vocab_size=VOCAB)
    gens = Engine(model, ByteTokenizer()).generate(prompts, config)
    num_tokens = sum(len(g.token_ids) for g in gens)
    assert num_tokens >= 10_000
    assert sum(int(d.tokens.numel()) for _, d in steps) == num_tokens

    sizes = []
    for logits, draw in steps:
        expected = independent_supports(logits.numpy(), config.temperature, config.top_k, config.top_p)
        full = torch.log_softmax(logits.double() / config.temperature, dim=-1)
        for r, (kept, logps) in enumerate(expected):
            got = np.sort(draw.kept_ids[r, : int(draw.kept_counts[r])].numpy())
            assert np.array_equal(got, kept)
            tok = int(draw.tokens[r])
            assert tok in logps
            assert abs(float(draw.logprobs[r]) - logps[tok]) < 1e-5
            assert abs(float(draw.full_logprobs[r]) - float(full[r, tok])) < 1e-5
            sizes.append(kept.size)
    assert 1 < np.median(sizes) < 50 and max(sizes) <= 50  # both filters were active

    for g in gens:
        assert len(g.full_logprobs) == len(g.logprobs) == g.support.num_rows == len(g.token_ids)
        assert g.truncated_positions == []
        for pos, tok in enumerate(g.token_ids):
            assert g.support.contains(pos, tok)
            assert g.full_logprobs[pos] <= g.logprobs[pos] + 1e-6  # filtering only renormalises up


@pytest.mark.parametrize("min_p,top_k,top_p", [(0.05, 0, 1.0), (0.2, 20, 1.0), (0.1, 0, 0.9)])
def test_min_p_support_and_logprobs(min_p, top_k, top_p):
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(2)) * 3.0
    config = SamplingConfig(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p)
    draw = sample_step(logits, config, torch.Generator().manual_seed(4))
    for r in range(64):
        support, logps = reference(logits[r].numpy(), 0.8, top_k, top_p, min_p)
        assert set(draw.kept_ids[r, : int(draw.kept_counts[r])].tolist()) == support
        tok = int(draw.tokens[r])
        assert abs(float(draw.logprobs[r]) - logps[tok]) < 1e-5
    assert int(draw.kept_counts.min()) < int(draw.kept_counts.max())


def test_min_p_must_be_in_unit_interval():
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match=rf"^min_p: must be in \[0, 1\), got {bad}"):
            SamplingConfig(min_p=bad)
    with pytest.raises(ValueError, match="^min_p: must be finite, got nan"):
        SamplingConfig(min_p=float("nan"))


def test_support_bound_error_names_sizes():
    logits = torch.zeros(3, 40)  # uniform: every token stays under top_p 1.0
    with pytest.raises(SupportOverflowError, match="support of 40 token ids .* exceeds max_support_size 16"):
        sample_step(logits, SamplingConfig(), torch.Generator().manual_seed(0), SupportBound(16))
    draw = sample_step(logits, SamplingConfig(top_k=16), torch.Generator().manual_seed(0), SupportBound(16))
    assert draw.truncated is None and draw.kept_counts.tolist() == [16, 16, 16]


def test_support_bound_truncates_with_a_flag_and_stays_exact():
    logits = torch.randn(32, 60, generator=torch.Generator().manual_seed(8))
    bound = SupportBound(max_size=10, on_overflow="truncate")
    draw = sample_step(logits, SamplingConfig(top_p=0.95), torch.Generator().manual_seed(1), bound)
    assert draw.truncated is not None and bool(draw.truncated.all())
    assert draw.kept_counts.tolist() == [10] * 32
    for r in range(32):
        support, logps = reference(logits[r].numpy(), 1.0, 10, 1.0)  # truncation == extra top-k
        assert set(draw.kept_ids[r, :10].tolist()) == support
        assert abs(float(draw.logprobs[r]) - logps[int(draw.tokens[r])]) < 1e-5
    with pytest.raises(ValueError, match="on_overflow must be"):
        SupportBound(4, "drop")
    with pytest.raises(ValueError, match="max_support_size must be an integer >= 0"):
        SupportBound(-1)


def test_engine_flags_truncated_positions_and_errors_when_told_to():
    model = tiny_model(32, vocab_size=64)
    prompts = [[1, 5, 6], [1, 7]]
    config = SamplingConfig(max_new_tokens=6, seed=3)
    cut = Engine(model, ByteTokenizer(), support_bound=SupportBound(8, "truncate")).generate(prompts, config)
    for g in cut:
        assert g.truncated_positions == list(range(len(g.token_ids)))
        assert all(len(g.support.row(i)) == 8 for i in range(len(g.token_ids)))
    with pytest.raises(SupportOverflowError, match="64 token ids"):
        Engine(model, ByteTokenizer(), support_bound=SupportBound(8)).generate(prompts, config)
    greedy = Engine(model, ByteTokenizer(), support_bound=SupportBound(1)).generate(
        prompts, SamplingConfig(top_k=1, max_new_tokens=6)
    )
    assert all(g.truncated_positions == [] and g.logprobs == [0.0] * len(g.token_ids) for g in greedy)
