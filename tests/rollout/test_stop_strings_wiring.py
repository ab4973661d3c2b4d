"""Stop strings where sampling parameters travel: `furlong generate --stop`, the SGLang adapter against
the fake SGLang server (it sends `stop` and reads the matched string back), the gRPC conversion, and
the run spec's sampling section."""

from __future__ import annotations

import argparse
import io
import json

import pytest
import sglang_contract as contract
from fake_sglang import FakeSGLang
from rollout_models import write_checkpoint

from furlong.controller.run_spec import parse_run_spec
from furlong.core.checkpoint import load_policy
from furlong.core.errors import UnavailableError
from furlong.core.settings import SettingError
from furlong.rollout.convert import sampling_from_proto, sampling_to_proto
from furlong.rollout.core.engine import Engine
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.generate_cli import add_commands
from furlong.rollout.sglang import SGLangEngine

pytestmark = pytest.mark.integration


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="furlong")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    out, err = io.StringIO(), io.StringIO()
    return args.func(args, out=out, err=err), out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("stop") / "ckpt", seed=61)


def cli_record(checkpoint, *extra: str) -> dict:
    rc, out, err = run_cli(
        [
            "generate",
            "--model",
            str(checkpoint),
            "--prompt",
            "12+34=",
            "--n",
            "4",
            "--max-new-tokens",
            "16",
            "--temperature",
            "1.5",
            "--seed",
            "3",
            "--json",
            *extra,
        ]
    )
    assert rc == 0, err
    return json.loads(out)


def test_cli_stop_ends_samples_and_keeps_records_aligned(checkpoint):
    free = cli_record(checkpoint)
    # A one-character stop string that some sample produces after its first token: that sample (or
    # one that stops earlier) ends with finish reason "stop".
    stop = next(ch for s in free["samples"] for ch in s["text"][1:])
    record = cli_record(checkpoint, "--stop", stop, "--stop", "99999")
    assert record["sampling"]["stop"] == [stop, "99999"]
    _, tok = load_policy(checkpoint)
    for s in record["samples"]:
        n = len(s["token_ids"])
        assert len(s["logprobs"]) == len(s["full_logprobs"]) == len(s["support"]) == n
        for pos, t in enumerate(s["token_ids"]):
            assert t in s["support"][pos]
        if s["finish_reason"] == "stop":
            # The stop string's token is kept in token_ids, cut from the text.
            assert s["stop_string"] == stop and tok.decode(s["token_ids"]) == s["text"] + stop
        else:
            assert s["stop_string"] is None and s["text"] == tok.decode(s["token_ids"])
        assert stop not in s["text"]
    assert any(s["finish_reason"] == "stop" for s in record["samples"])


def test_cli_rejects_bad_stop_strings(checkpoint):
    rc, out, err = run_cli(["generate", "--model", str(checkpoint), "--prompt", "1+1=", "--stop", ""])
    assert rc == 2 and out == ""
    assert "stop: entry 0 must be a non-empty string, got ''" in err


@pytest.fixture
def fake(tmp_path):
    server = FakeSGLang(str(write_checkpoint(tmp_path / "v0", seed=51)))
    yield server
    server.close()


def test_sglang_adapter_sends_stop_and_reads_the_match(fake):
    adapter = SGLangEngine(fake.url, fake.tokenizer, fake.engine.vocab_size, timeout_s=60.0)
    config = SamplingConfig(temperature=1.5, max_new_tokens=12, seed=4)
    free = Engine(fake.engine.model, fake.tokenizer).generate(contract.PROMPTS, config)
    stop = next(ch for g in free for ch in g.text[1:])
    stopped_config = SamplingConfig(temperature=1.5, max_new_tokens=12, seed=4, stop=[stop])
    gens = adapter.generate(contract.PROMPTS, stopped_config)
    body = next(b for p, b in fake.requests if p == "/generate")
    assert body["sampling_params"]["stop"] == [stop]
    direct = Engine(fake.engine.model, fake.tokenizer).generate(contract.PROMPTS, stopped_config)
    assert [g.token_ids for g in gens] == [g.token_ids for g in direct]
    assert [g.finish_reason for g in gens] == [g.finish_reason for g in direct]
    assert [g.text for g in gens] == [g.text for g in direct]
    assert any(g.finish_reason == "stop" for g in gens)
    for g in gens:
        assert g.stop_string == (stop if g.finish_reason == "stop" else None)
        assert len(g.logprobs) == g.support.num_rows == len(g.token_ids)
    # Without stop strings the body carries none (SGLang's default).
    adapter.generate(contract.PROMPTS, config)
    assert "stop" not in [b for p, b in fake.requests if p == "/generate"][-1]["sampling_params"]


def test_sglang_adapter_refuses_a_match_it_did_not_ask_for(fake, monkeypatch):
    adapter = SGLangEngine(fake.url, fake.tokenizer, fake.engine.vocab_size, timeout_s=60.0)
    original = fake.generate

    def wrong_match(body):
        status, out = original(body)
        out[0]["meta_info"]["finish_reason"] = {"type": "stop", "matched": "zz"}
        return status, out

    monkeypatch.setattr(fake, "generate", wrong_match)
    with pytest.raises(UnavailableError, match="matched 'zz', which is not one of the request's"):
        adapter.generate(contract.PROMPTS, SamplingConfig(top_k=1, max_new_tokens=2, stop=["="]))


def test_stop_strings_travel_in_protos_and_run_specs():
    config = SamplingConfig(top_p=0.5, stop=["\n", "=="])
    assert sampling_from_proto(sampling_to_proto(config)) == config
    msg = sampling_to_proto(SamplingConfig())
    msg.stop.append("")
    with pytest.raises(ValueError, match=r"^sampling.stop: entry 0 must be a non-empty string, got ''"):
        sampling_from_proto(msg)
    base = {"name": "r", "model": "/m", "task": "addition", "steps": 1}
    spec = parse_run_spec({**base, "sampling": {"stop": ["\n", "="]}})
    assert spec.sampling.stop == ("\n", "=")
    assert parse_run_spec(spec.to_dict()) == spec
    with pytest.raises(SettingError, match=r"^sampling.stop: must be a list of strings"):
        parse_run_spec({**base, "sampling": {"stop": "\n"}})
    with pytest.raises(SettingError, match=r"^sampling.stop: entry 1 must be a non-empty string"):
        parse_run_spec({**base, "sampling": {"stop": ["a", ""]}})
