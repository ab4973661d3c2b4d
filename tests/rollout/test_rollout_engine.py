"""The built-in torch engine on tiny Llama models: KV cache and left padding against uncached decoding,
log-probs and supports against a recomputation, seeds, EOS, batching, and weight switches."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from rollout_models import greedy_uncached, reference, tiny_model, tokenizer, uncached_logits

from furlong.rollout.core.engine import Engine
from furlong.rollout.core.sampler import SamplingConfig

pytestmark = pytest.mark.unit

TEXTS = ["12+7=", "3+4=", "99+99=", "0+0=", "5+51=", "8+8="]


def prompts() -> list[list[int]]:
    tok = tokenizer()
    return [tok.encode(t) for t in TEXTS]


@dataclass
class EosAt:
    """A tokenizer whose EOS is an ordinary token, so that a test can choose where rows stop."""

    eos_id: int
    pad_id: int = 0

    def decode(self, ids, skip_special=True):
        return tokenizer().decode([i for i in ids if i != self.eos_id], skip_special=skip_special)


GREEDY = SamplingConfig(temperature=1.0, top_k=1, max_new_tokens=12, seed=0)


def test_greedy_equals_uncached_argmax_with_left_padding():
    model = tiny_model(1)
    gens = Engine(model, tokenizer()).generate(prompts(), GREEDY)
    for p, g in zip(prompts(), gens):
        expected = greedy_uncached(model, p, GREEDY.max_new_tokens, tokenizer().eos_id)
        assert g.token_ids == expected
        assert g.support.to_lists() == [[t] for t in expected]
        assert g.logprobs == [0.0] * len(expected)
        assert g.finish_reason == ("eos" if expected[-1] == tokenizer().eos_id else "length")
        assert g.text == tokenizer().decode(expected)
        assert g.policy_version == 0


def test_rows_stop_at_eos_and_the_rest_continue():
    # Pick a model and a token that row 0 draws early but some other row never draws; make it EOS.
    for seed in range(2, 40):
        model = tiny_model(seed)
        full = Engine(model, tokenizer()).generate(prompts(), GREEDY)
        early = [t for t in full[0].token_ids[:-1] if any(t not in f.token_ids for f in full[1:])]
        if early:
            break
    assert early, "no model in the seed range draws a suitable token"
    eos = early[0]
    gens = Engine(model, EosAt(eos_id=eos)).generate(prompts(), GREEDY)
    stopped = 0
    for f, g in zip(full, gens):
        cut = f.token_ids.index(eos) + 1 if eos in f.token_ids else len(f.token_ids)
        assert g.token_ids == f.token_ids[:cut]
        assert g.finish_reason == ("eos" if eos in f.token_ids else "length")
        stopped += eos in f.token_ids
    assert gens[0].token_ids[-1] == eos and len(gens[0].token_ids) < len(full[0].token_ids)
    assert gens[0].finish_reason == "eos"
    assert stopped < len(gens)  # some rows ran on after others left the batch


def test_sampled_logprobs_and_supports_match_recomputation():
    model = tiny_model(3)
    config = SamplingConfig(temperature=0.8, top_k=8, top_p=0.85, max_new_tokens=10, seed=11)
    gens = Engine(model, tokenizer()).generate(prompts(), config)
    for p, g in zip(prompts(), gens):
        assert len(g.token_ids) == len(g.logprobs) == g.support.num_rows
        for pos, tok in enumerate(g.token_ids):
            logits = uncached_logits(model, p + g.token_ids[:pos]).numpy()
            support, logps = reference(logits, config.temperature, config.top_k, config.top_p)
            assert set(g.support.row(pos).tolist()) == support
            assert abs(g.logprobs[pos] - logps[tok]) < 1e-4


def test_full_vocab_support_when_nothing_is_filtered():
    config = SamplingConfig(temperature=1.0, max_new_tokens=4, seed=2)
    g = Engine(tiny_model(4), tokenizer()).generate(prompts()[:1], config)[0]
    vocab = list(range(tokenizer().vocab_size))
    assert g.support.to_lists() == [vocab] * len(g.token_ids)


def test_same_seed_same_tokens_other_seed_differs():
    engine = Engine(tiny_model(5), tokenizer())
    config = SamplingConfig(temperature=1.0, max_new_tokens=16, seed=42)
    a = engine.generate(prompts() * 4, config)
    b = Engine(tiny_model(5), tokenizer()).generate(prompts() * 4, config)
    c = engine.generate(prompts() * 4, SamplingConfig(temperature=1.0, max_new_tokens=16, seed=43))
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.logprobs for g in a] == [g.logprobs for g in b]
    assert [g.token_ids for g in a] != [g.token_ids for g in c]


def test_batches_split_by_max_batch_size_give_the_same_greedy_tokens():
    model = tiny_model(6)
    big = Engine(model, tokenizer(), max_batch_size=256).generate(prompts(), GREEDY)
    small = Engine(model, tokenizer(), max_batch_size=2).generate(prompts(), GREEDY)
    assert [g.token_ids for g in big] == [g.token_ids for g in small]


def test_length_limit_and_bad_prompts():
    engine = Engine(tiny_model(7), tokenizer())
    config = SamplingConfig(top_k=1, max_new_tokens=3)
    gens = engine.generate(prompts(), config)
    assert all(len(g.token_ids) <= 3 for g in gens)
    assert all(g.finish_reason == "length" for g in gens if len(g.token_ids) == 3 and g.token_ids[-1] != 2)
    assert engine.generate([], config) == []
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 3], []], config)
    with pytest.raises(ValueError, match=r"prompt 0 has token ids outside \[0, 15\): \[15\]"):
        engine.generate([[1, 15]], config)
    with pytest.raises(ValueError, match="max_position_embeddings 128"):
        engine.generate([[1] * 120], SamplingConfig(max_new_tokens=9))


def test_load_weights_switches_policy_and_version():
    engine = Engine(tiny_model(8), tokenizer())
    other = tiny_model(9)
    before = engine.generate(prompts(), GREEDY)
    engine.load_weights(1, other.state_dict())
    after = engine.generate(prompts(), GREEDY)
    expected = Engine(other, tokenizer()).generate(prompts(), GREEDY)
    assert engine.policy_version == 1
    assert [g.token_ids for g in after] == [g.token_ids for g in expected]
    assert [g.token_ids for g in after] != [g.token_ids for g in before]
    assert {g.policy_version for g in after} == {1} and {g.policy_version for g in before} == {0}


def test_load_weights_errors_change_nothing():
    engine = Engine(tiny_model(10), tokenizer())
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    new = {k: v + 1.0 for k, v in tiny_model(11).state_dict().items()}
    cases = [
        ({k: v for k, v in new.items() if k != "model.norm.weight"}, "missing tensor.*model.norm.weight"),
        ({**new, "model.extra.weight": torch.zeros(2)}, "unexpected tensor.*model.extra.weight"),
        (
            {**new, "lm_head.weight": torch.zeros(3, 3)},
            r"lm_head.weight has shape \(3, 3\), expected \(15, 32\)",
        ),
        (
            {**new, "model.norm.weight": torch.zeros(32, dtype=torch.int64)},
            "model.norm.weight has dtype torch.int64",
        ),
    ]
    for tensors, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            engine.load_weights(1, tensors)
    engine.load_weights(3, new)
    with pytest.raises(ValueError, match="version 2 is older than the served version 3"):
        engine.load_weights(2, original)
    with pytest.raises(ValueError, match="policy version must be an integer >= 0"):
        engine.load_weights(-1, original)
    assert engine.policy_version == 3
    for k, v in engine.model.state_dict().items():
        assert torch.equal(v, new[k]), k


def test_tied_weights_accept_either_name():
    engine = Engine(tiny_model(12, tie=True), tokenizer())
    source = tiny_model(13, tie=True)
    tensors = {k: v for k, v in source.state_dict().items() if k != "lm_head.weight"}
    engine.load_weights(1, tensors)
    assert torch.equal(engine.model.lm_head.weight, source.model.embed_tokens.weight)
    with pytest.raises(ValueError, match="missing tensor.*model.embed_tokens.weight / lm_head.weight"):
        engine.load_weights(2, {k: v for k, v in tensors.items() if k != "model.embed_tokens.weight"})


def test_load_weights_waits_for_the_running_batch():
    engine = Engine(tiny_model(14), tokenizer())
    entered, release = threading.Event(), threading.Event()

    def hold(module, args, kwargs):
        entered.set()
        assert release.wait(30)

    handle = engine.model.model.embed_tokens.register_forward_pre_hook(hold, with_kwargs=True)
    result: dict = {}
    gen_thread = threading.Thread(target=lambda: result.update(g=engine.generate(prompts(), GREEDY)))
    gen_thread.start()
    assert entered.wait(30)
    load_thread = threading.Thread(target=engine.load_weights, args=(1, tiny_model(15).state_dict()))
    load_thread.start()
    load_thread.join(0.3)
    assert load_thread.is_alive() and engine.policy_version == 0
    assert not engine.wait_for_version(1, 0.05)
    handle.remove()
    release.set()
    gen_thread.join(30)
    load_thread.join(30)
    assert engine.policy_version == 1 and engine.wait_for_version(1, 0.0)
    assert {g.policy_version for g in result["g"]} == {0}


def test_wait_for_version_wakes_on_load():
    engine = Engine(tiny_model(16), tokenizer())
    state = tiny_model(17).state_dict()
    timer = threading.Timer(0.1, engine.load_weights, args=(2, state))
    started = time.monotonic()
    timer.start()
    assert engine.wait_for_version(2, 10.0)
    assert time.monotonic() - started < 5.0
    timer.join()


def test_decode_throughput_uses_batched_steps():
    """Many rows cost about as many model calls as one row: steps are batched, not per row."""
    engine = Engine(tiny_model(18), tokenizer())
    calls = []
    handle = engine.model.model.embed_tokens.register_forward_pre_hook(lambda m, a: calls.append(1))
    gens = engine.generate(prompts() * 40, SamplingConfig(top_k=1, max_new_tokens=8))
    handle.remove()
    assert len(gens) == 240
    assert len(calls) <= 8
    assert np.all([len(g.token_ids) <= 8 for g in gens])
