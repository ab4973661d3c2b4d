"""Request bodies parsed once: defaults, aliases, and every bad value refused with the parameter
named (never clamped or guessed)."""

from __future__ import annotations

import pytest

from furlong.rollout.gateway.requests import RequestError, parse_chat, parse_text

pytestmark = pytest.mark.unit

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_chat_defaults_and_values():
    request = parse_chat(CHAT)
    assert request.sampling.n == 1 and request.sampling.temperature == 1.0 and request.sampling.top_p == 1.0
    assert request.sampling.max_tokens is None and request.sampling.stop == () and not request.sampling.stream
    assert 0 <= request.sampling.seed and not request.logprobs and request.tools is None
    given = parse_chat(
        {
            **CHAT,
            "temperature": 0,
            "seed": 7,
            "stop": "\n",
            "max_completion_tokens": 5,
            "logprobs": True,
            "top_logprobs": 3,
            "n": 2,
            "user": "someone",
        }
    )
    assert (given.sampling.temperature, given.sampling.seed, given.sampling.stop) == (0.0, 7, ("\n",))
    assert (given.sampling.max_tokens, given.top_logprobs, given.sampling.n) == (5, 3, 2)


def test_text_prompts_in_every_form():
    assert parse_text({"model": "m", "prompt": "a"}).prompts == ("a",)
    assert parse_text({"model": "m", "prompt": ["a", "b"]}).prompts == ("a", "b")
    assert parse_text({"model": "m", "prompt": [1, 2]}).prompts == ((1, 2),)
    assert parse_text({"model": "m", "prompt": [[1], [2, 3]]}).prompts == ((1,), (2, 3))
    assert parse_text({"model": "m", "prompt": "a", "logprobs": 0}).logprobs == 0


def test_tools_parse_by_default_and_not_with_none():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert parse_chat({**CHAT, "tools": tools}).parse_tools
    assert parse_chat({**CHAT, "tools": tools}).tool_names == ("f",)
    assert not parse_chat({**CHAT, "tools": tools, "tool_choice": "none"}).parse_tools


@pytest.mark.parametrize(
    "change, param",
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": True}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"stop": ["", "x"]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"logprobs": 1}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"tool_choice": "required", "tools": []}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"bogus": 1}, "bogus"),
        ({"model": ""}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
        ({"max_tokens": 4, "max_completion_tokens": 5}, "max_tokens"),
    ],
)
def test_bad_chat_values_name_the_parameter(change, param):
    with pytest.raises(RequestError) as caught:
        parse_chat({**CHAT, **change})
    assert caught.value.param == param, caught.value.message


@pytest.mark.parametrize(
    "change, param",
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"logprobs": 6}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"best_of": 3}, "best_of"),
        ({"messages": []}, "messages"),  # a chat argument
    ],
)
def test_bad_text_values_name_the_parameter(change, param):
    with pytest.raises(RequestError) as caught:
        parse_text({"model": "m", "prompt": "a", **change})
    assert caught.value.param == param, caught.value.message


def test_body_must_be_an_object():
    with pytest.raises(RequestError, match="JSON object"):
        parse_chat([1, 2])


def test_the_rollout_service_flag_for_the_gateway():
    from furlong.rollout.config import RolloutServerConfig

    base = ["--port", "5001", "--metrics-port", "5002", "--redis-url", "redis://127.0.0.1:6379/0"]
    base += ["--broker", "127.0.0.1:5003"]
    assert RolloutServerConfig.from_args(base).gateway_port is None
    assert RolloutServerConfig.from_args(base + ["--gateway-port", "0"]).gateway_port == 0
    assert RolloutServerConfig.from_args(base + ["--gateway-port", "5004"]).gateway_port == 5004
    for bad in ("70000", "5001"):
        with pytest.raises(SystemExit) as caught:
            RolloutServerConfig.from_args(base + ["--gateway-port", bad])
        assert caught.value.code == 2
