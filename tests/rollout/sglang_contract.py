"""Contract checks of the SGLang adapter, shared by the fake-server tests (CPU) and the GPU script
against a real SGLang server.

The request and response field names are SGLang's, read from its source at commit
001067fffe33427bee0ed2f007fb7551a1d76b44 (sgl-project/sglang main; the snapshot read carried no
`version.py`, so the release that commit belongs to is not pinned down here):
`python/sglang/srt/managers/io_struct.py` (`GenerateReqInput`: `input_ids`, `sampling_params`,
`return_logprob`, `return_sampling_mask`) and `python/sglang/srt/managers/tokenizer_manager.py`
(`meta_info`: `output_token_logprobs`, `output_token_sampling_mask`,
`output_token_sampling_logprobs`, `output_token_sampling_mask_length`, `finish_reason`,
`prompt_tokens`, `completion_tokens`, `weight_version`). Sampling masks came with
sgl-project/sglang#27408 (merged 2026-06-06; v0.5.2, the former image pin, predates them) and need
a finite `top_k` (#35205, opened 2026-08-17). The deploy image pins v0.5.20 (released 2026-09-18,
a release tag named in the material read); that it returns these fields is untested here (it needs
a GPU: `test_rollout_sglang_gpu.py`). Every check samples with a finite top_k for that reason;
`check_unbounded_support_is_refused` holds the servers that enforce it (the real one, the strict
stand-in) to it. Each takes a connected `SGLangEngine` (or several) and asserts on
values. The weight-update checks compare generation after the update with `expected`, the
`fingerprint` of what the same weights must generate (on CPU: a built-in engine loaded with them;
on a GPU: the same server after loading them from disk)."""

from __future__ import annotations

import threading
import time

import pytest

from furlong.core.errors import UnavailableError
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.sglang import SGLangEngine
from furlong.rollout.weight_update_group import WeightUpdateGroup

PROMPTS = [[1, 4, 5, 13, 6, 14], [1, 7, 13, 8, 14], [1, 12, 12, 13, 3, 14]]
SAMPLED = SamplingConfig(temperature=0.9, top_k=6, top_p=0.9, max_new_tokens=8, seed=11)


def fingerprint(gens) -> list[tuple[list[int], list[float], list[list[int]]]]:
    """What must match bit for bit between two engines with the same weights: tokens, log-probs
    and supports of `SAMPLED` on `PROMPTS`."""
    return [(list(g.token_ids), list(g.logprobs), g.support.to_lists()) for g in gens]


def served_fingerprint(engine) -> list:
    return fingerprint(engine.generate(PROMPTS, SAMPLED))


def check_generate_records_exact_draws(engine: SGLangEngine) -> list:
    config = SamplingConfig(temperature=0.9, top_k=6, top_p=0.9, max_new_tokens=8, seed=7)
    gens = engine.generate(PROMPTS * 2, config)
    assert len(gens) == 6
    for g in gens:
        assert 1 <= len(g.token_ids) <= 8 and len(g.logprobs) == g.support.num_rows == len(g.token_ids)
        for pos, tok in enumerate(g.token_ids):
            row = g.support.row(pos)
            assert tok in row and 1 <= row.size <= 6
            assert g.logprobs[pos] <= 0.0
        assert g.finish_reason in ("eos", "length", "stop")
        assert g.policy_version == engine.policy_version
    again = engine.generate(PROMPTS * 2, config)
    assert [g.token_ids for g in again] == [g.token_ids for g in gens]  # sampling_seed holds
    return gens


def check_greedy_is_singleton(engine: SGLangEngine) -> list[list[int]]:
    gens = engine.generate(PROMPTS, SamplingConfig(top_k=1, max_new_tokens=6))
    for g in gens:
        assert g.support.to_lists() == [[t] for t in g.token_ids]
        assert all(abs(lp) < 1e-6 for lp in g.logprobs)
    return [g.token_ids for g in gens]


def check_ignore_eos_runs_to_the_limit(engine: SGLangEngine) -> None:
    gens = engine.generate(PROMPTS, SamplingConfig(top_k=6, max_new_tokens=5, seed=1), ignore_eos=True)
    assert [len(g.token_ids) for g in gens] == [5, 5, 5]
    assert {g.finish_reason for g in gens} == {"length"}


def check_bad_request_is_a_value_error(engine: SGLangEngine) -> None:
    with pytest.raises(ValueError, match="/generate"):
        engine.generate([[1, engine.vocab_size + 5]], SamplingConfig(top_k=4, max_new_tokens=2))
    assert engine.healthy()
    assert len(engine.generate(PROMPTS[:1], SamplingConfig(top_k=4, max_new_tokens=2))) == 1


def check_unbounded_support_is_refused(engine: SGLangEngine) -> None:
    """A server that returns sampling masks only for a finite top_k answers 400: a ValueError."""
    with pytest.raises(ValueError, match="top_k"):
        engine.generate(PROMPTS[:1], SamplingConfig(top_k=0, max_new_tokens=2))
    assert engine.healthy()


def check_pause_holds_generation_until_resumed(engine: SGLangEngine) -> None:
    engine.pause()
    done = threading.Event()
    worker = threading.Thread(
        target=lambda: (engine.generate(PROMPTS[:1], SamplingConfig(top_k=4, max_new_tokens=2)), done.set())
    )
    worker.start()
    try:
        assert not done.wait(0.5)
    finally:
        engine.resume()
    assert done.wait(60)
    worker.join(10)


def check_weight_update_from_disk(
    engine: SGLangEngine, new_model_dir: str, greedy_before: list[list[int]]
) -> None:
    version = engine.policy_version + 1
    engine.update_weights_from_disk(version, new_model_dir)
    assert engine.policy_version == version and engine.wait_for_version(version, 0.0)
    after = engine.generate(PROMPTS, SamplingConfig(top_k=1, max_new_tokens=6))
    assert {g.policy_version for g in after} == {version}
    assert [g.token_ids for g in after] != greedy_before
    with pytest.raises(ValueError, match="older than the served version"):
        engine.update_weights_from_disk(version - 1, new_model_dir)
    engine.update_weight_version(version + 1)
    assert engine.policy_version == version + 1


def check_unreachable_server(tokenizer, vocab_size: int) -> None:
    dead = SGLangEngine("http://127.0.0.1:9", tokenizer, vocab_size, timeout_s=2.0)
    assert not dead.healthy()
    started = time.monotonic()
    with pytest.raises(UnavailableError, match="cannot reach http://127.0.0.1:9"):
        dead.generate(PROMPTS, SamplingConfig())
    assert time.monotonic() - started < 10


def check_weight_update_from_tensor(engine: SGLangEngine, named_tensors: dict, expected: list) -> None:
    version = engine.policy_version + 1
    engine.update_weights_from_tensor(version, named_tensors)
    assert engine.policy_version == version and engine.wait_for_version(version, 0.0)
    after = engine.generate(PROMPTS, SAMPLED)
    assert {g.policy_version for g in after} == {version}
    assert fingerprint(after) == expected
    with pytest.raises(ValueError, match="older than the served version"):
        engine.update_weights_from_tensor(version - 1, named_tensors)
    assert engine.policy_version == version


def check_weight_update_from_distributed(
    engines: list[SGLangEngine], named_tensors: dict, expected: list, backend: str = "gloo"
) -> None:
    """One group over all `engines`: a full update, then a partial one (a single tensor, sent back
    unchanged) that must leave generation as it is; every engine serves each new version."""
    group = WeightUpdateGroup(engines, backend=backend, timeout_s=60.0)
    try:
        version = max(e.policy_version for e in engines) + 1
        group.update(version, named_tensors)
        for engine in engines:
            after = engine.generate(PROMPTS, SAMPLED)
            assert engine.policy_version == version and {g.policy_version for g in after} == {version}
            assert fingerprint(after) == expected, engine.name
        name = next(iter(named_tensors))
        group.update(version + 1, {name: named_tensors[name]})
        for engine in engines:
            assert engine.policy_version == version + 1
            assert served_fingerprint(engine) == expected, engine.name
        with pytest.raises(ValueError, match="older than the served version"):
            group.update(version, named_tensors)
    finally:
        group.close()
