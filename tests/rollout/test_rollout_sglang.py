"""The SGLang adapter against a fake SGLang HTTP server on 127.0.0.1 (the CPU stand-in for a real
server; `test_rollout_sglang_gpu.py` runs the same contract against SGLang on a GPU)."""

from __future__ import annotations

import pytest

import sglang_contract as contract
from fake_sglang import FakeSGLang
from furlong.core.errors import UnavailableError
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.sglang import SGLangEngine
from rollout_models import reference, uncached_logits, write_checkpoint

pytestmark = pytest.mark.integration


@pytest.fixture
def fake(tmp_path):
    server = FakeSGLang(str(write_checkpoint(tmp_path / "v0", seed=51)))
    yield server
    server.close()


def adapter(fake: FakeSGLang) -> SGLangEngine:
    return SGLangEngine(fake.url, fake.tokenizer, fake.engine.vocab_size, timeout_s=60.0)


def test_contract_against_the_fake_server(fake, tmp_path):
    engine = adapter(fake)
    assert engine.healthy()
    gens = contract.check_generate_records_exact_draws(engine)
    greedy = contract.check_greedy_is_singleton(engine)
    contract.check_ignore_eos_runs_to_the_limit(engine)
    contract.check_bad_request_is_a_value_error(engine)
    contract.check_pause_holds_generation_until_resumed(engine)
    contract.check_weight_update_from_disk(engine, str(write_checkpoint(tmp_path / "v1", seed=52)), greedy)
    contract.check_unreachable_server(fake.tokenizer, fake.engine.vocab_size)
    paths = [p for p, _ in fake.requests]
    update = paths.index("/update_weights_from_disk")
    assert paths[update - 1] == "/pause_generation" and paths[update + 1:update + 3] == [
        "/flush_cache", "/continue_generation"]
    assert fake.weight_version == str(engine.policy_version)
    body = next(b for p, b in fake.requests if p == "/generate")
    assert body["return_logprob"] is True and body["return_sampling_mask"] is True
    assert body["sampling_params"]["sampling_seed"] == 7 and body["sampling_params"]["top_k"] == 6


def test_adapter_records_what_the_model_computes(fake):
    """Against the fake, the adapter's log-probs and supports equal a recomputation from the weights."""
    engine = adapter(fake)
    model, tok = fake.engine.model, fake.tokenizer
    config = SamplingConfig(temperature=0.8, top_k=5, top_p=0.85, max_new_tokens=6, seed=3)
    for prompt, g in zip(contract.PROMPTS, engine.generate(contract.PROMPTS, config)):
        assert g.text == tok.decode(g.token_ids)
        for pos, t in enumerate(g.token_ids):
            support, logps = reference(uncached_logits(model, prompt + g.token_ids[:pos]).numpy(), 0.8, 5, 0.85)
            assert set(g.support.row(pos).tolist()) == support
            assert abs(g.logprobs[pos] - logps[t]) < 1e-4


def test_malformed_responses_are_errors_not_guesses(fake, monkeypatch):
    engine = adapter(fake)
    original = fake.generate

    def broken(body):
        status, out = original(body)
        out[0]["meta_info"]["output_sampling_mask"]["token_ids"][0] = (
            out[0]["output_ids"][0] + 1) % fake.engine.vocab_size
        return status, out

    monkeypatch.setattr(fake, "generate", broken)
    with pytest.raises(UnavailableError, match="row 0: token .* is not a finite draw from its support"):
        engine.generate(contract.PROMPTS, SamplingConfig(top_k=1, max_new_tokens=2))
    with pytest.raises(ValueError, match="base_url must be an http"):
        SGLangEngine("127.0.0.1:1", fake.tokenizer, fake.engine.vocab_size)
