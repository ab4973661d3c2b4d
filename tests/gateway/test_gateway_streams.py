"""Streams built as the engine draws: chunks are handed over before the call has finished, a client
that goes away ends the call (and the engine serves the next one), and the text pieces never send
what a stop string or a tool call will take back."""

from __future__ import annotations

import pytest
from gateway_models import write_forced_dir, write_random_dir

from furlong.core.checkpoint import load_policy
from furlong.rollout.core.engine import Engine
from furlong.rollout.core.served_models import EngineModel, StaticModels
from furlong.rollout.gateway.calls import Gateway
from furlong.rollout.gateway.streams import PieceCutter

pytestmark = pytest.mark.integration

CHAT = {"model": "random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("streams")
    out = {}
    for name, directory in (
        ("random", write_random_dir(root / "r")),
        ("forced", write_forced_dir(root / "f")),
    ):
        model, tokenizer = load_policy(directory)
        out[name] = EngineModel(name, Engine(model, tokenizer, max_batch_size=4, name=name), tokenizer)
    return out


@pytest.fixture
def gateway(models):
    return Gateway(StaticModels(list(models.values())))


def test_chunks_are_sent_while_the_call_is_still_sampling(gateway):
    seen = []

    def send(chunk):
        # the session record is written when the call has finished: none yet while tokens arrive
        seen.append((chunk, gateway.sessions.calls("s1")))

    call = gateway.prepare_chat({**CHAT, "stream": True, "temperature": 0, "max_tokens": 6}, "s1")
    gateway.stream(call, send)
    token_chunks = [c for c, record in seen if c["choices"] and "content" in c["choices"][0]["delta"]]
    assert len(token_chunks) >= 2
    assert all(record is None for c, record in seen if c["choices"][0]["finish_reason"] is None)
    assert seen[-1][0]["choices"][0]["finish_reason"] in ("stop", "length")
    [record] = gateway.sessions.calls("s1")
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c, _ in seen)
    body = gateway.reply(gateway.prepare_chat({**CHAT, "temperature": 0, "max_tokens": 6}))
    assert streamed == body["choices"][0]["message"]["content"]
    assert record.choices[0].completion_token_ids  # the record holds the drawn ids


def test_a_client_that_goes_away_ends_the_call(gateway):
    class Gone(Exception):
        pass

    sent = []

    def send(chunk):
        sent.append(chunk)
        if len(sent) == 3:
            raise Gone()

    call = gateway.prepare_chat({**CHAT, "stream": True, "max_tokens": 50, "seed": 1}, "gone")
    with pytest.raises(Gone):
        gateway.stream(call, send)
    assert len(sent) == 3 and gateway.sessions.calls("gone") is None  # nothing recorded
    after = gateway.reply(gateway.prepare_chat({**CHAT, "temperature": 0}))  # the engine still serves
    assert after["choices"][0]["finish_reason"] in ("stop", "length")


def test_bad_requests_fail_before_any_chunk(gateway):
    from furlong.rollout.gateway.requests import RequestError

    with pytest.raises(RequestError) as caught:
        gateway.prepare_chat({**CHAT, "stream": True, "max_tokens": 10**5})
    assert caught.value.param == "max_tokens"


def test_pieces_hold_back_stop_strings_and_tool_calls(models):
    tokenizer = models["random"].tokenizer

    def cut(text: str, stops=(), tools=False) -> list[str]:
        cutter = PieceCutter(tokenizer, stops, tools)
        return [cutter.push(t) for t in tokenizer.encode(text, add_bos=False)]

    # a stop string's start is held until it is known not to be one; its text is never sent
    assert "".join(cut("the quick brown fox", stops=("brown",))) == "the quick "
    assert "".join(cut("the quick brown fox", stops=("browse",))) == "the quick brown fox"
    pieces = cut("the lazy dog", stops=("lazy cat",))
    assert "".join(pieces) == "the lazy dog" and "lazy" not in "".join(pieces[:-1])
    # with tools: nothing from <tool_call> on, and no trailing whitespace before it
    sent = "".join(cut('the fox <tool_call>{"name": "x"}</tool_call>', tools=True))
    assert sent == "the fox"
    cutter = PieceCutter(tokenizer, (), True)
    for t in tokenizer.encode("the dog <tool", add_bos=False):
        cutter.push(t)
    assert cutter.sent == "the dog" and cutter.rest("the dog <tool") == " <tool"


def test_pieces_of_a_long_text_add_up_across_decode_anchors(models):
    tokenizer = models["random"].tokenizer
    text = " ".join(["the quick brown fox jumps over the lazy dog, 12+34=46 ünïcødé ✓"] * 12)
    ids = tokenizer.encode(text, add_bos=False)
    assert len(ids) > 3 * 64  # the anchor moves several times
    cutter = PieceCutter(tokenizer, (), False)
    pieces = [cutter.push(t) for t in ids]
    assert "".join(pieces) + cutter.rest(tokenizer.decode(ids)) == tokenizer.decode(ids)
    assert sum(1 for p in pieces if p) > len(ids) // 4  # sent as it goes, not all at the end
