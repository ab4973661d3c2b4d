"""The SGLang adapter against a fake SGLang HTTP server on 127.0.0.1 (the CPU stand-in for a real
server; `test_rollout_sglang_gpu.py` runs the same contract against SGLang on a GPU)."""

from __future__ import annotations

import base64
import json
import os
import pickle
import urllib.error
import urllib.request

import pytest
import sglang_contract as contract
import torch
from fake_sglang import FakeSGLang
from rollout_models import reference, uncached_logits, write_checkpoint

from furlong.core.checkpoint import load_policy
from furlong.core.errors import UnavailableError
from furlong.rollout.core.engine import Engine
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.sglang import SGLangEngine
from furlong.rollout.tensor_payload import payload_of

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
    contract.check_generate_records_exact_draws(engine)
    greedy = contract.check_greedy_is_singleton(engine)
    contract.check_ignore_eos_runs_to_the_limit(engine)
    contract.check_bad_request_is_a_value_error(engine)
    contract.check_pause_holds_generation_until_resumed(engine)
    contract.check_weight_update_from_disk(engine, str(write_checkpoint(tmp_path / "v1", seed=52)), greedy)
    contract.check_unreachable_server(fake.tokenizer, fake.engine.vocab_size)
    paths = [p for p, _ in fake.requests]
    update = paths.index("/update_weights_from_disk")
    assert paths[update - 1] == "/pause_generation" and paths[update + 1 : update + 3] == [
        "/flush_cache",
        "/continue_generation",
    ]
    assert fake.weight_version == str(engine.policy_version)
    body = next(b for p, b in fake.requests if p == "/generate")
    assert body["return_logprob"] is True and body["return_sampling_mask"] is True
    assert body["sampling_params"]["sampling_seed"] == 7 and body["sampling_params"]["top_k"] == 6


def test_strict_fake_refuses_unbounded_supports_as_sglang_does(tmp_path):
    strict = FakeSGLang(str(write_checkpoint(tmp_path / "v0", seed=51)), strict=True)
    try:
        engine = adapter(strict)
        contract.check_unbounded_support_is_refused(engine)
        contract.check_generate_records_exact_draws(engine)
    finally:
        strict.close()


def test_adapter_records_what_the_model_computes(fake):
    """Against the fake, the adapter's log-probs and supports equal a recomputation from the weights."""
    engine = adapter(fake)
    model, tok = fake.engine.model, fake.tokenizer
    config = SamplingConfig(temperature=0.8, top_k=5, top_p=0.85, max_new_tokens=6, seed=3)
    for prompt, g in zip(contract.PROMPTS, engine.generate(contract.PROMPTS, config)):
        assert g.text == tok.decode(g.token_ids)
        for pos, t in enumerate(g.token_ids):
            support, logps = reference(
                uncached_logits(model, prompt + g.token_ids[:pos]).numpy(), 0.8, 5, 0.85
            )
            assert set(g.support.row(pos).tolist()) == support
            assert abs(g.logprobs[pos] - logps[t]) < 1e-4


def _break(fake, monkeypatch, edit):
    original = fake.generate

    def broken(body):
        status, out = original(body)
        edit(out[0]["meta_info"], out[0]["output_ids"])
        return status, out

    monkeypatch.setattr(fake, "generate", broken)


def _first_token_outside(meta, ids, vocab_size):
    meta["output_token_sampling_mask"][0][0] = (ids[0] + 1) % vocab_size


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (None, "row 0: token .* is not a finite draw from its support"),
        (lambda m, ids: m.pop("output_token_sampling_mask"), "missing 'output_token_sampling_mask'"),
        (lambda m, ids: m.pop("output_token_sampling_logprobs"), "missing 'output_token_sampling_logprobs'"),
        (lambda m, ids: m["output_token_sampling_logprobs"].append(-1.0), r"\d+ sampling log-probs do not"),
        (lambda m, ids: m["output_token_sampling_mask"][0].append(ids[0]), "lists a token id twice"),
        (lambda m, ids: m["output_token_sampling_mask"].__setitem__(0, []), "bad sampling mask"),
        (lambda m, ids: m["output_token_sampling_logprobs"].__setitem__(0, 0.5), "not a finite draw"),
    ],
)
def test_malformed_responses_are_errors_not_guesses(fake, monkeypatch, edit, words):
    engine = adapter(fake)
    vocab = fake.engine.vocab_size
    _break(fake, monkeypatch, edit or (lambda m, ids: _first_token_outside(m, ids, vocab)))
    with pytest.raises(UnavailableError, match=words):
        engine.generate(contract.PROMPTS, SamplingConfig(top_k=1, max_new_tokens=2))
    with pytest.raises(ValueError, match="base_url must be an http"):
        SGLangEngine("127.0.0.1:1", fake.tokenizer, vocab)


def test_full_vocabulary_rows_travel_as_the_extension_field(fake):
    """top_k 0 (Furlong's engine server only): every row is the whole vocabulary, sent empty and
    listed in output_token_sampling_mask_full_rows."""
    engine = adapter(fake)
    gens = engine.generate(contract.PROMPTS[:1], SamplingConfig(max_new_tokens=3, seed=2))
    assert all(gens[0].support.row_is_implicit(i) for i in range(len(gens[0].token_ids)))


def built_in_fingerprint(model_dir: str) -> list:
    """What a built-in engine loaded from `model_dir` generates for the contract's sampled config."""
    model, tok = load_policy(model_dir)
    return contract.served_fingerprint(Engine(model, tok))


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_weight_update_from_tensor_serves_exactly_the_new_weights(fake, tmp_path):
    engine = adapter(fake)
    new_dir = str(write_checkpoint(tmp_path / "v1", seed=52))
    expected = built_in_fingerprint(new_dir)
    assert contract.served_fingerprint(engine) != expected
    new_model, _ = load_policy(new_dir)
    contract.check_weight_update_from_tensor(engine, new_model.state_dict(), expected)
    assert fake.weight_version == "1"
    paths = [p for p, _ in fake.requests]
    update = paths.index("/update_weights_from_tensor")
    assert paths[update - 1] == "/pause_generation" and paths[update + 1] == "/continue_generation"
    body = fake.requests[update][1]
    assert len(body["serialized_named_tensors"]) == 1 and body["flush_cache"] is True
    assert body["weight_version"] == "1"


def test_refused_tensor_updates_name_the_problem_and_change_nothing(fake, tmp_path):
    engine = adapter(fake)
    before = contract.served_fingerprint(engine)
    state = {k: v.clone() for k, v in fake.engine.model.state_dict().items()}
    bad_shape = {**state, "lm_head.weight": torch.zeros(3, 3)}
    with pytest.raises(ValueError, match=r"lm_head.weight has shape \(3, 3\)"):
        engine.update_weights_from_tensor(1, bad_shape)
    with pytest.raises(ValueError, match="unexpected tensor.*'no.such.weight'"):
        engine.update_weights_from_tensor(1, {"no.such.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="model.norm.weight has dtype torch.int64"):
        engine.update_weights_from_tensor(1, {"model.norm.weight": torch.ones(32, dtype=torch.int64)})
    assert engine.policy_version == 0 and fake.weight_version == "0"
    assert contract.served_fingerprint(engine) == before

    text = payload_of([("model.norm.weight", torch.ones(32))]).text
    cases = {
        "serialized_named_tensors must be a list with one entry per TP rank": {
            "serialized_named_tensors": [text, text]
        },
        "load_format 'direct' is not supported": {
            "serialized_named_tensors": [text],
            "load_format": "direct",
        },
        "flush_cache must be true or false, got 'yes'": {
            "serialized_named_tensors": [text],
            "flush_cache": "yes",
        },
        "not base64": {"serialized_named_tensors": ["not base64!"]},
        "weight_version must be a string": {"serialized_named_tensors": [text], "weight_version": 3},
    }
    for message, body in cases.items():
        status, reply = post(fake.url + "/update_weights_from_tensor", body)
        assert status == 400 and message in reply["error"]["message"], (message, reply)
    assert contract.served_fingerprint(engine) == before and fake.engine.policy_version == 0


class _Exploit:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_tensor_payload_is_never_plainly_unpickled(fake, tmp_path):
    marker = tmp_path / "pwned"
    text = base64.b64encode(pickle.dumps([("model.norm.weight", _Exploit(str(marker)))])).decode()
    status, reply = post(fake.url + "/update_weights_from_tensor", {"serialized_named_tensors": [text]})
    assert status == 400 and "forbidden global posix.system" in reply["error"]["message"]
    assert not marker.exists()
    text = base64.b64encode(pickle.dumps([("model.norm.weight", 1.5)])).decode()
    status, reply = post(fake.url + "/update_weights_from_tensor", {"serialized_named_tensors": [text]})
    assert status == 400 and "list of (name, tensor) pairs" in reply["error"]["message"]
    assert fake.engine.policy_version == 0
