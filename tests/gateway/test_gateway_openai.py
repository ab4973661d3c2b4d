"""Conformance of the OpenAI-compatible gateway with the real `openai` package, over real HTTP
(uvicorn on 127.0.0.1, a free port) in front of the built-in engine on tiny Qwen3 directories:
models, chat and text completions equal to transformers' greedy generation, streaming equal to
non-streaming, log-probs equal to transformers' log-softmax, `n`, seeds, stop strings, tool calls
parsed from a model forced to call one, session records token-exact, and bad requests refused
with 4xx in OpenAI's error format."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from gateway_models import CALL, ENDOFTEXT_ID, IM_END_ID, write_forced_dir, write_random_dir

from furlong.core.checkpoint import load_policy
from furlong.rollout.core.engine import Engine
from furlong.rollout.core.served_models import EngineModel, StaticModels
from furlong.rollout.gateway.app import create_app
from furlong.rollout.gateway.calls import Gateway
from furlong.service_main.http_server import HttpServer

pytestmark = pytest.mark.integration

RANDOM, FORCED, SECOND_EOS = "tiny-qwen3", "forced-qwen3", "forced-second-eos"
MESSAGES = [
    {"role": "system", "content": "you add numbers"},
    {"role": "user", "content": "what is 12+34?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gateway")
    return {
        RANDOM: write_random_dir(root / "random"),
        FORCED: write_forced_dir(root / "forced"),
        # ends its answer with the second of two EOS ids its generation config declares
        SECOND_EOS: write_forced_dir(root / "second", end_id=ENDOFTEXT_ID, eos_ids=(IM_END_ID, ENDOFTEXT_ID)),
    }


@pytest.fixture(scope="module")
def server(dirs):
    models = []
    for name, directory in dirs.items():
        model, tokenizer = load_policy(directory)
        models.append(EngineModel(name, Engine(model, tokenizer, max_batch_size=8, name=name), tokenizer))
    http = HttpServer(create_app(Gateway(StaticModels(models))), "127.0.0.1", 0).start()
    yield http.url
    http.stop(5.0)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference(dirs):
    """transformers' own model and tokenizer of each directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = {}
    for name, directory in dirs.items():
        model = AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True).eval()
        out[name] = (model, AutoTokenizer.from_pretrained(str(directory), local_files_only=True))
    return out


def chat_prompt_ids(tokenizer, messages, tools=None) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=IM_END_ID,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def hf_logprobs(model, prompt_ids: list[int], completion: list[int]) -> torch.Tensor:
    """log-softmax of transformers' logits at each completion position (teacher forcing)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + completion])).logits[0].float()
    return torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)


def session_client(server: str, session_id: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/sessions/{session_id}/v1", api_key="unused", max_retries=0)


def session_calls(server: str, session_id: str) -> list[dict]:
    response = httpx.get(f"{server}/sessions/{session_id}")
    assert response.status_code == 200, response.text
    return response.json()["calls"]


def test_models_list_names_every_model_with_its_policy_version(client):
    models = client.models.list()
    assert sorted(m.id for m in models.data) == sorted([RANDOM, FORCED, SECOND_EOS])
    assert all(m.object == "model" and m.owned_by == "furlong" for m in models.data)
    assert all(m.model_extra["furlong"] == {"policy_version": 0} for m in models.data)
    assert client.models.retrieve(RANDOM).id == RANDOM


def test_greedy_chat_equals_transformers_greedy_generate(server, reference):
    model, tokenizer = reference[RANDOM]
    with session_client(server, "greedy-chat") as c:
        reply = c.chat.completions.create(model=RANDOM, messages=MESSAGES, temperature=0, max_tokens=12)
    expected_prompt = chat_prompt_ids(tokenizer, MESSAGES)
    expected = hf_greedy(model, expected_prompt, 12)
    [call] = session_calls(server, "greedy-chat")
    assert call["prompt_token_ids"] == expected_prompt
    assert call["choices"][0]["completion_token_ids"] == expected
    text_ids = expected[:-1] if expected[-1] == IM_END_ID else expected
    assert reply.choices[0].message.content == tokenizer.decode(text_ids, skip_special_tokens=True)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == ("stop" if expected[-1] == IM_END_ID else "length")
    assert reply.usage.prompt_tokens == len(expected_prompt)
    assert reply.usage.completion_tokens == len(expected)
    assert reply.system_fingerprint == "furlong-policy-0"
    assert reply.model_extra["furlong"] == {"policy_version": 0, "session_id": "greedy-chat"}
    assert call["policy_version"] == 0 and call["choices"][0]["logprobs"] == [0.0] * len(expected)


def test_greedy_text_completion_equals_transformers(client, reference):
    model, tokenizer = reference[RANDOM]
    reply = client.completions.create(model=RANDOM, prompt="the quick brown", temperature=0, max_tokens=10)
    prompt_ids = tokenizer.encode("the quick brown", add_special_tokens=True)
    expected = hf_greedy(model, prompt_ids, 10)
    text_ids = expected[:-1] if expected[-1] == IM_END_ID else expected
    assert reply.object == "text_completion"
    assert reply.choices[0].text == tokenizer.decode(text_ids, skip_special_tokens=True)
    assert reply.usage.prompt_tokens == len(prompt_ids) and reply.usage.completion_tokens == len(expected)
    # token ids as the prompt: the same completion
    by_ids = client.completions.create(model=RANDOM, prompt=prompt_ids, temperature=0, max_tokens=10)
    assert by_ids.choices[0].text == reply.choices[0].text


def test_chat_logprobs_equal_transformers_log_softmax(server, reference):
    model, tokenizer = reference[RANDOM]
    with session_client(server, "logprobs") as c:
        reply = c.chat.completions.create(
            model=RANDOM,
            messages=MESSAGES,
            temperature=0.8,
            seed=11,
            max_tokens=8,
            logprobs=True,
            top_logprobs=4,
        )
    [call] = session_calls(server, "logprobs")
    prompt, completion = call["prompt_token_ids"], call["choices"][0]["completion_token_ids"]
    reference_lp = hf_logprobs(model, prompt, completion)
    content = reply.choices[0].logprobs.content
    shown = len(completion) - (1 if completion[-1] == IM_END_ID else 0)
    assert len(content) == shown
    for i, item in enumerate(content):
        assert item.token == tokenizer.decode([completion[i]])
        assert item.logprob == pytest.approx(float(reference_lp[i, completion[i]]), abs=1e-4)
        assert len(item.top_logprobs) == 4
        top_values, top_ids = torch.topk(reference_lp[i], 4)
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(top_values.tolist(), abs=1e-4)
        assert [t.token for t in item.top_logprobs] == [tokenizer.decode([j]) for j in top_ids.tolist()]
        assert item.bytes == list(item.token.encode())
    # the session keeps the sampling distribution's log-probs (temperature 0.8), not the raw ones
    tempered = torch.log_softmax(torch.log_softmax(reference_lp, -1) / 0.8, -1)
    expected = [float(tempered[i, t]) for i, t in enumerate(completion)]
    assert call["choices"][0]["logprobs"] == pytest.approx(expected, abs=1e-4)


def test_text_completion_logprobs(client, reference):
    model, tokenizer = reference[RANDOM]
    reply = client.completions.create(
        model=RANDOM, prompt="a policy", temperature=0, max_tokens=6, logprobs=2
    )
    lp = reply.choices[0].logprobs
    prompt_ids = tokenizer.encode("a policy", add_special_tokens=True)
    completion = hf_greedy(model, prompt_ids, 6)
    reference_lp = hf_logprobs(model, prompt_ids, completion)
    shown = len(completion) - (1 if completion[-1] == IM_END_ID else 0)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == shown
    for i in range(shown):
        assert lp.token_logprobs[i] == pytest.approx(float(reference_lp[i, completion[i]]), abs=1e-4)
        assert len(lp.top_logprobs[i]) <= 2
        # greedy: the drawn token is the most probable one
        assert max(lp.top_logprobs[i].values()) == pytest.approx(lp.token_logprobs[i], abs=1e-6)
    assert lp.text_offset == sorted(lp.text_offset)


def _chat_stream(client, **kw):
    chunks = list(client.chat.completions.create(stream=True, **kw))
    by_index: dict[int, dict] = {}
    for chunk in chunks:
        assert chunk.object == "chat.completion.chunk" and chunk.system_fingerprint == "furlong-policy-0"
        assert chunk.model_extra["furlong"]["policy_version"] == 0
        for choice in chunk.choices:
            entry = by_index.setdefault(
                choice.index, {"content": "", "logprobs": [], "finish": None, "calls": []}
            )
            entry["content"] += choice.delta.content or ""
            if choice.logprobs is not None:
                entry["logprobs"] += [(t.token, t.logprob) for t in choice.logprobs.content]
            if choice.delta.tool_calls:
                entry["calls"] += [(t.function.name, t.function.arguments) for t in choice.delta.tool_calls]
            if choice.finish_reason is not None:
                entry["finish"] = choice.finish_reason
    return by_index, chunks


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0},
        {"temperature": 1.0, "seed": 5, "top_p": 0.9},
        {"temperature": 1.0, "seed": 6, "stop": [" "]},
    ],
)
def test_streamed_chat_equals_the_non_streamed_reply(client, sampling):
    kw = dict(model=RANDOM, messages=MESSAGES, max_tokens=10, n=2, logprobs=True, top_logprobs=2, **sampling)
    reply = client.chat.completions.create(**kw)
    streamed, chunks = _chat_stream(client, **kw)
    assert sorted(streamed) == [0, 1]
    for choice in reply.choices:
        entry = streamed[choice.index]
        assert entry["content"] == choice.message.content
        assert entry["finish"] == choice.finish_reason
        assert entry["logprobs"] == [(t.token, t.logprob) for t in choice.logprobs.content]
    assert len({c.id for c in chunks}) == 1


def test_streamed_usage_chunk(client):
    stream = client.chat.completions.create(
        model=RANDOM,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    reply = client.chat.completions.create(model=RANDOM, messages=MESSAGES, max_tokens=4, temperature=0)
    assert chunks[-1].usage.model_dump() == reply.usage.model_dump()


def test_streamed_text_completion_equals_the_non_streamed_one(client):
    kw = dict(
        model=RANDOM, prompt=["the quick", "12+34="], max_tokens=8, temperature=0.9, seed=3, n=2, logprobs=1
    )
    reply = client.completions.create(**kw)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    texts: dict[int, str] = {}
    logprobs: dict[int, list] = {}
    finish: dict[int, str] = {}
    for chunk in client.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.logprobs is not None:
                logprobs.setdefault(choice.index, []).extend(choice.logprobs.token_logprobs)
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    for choice in reply.choices:
        assert texts[choice.index] == choice.text
        assert logprobs.get(choice.index, []) == choice.logprobs.token_logprobs
        assert finish[choice.index] == choice.finish_reason


def test_n_choices_and_seeds(client):
    kw = dict(model=RANDOM, messages=MESSAGES, max_tokens=8, temperature=1.0, n=3, seed=21)
    first = client.chat.completions.create(**kw)
    again = client.chat.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    others = [client.chat.completions.create(**{**kw, "seed": s}) for s in (22, 23)]
    contents = {tuple(c.message.content for c in r.choices) for r in [first, *others]}
    assert len(contents) > 1  # a different seed draws differently
    greedy = client.chat.completions.create(**{**kw, "temperature": 0})
    assert len({c.message.content for c in greedy.choices}) == 1


def test_stop_string_cuts_the_text(client):
    full = client.completions.create(model=RANDOM, prompt="the lazy", max_tokens=12, temperature=0)
    text = full.choices[0].text
    if len(text) < 3:
        pytest.skip(f"the greedy completion {text!r} is too short to cut")
    stop = text[2:4] if len(text) >= 4 else text[2:]
    cut = client.completions.create(
        model=RANDOM, prompt="the lazy", max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


def test_tool_calls_are_parsed_from_the_models_output(server, reference):
    _, tokenizer = reference[FORCED]
    messages = [{"role": "user", "content": "weather in Paris?"}]
    with session_client(server, "tools") as c:
        reply = c.chat.completions.create(model=FORCED, messages=messages, tools=TOOLS, temperature=0)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == CALL["name"] and json.loads(call.function.arguments) == CALL["arguments"]
        [record] = session_calls(server, "tools")
        assert record["prompt_token_ids"] == chat_prompt_ids(tokenizer, messages, TOOLS)  # tools rendered
        assert record["choices"][0]["finish_reason"] == "tool_calls"
        # the call goes back as an assistant message, the result as a tool message
        follow_up = messages + [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ]
        again = c.chat.completions.create(model=FORCED, messages=follow_up, tools=TOOLS, temperature=0)
        assert again.choices[0].finish_reason == "tool_calls"
        records = session_calls(server, "tools")
        assert records[1]["prompt_token_ids"] == chat_prompt_ids(tokenizer, follow_up, TOOLS)
        streamed, _ = _chat_stream(c, model=FORCED, messages=messages, tools=TOOLS, temperature=0)
    assert streamed[0]["finish"] == "tool_calls" and streamed[0]["content"] == ""
    assert [(n, json.loads(a)) for n, a in streamed[0]["calls"]] == [(CALL["name"], CALL["arguments"])]


def test_tool_choice_none_returns_the_text(client):
    reply = client.chat.completions.create(
        model=FORCED,
        messages=[{"role": "user", "content": "hi"}],
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
    )
    assert reply.choices[0].finish_reason == "stop" and not reply.choices[0].message.tool_calls
    assert json.dumps(CALL) in reply.choices[0].message.content


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"temperature": 7}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 100000}, "max_tokens"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"tool_choice": "required", "tools": TOOLS}, "tool_choice"),
        ({"extra_body": {"bogus_argument": 1}}, "bogus_argument"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"n": 9}, "n"),  # more sequences than the engine holds
    ],
)
def test_bad_requests_raise_bad_request_error(client, kw, param):
    args = {"model": RANDOM, "messages": MESSAGES, **kw}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**args)
    assert caught.value.status_code == 400
    error = caught.value.body
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_unknown_model_is_404_naming_it(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert "no-such-model" in caught.value.body["message"] and caught.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")


def test_malformed_bodies_get_openai_errors_never_5xx(server):
    cases = [
        ("POST", "/v1/chat/completions", b"{not json"),
        ("POST", "/v1/chat/completions", b"[]"),
        ("POST", "/v1/completions", json.dumps({"model": RANDOM}).encode()),
        ("POST", "/v1/completions", json.dumps({"model": RANDOM, "prompt": [10**9]}).encode()),
        ("GET", "/v1/chat/completions", b""),
        ("POST", "/v1/nowhere", b"{}"),
        ("GET", "/sessions/never-used", b""),
    ]
    for method, path, body in cases:
        response = httpx.request(
            method, f"{server}{path}", content=body, headers={"content-type": "application/json"}
        )
        assert 400 <= response.status_code < 500, (path, response.status_code, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_session_records_are_token_exact_and_ordered(server):
    with session_client(server, "agent-1") as c:
        first = c.chat.completions.create(model=RANDOM, messages=MESSAGES, max_tokens=5, seed=1)
        c.completions.create(model=RANDOM, prompt="12+34=", max_tokens=3, temperature=0)
    calls = session_calls(server, "agent-1")
    assert [c["kind"] for c in calls] == ["chat.completion", "text_completion"]
    assert calls[0]["response_id"] == first.id and calls[0]["seed"] == 1
    for call in calls:
        choice = call["choices"][0]
        assert len(choice["completion_token_ids"]) == len(choice["logprobs"]) >= 1
    closed = httpx.delete(f"{server}/sessions/agent-1")
    assert closed.status_code == 200 and closed.json()["calls"] == calls
    assert httpx.get(f"{server}/sessions/agent-1").status_code == 404


def test_async_client_works_too(server):
    import asyncio

    async def go() -> str:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0) as c:
            replies = await asyncio.gather(
                *[
                    c.chat.completions.create(model=RANDOM, messages=MESSAGES, max_tokens=4, temperature=0)
                    for _ in range(3)
                ]
            )
        assert len({r.choices[0].message.content for r in replies}) == 1
        return replies[0].choices[0].message.content or ""

    asyncio.run(go())


def test_every_eos_id_of_the_generation_config_ends_a_reply(server, reference):
    model, tokenizer = reference[SECOND_EOS]
    messages = [{"role": "user", "content": "hi"}]
    with session_client(server, "second-eos") as c:
        reply = c.chat.completions.create(model=SECOND_EOS, messages=messages, max_tokens=20, temperature=0)
        streamed, _ = _chat_stream(c, model=SECOND_EOS, messages=messages, max_tokens=20, temperature=0)
    plain, stream = session_calls(server, "second-eos")
    drawn = plain["choices"][0]["completion_token_ids"]
    assert stream["choices"][0]["completion_token_ids"] == drawn
    prompt = chat_prompt_ids(tokenizer, messages)
    with torch.no_grad():
        expected = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=20, pad_token_id=ENDOFTEXT_ID
        )[0, len(prompt) :].tolist()  # transformers stops at any id of the generation config
    assert drawn == expected and drawn[-1] == ENDOFTEXT_ID and len(drawn) == 4
    assert reply.choices[0].finish_reason == "stop" and streamed[0]["finish"] == "stop"
    assert (
        reply.choices[0].message.content
        == streamed[0]["content"]
        == json.dumps(CALL).join(["<tool_call>", "</tool_call>"])
    )
