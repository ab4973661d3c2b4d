"""Continuous batching in the built-in engine: rows join and leave between decode steps, slots are
reused without leaking one sequence's cache into another, per-row limits hold, and it needs fewer
forward passes than static batching when output lengths are mixed."""

from __future__ import annotations

import pytest
import torch
from rollout_models import greedy_uncached, reference, tiny_model, tokenizer, uncached_logits

from furlong.rollout.core.engine import Engine
from furlong.rollout.core.model_runner import ModelRunner
from furlong.rollout.core.sampling import SamplingConfig

pytestmark = pytest.mark.unit

TEXTS = ["12+7=", "3+4=", "99+99=", "0+0=", "5+51=", "8+8=", "1+2=", "77+1=", "4+40=", "6+66="]


class NoEos:
    """EOS is an id the model is made never to draw, so rows stop only at their limits."""

    pad_id = 0
    eos_id = 2

    def decode(self, ids, skip_special=True):
        return tokenizer().decode(ids, skip_special=skip_special)


def no_eos_model(seed: int):
    model = tiny_model(seed)
    model.lm_head.register_forward_hook(lambda m, a, out: out.index_fill(-1, torch.tensor([2]), -1e9))
    return model


def counted(engine: Engine) -> list[int]:
    """Per forward pass, the number of rows it drew a token for (lm_head runs once per pass, on the
    last position of every running or joining row)."""
    calls: list[int] = []
    engine.model.lm_head.register_forward_pre_hook(lambda m, a: calls.append(a[0].shape[0]))
    return calls


def test_slots_are_reused_without_leaking_between_sequences():
    model = tiny_model(21)
    tok = tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    limits = [3 + (7 * i) % 9 for i in range(len(prompts))]
    engine = Engine(model, tok, max_batch_size=3, prefill_min_rows=1)
    calls = counted(engine)
    gens = engine.generate(prompts, SamplingConfig(top_k=1), max_new_tokens=limits)
    for p, limit, g in zip(prompts, limits, gens):
        expected = greedy_uncached(model, p, limit, tok.eos_id)
        assert g.token_ids == expected
        assert g.finish_reason == ("eos" if expected[-1] == tok.eos_id else "length")
    assert max(calls) <= 3 and len(calls) > 1


def test_sampled_rows_joining_late_have_exact_logprobs_and_supports():
    model = tiny_model(22)
    tok = tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    config = SamplingConfig(temperature=0.9, top_k=7, top_p=0.9, max_new_tokens=6, seed=4)
    gens = Engine(model, tok, max_batch_size=3, prefill_min_rows=1).generate(
        prompts, config, max_new_tokens=[2, 6, 3, 6, 2, 5, 3, 6, 4, 2]
    )
    for p, g in zip(prompts, gens):
        for pos, t in enumerate(g.token_ids):
            support, logps = reference(uncached_logits(model, p + g.token_ids[:pos]).numpy(), 0.9, 7, 0.9)
            assert set(g.support.row(pos).tolist()) == support
            assert abs(g.logprobs[pos] - logps[t]) < 1e-4


def test_continuous_needs_fewer_forward_passes_than_static_for_mixed_lengths():
    tok = tokenizer()
    prompts = [tok.encode(t) for t in TEXTS[:8]] * 3
    limits = [3 if i % 4 else 24 for i in range(len(prompts))]  # one long row in four
    config = SamplingConfig(top_k=1)
    cont = Engine(no_eos_model(23), NoEos(), max_batch_size=8, batching="continuous", prefill_min_rows=2)
    static = Engine(no_eos_model(23), NoEos(), max_batch_size=8, batching="static")
    early = Engine(no_eos_model(23), NoEos(), max_batch_size=8, batching="static_early_exit")
    cont_calls, static_calls, early_calls = counted(cont), counted(static), counted(early)
    a = cont.generate(prompts, config, max_new_tokens=limits)
    b = static.generate(prompts, config, max_new_tokens=limits)
    c = early.generate(prompts, config, max_new_tokens=limits)
    assert [g.token_ids for g in a] == [g.token_ids for g in b] == [g.token_ids for g in c]
    assert [len(g.token_ids) for g in a] == limits
    assert all(g.finish_reason == "length" for g in a + b + c)
    assert [g.support.offsets.tolist() for g in b] == [g.support.offsets.tolist() for g in a]
    # static: 3 batches of 8, each waiting for its two 24-token rows (3 x 24 passes); finished
    # rows keep decoding padding, so every pass carries all 8 rows
    assert len(static_calls) == 72 and set(static_calls) == {8}
    # early exit: the same passes, but after 3 tokens only the two long rows remain in the pass
    assert len(early_calls) == 72 and early_calls[:4] == [8, 8, 8, 2]
    assert len(cont_calls) < 0.6 * len(static_calls)
    assert max(cont_calls) == 8


def test_static_padding_stops_at_the_context_limit():
    """A finished row decodes padding only while its slot has positions left; the long row of
    the batch still runs to its limit."""
    model = no_eos_model(25)
    room = model.config.max_position_embeddings
    long_prompt, short_prompt = [1] + [5] * 3, [1] + [5] * (room - 6)
    limits = [room - len(long_prompt), 2]
    gens = Engine(model, NoEos(), max_batch_size=2, batching="static").generate(
        [long_prompt, short_prompt], SamplingConfig(top_k=1), max_new_tokens=limits
    )
    assert [len(g.token_ids) for g in gens] == limits


def test_per_row_limits_and_configuration_errors():
    engine = Engine(tiny_model(24), tokenizer(), max_batch_size=2)
    with pytest.raises(ValueError, match="max_new_tokens has 1 entries for 2 prompts"):
        engine.generate([[1, 3], [1, 4]], SamplingConfig(), max_new_tokens=[3])
    with pytest.raises(ValueError, match=r"max_new_tokens entries must be integers > 0, got \[0\]"):
        engine.generate([[1, 3], [1, 4]], SamplingConfig(), max_new_tokens=[3, 0])
    with pytest.raises(
        ValueError, match="batching must be one of 'continuous', 'static', 'static_early_exit', got 'dynamic'"
    ):
        Engine(tiny_model(24), tokenizer(), batching="dynamic")
    with pytest.raises(ValueError, match="prefill_min_rows"):
        Engine(tiny_model(24), tokenizer(), max_batch_size=2, prefill_min_rows=3)
    with pytest.raises(ValueError, match="model types"):
        ModelRunner(torch.nn.Linear(2, 2), 2)
