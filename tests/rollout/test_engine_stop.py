"""Stop strings: validation in SamplingConfig, the incremental matcher, and the built-in engine ending a
row at the token that completes a stop string (text cut before it, token ids, log-probs and supports
kept aligned, finish reason "stop") while the other rows of the batch run on unchanged."""

from __future__ import annotations

import pytest
import torch
from rollout_models import greedy_uncached, reference, tiny_model, tokenizer, uncached_logits

from furlong.rollout.core.engine import Engine
from furlong.rollout.core.sampling import MAX_STOP_STRINGS, SamplingConfig
from furlong.rollout.core.stop_strings import StopMatcher, cut_at_stop, first_stop

pytestmark = pytest.mark.unit

TEXTS = ["12+7=", "3+4=", "99+99=", "0+0=", "5+51=", "8+8="]


class NoEos:
    """The addition tokenizer, with EOS an id the model is made never to draw."""

    pad_id = 0
    eos_id = 2

    def decode(self, ids, skip_special=True):
        return tokenizer().decode(ids, skip_special=skip_special)


def no_eos_model(seed: int):
    model = tiny_model(seed)
    model.lm_head.register_forward_hook(lambda m, a, out: out.index_fill(-1, torch.tensor([2]), -1e9))
    return model


def prompts() -> list[list[int]]:
    return [tokenizer().encode(t) for t in TEXTS]


def test_config_validates_stop_strings():
    assert SamplingConfig(stop=["\n", "+="]).stop == ("\n", "+=")
    assert SamplingConfig(stop=("a", "a", "b")).stop == ("a", "b")
    assert SamplingConfig().stop == ()
    with pytest.raises(ValueError, match="^stop: must be a list of strings, got 'ab'"):
        SamplingConfig(stop="ab")
    with pytest.raises(ValueError, match="^stop: entry 1 must be a non-empty string, got ''"):
        SamplingConfig(stop=["x", ""])
    with pytest.raises(ValueError, match="^stop: entry 0 must be a string, got 3"):
        SamplingConfig(stop=[3])
    with pytest.raises(
        ValueError, match=f"^stop: must have at most {MAX_STOP_STRINGS} entries, got {MAX_STOP_STRINGS + 1}"
    ):
        SamplingConfig(stop=[str(i) for i in range(MAX_STOP_STRINGS + 1)])
    with pytest.raises(ValueError, match="^stop: entry 0 must have at most 256 characters, got 300"):
        SamplingConfig(stop=["x" * 300])


def test_first_stop_and_cut():
    assert first_stop("ab+cd=ef", ["=", "+"]) == (2, "+")
    assert first_stop("ab+cd", ["+c", "+cd"]) == (2, "+cd")
    assert first_stop("abc", ["x"]) is None
    assert cut_at_stop("12+34=46", ["="]) == "12+34"
    assert cut_at_stop("1234", ["="]) == "1234"


def test_matcher_finds_strings_across_tokens_and_inside_long_tokens():
    vocab = {1: "The", 2: " end", 3: ".\nNext", 4: "\n", 5: "", 6: "a"}
    matcher = StopMatcher(["end.", "\n"], lambda ids: "".join(vocab[i] for i in ids))
    assert matcher.push(0, 1) is None
    assert matcher.push(0, 2) is None
    assert matcher.push(0, 3) == "end."  # " end" + ".\nNext": both occur, "end." first
    assert matcher.push(1, 6) is None  # rows are independent
    for _ in range(40):  # empty tokens widen the window, never miss a match
        assert matcher.push(1, 5) is None
    assert matcher.push(1, 4) == "\n"
    with pytest.raises(ValueError, match="non-empty strings"):
        StopMatcher([], str)


def test_greedy_rows_stop_at_the_string_and_the_rest_run_on():
    model, tok = no_eos_model(5), NoEos()
    limit = 24
    config = SamplingConfig(top_k=1, max_new_tokens=limit)
    free = Engine(model, tok, max_batch_size=4).generate(prompts(), config)
    # A stop string that row 0 produces after a few tokens, and that some other row never produces.
    text0 = free[0].text
    stop = next(
        text0[i : i + 2]
        for i in range(2, len(text0) - 1)
        if any(text0[i : i + 2] not in g.text for g in free[1:])
    )
    gens = Engine(model, tok, max_batch_size=4).generate(
        prompts(), SamplingConfig(top_k=1, max_new_tokens=limit, stop=[stop])
    )
    for p, f, g in zip(prompts(), free, gens):
        assert g.token_ids == greedy_uncached(model, p, len(g.token_ids), tok.eos_id)
        assert len(g.logprobs) == len(g.full_logprobs) == g.support.num_rows == len(g.token_ids)
        at = f.text.find(stop)
        if at < 0:
            assert g.token_ids == f.token_ids and g.finish_reason == "length"
            assert g.text == f.text and g.stop_string is None
        else:
            # The row ends at the token completing the first occurrence (one char per token here).
            assert g.token_ids == f.token_ids[: at + len(stop)]
            assert g.finish_reason == "stop" and g.stop_string == stop
            assert g.text == f.text[:at]
            assert tok.decode(g.token_ids).endswith(stop)
    assert any(g.finish_reason == "stop" for g in gens)
    assert any(g.finish_reason == "length" for g in gens)


def test_sampled_stop_keeps_logprobs_and_supports_exact():
    model, tok = no_eos_model(6), NoEos()
    prompt = tokenizer().encode("12+7=")
    base = SamplingConfig(temperature=0.9, top_k=7, top_p=0.95, max_new_tokens=30, seed=9)
    free = Engine(model, tok).generate([prompt], base)[0]
    stop = free.text[15:17]
    at = free.text.find(stop)
    # the response up to the first token whose text completes the stop string (ids and text
    # positions differ: a special id decodes to nothing)
    cut = next(n for n in range(1, len(free.token_ids) + 1) if stop in tok.decode(free.token_ids[:n]))
    g = Engine(model, tok).generate(
        [prompt],
        SamplingConfig(temperature=0.9, top_k=7, top_p=0.95, max_new_tokens=30, seed=9, stop=[stop, "never"]),
    )[0]
    assert g.finish_reason == "stop" and g.stop_string == stop
    assert g.token_ids == free.token_ids[:cut]  # one row: the same draws until then
    assert g.logprobs == free.logprobs[: len(g.token_ids)]
    assert g.support.to_lists() == free.support.to_lists()[: len(g.token_ids)]
    assert g.text == free.text[:at]
    for pos, t in enumerate(g.token_ids):
        support, logps = reference(uncached_logits(model, prompt + g.token_ids[:pos]).numpy(), 0.9, 7, 0.95)
        assert set(g.support.row(pos).tolist()) == support
        assert abs(g.logprobs[pos] - logps[t]) < 1e-4


def test_eos_wins_over_stop_strings_it_cannot_complete():
    model, tok = tiny_model(1), tokenizer()
    gens = Engine(model, tok).generate(prompts(), SamplingConfig(top_k=1, max_new_tokens=20, stop=["never"]))
    plain = Engine(model, tok).generate(prompts(), SamplingConfig(top_k=1, max_new_tokens=20))
    assert [g.token_ids for g in gens] == [g.token_ids for g in plain]
    assert [g.finish_reason for g in gens] == [g.finish_reason for g in plain]
    assert all(g.stop_string is None for g in gens)
