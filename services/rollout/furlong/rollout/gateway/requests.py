"""OpenAI request bodies (`/v1/chat/completions`, `/v1/completions`) parsed into checked, frozen
requests, once. A bad value is a `RequestError` naming the parameter (OpenAI's `param`) and the
value; the HTTP layer answers it with 400. Nothing is clamped or guessed: an argument OpenAI
defines that this gateway cannot honour (a penalty, `logit_bias`, forced tool choice, `echo`) is
refused unless it has its neutral value, and an argument OpenAI does not define is refused too.

Pure: no HTTP, no engine.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from furlong.core.settings.sampling import MAX_NEW_TOKENS
from furlong.rollout.core.sampling import MAX_SEED, MAX_STOP_CHARS, MAX_STOP_STRINGS
from furlong.rollout.core.token_scores import MAX_TOP_LOGPROBS

MAX_N = 128
MAX_TEMPERATURE = 2.0
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound for /v1/completions' `logprobs`
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# Arguments accepted when they carry their neutral value (anything else cannot be honoured).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "logit_bias": (None, {}),
    "echo": (False, None),
    "suffix": (None,),
    "parallel_tool_calls": (True, None),
    "response_format": (None, {"type": "text"}),
}
# Accepted and not used (bookkeeping that changes no token).
_IGNORED = ("user", "metadata", "store", "service_tier")
_SAMPLING = ("n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "stop", "seed", "stream")
CHAT_ARGS = frozenset(
    ("model", "messages", "tools", "tool_choice", "logprobs", "top_logprobs", "max_completion_tokens")
    + ("stream_options",)
    + _SAMPLING
    + _IGNORED
    + tuple(k for k in _NEUTRAL if k not in ("echo", "suffix"))
)
TEXT_ARGS = frozenset(
    ("model", "prompt", "logprobs", "best_of", "stream_options") + _SAMPLING + _IGNORED + tuple(_NEUTRAL)
)


class RequestError(ValueError):
    """A bad request: `param` names the argument (None for the body itself)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True)
class Sampling:
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_tokens: int | None  # None: the rest of the model's context
    stop: tuple[str, ...]
    seed: int  # drawn at random when the request gives none
    stream: bool
    include_usage: bool  # stream_options.include_usage


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None
    parse_tools: bool  # tool_choice "auto" with tools: tool calls are parsed from the output
    sampling: Sampling
    logprobs: bool
    top_logprobs: int

    @property
    def tool_names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools or ())


@dataclass(frozen=True)
class TextRequest:
    model: str
    prompts: tuple[str | tuple[int, ...], ...]  # text, or token ids given as they are
    sampling: Sampling
    logprobs: int | None  # None: no log-probs; k: the token's and its k most probable alternatives


def _body(body: object, allowed: frozenset[str]) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
    for name, neutral in _NEUTRAL.items():
        if name in body and not _is_neutral(body[name], neutral):
            raise RequestError(
                f"{name}={body[name]!r} is not supported by this server (only {neutral[0]!r})", name
            )
    return body


def _is_neutral(value: object, neutral: tuple[Any, ...]) -> bool:
    if isinstance(value, bool):  # True == 1 in Python: compare booleans by identity
        return any(v is value for v in neutral)
    return any(value == v and not isinstance(v, bool) for v in neutral)


def _int(body: Mapping[str, Any], name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(f"{name} must be an integer in [{low}, {high}], got {value!r}", name)
    return value


def _number(
    body: Mapping[str, Any], name: str, default: float, low: float, high: float, open_low: bool
) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > high or value < low or (open_low and value == low):
        interval = f"{'(' if open_low else '['}{low:g}, {high:g}]"
        raise RequestError(f"{name} must be a number in {interval}, got {value!r}", name)
    return float(value)


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}", name)
    return value


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
    ):
        raise RequestError(
            f"stop must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings of at most "
            f"{MAX_STOP_CHARS} characters, got {value!r}",
            "stop",
        )
    return tuple(stops)


def _sampling(body: Mapping[str, Any], max_tokens_names: Sequence[str]) -> Sampling:
    max_tokens = None
    for name in max_tokens_names:
        given = _int(body, name, None, 1, MAX_NEW_TOKENS)
        if given is not None:
            if max_tokens is not None and given != max_tokens:
                raise RequestError(f"{name}={given} contradicts {max_tokens_names[0]}={max_tokens}", name)
            max_tokens = given
    seed = _int(body, "seed", None, 0, MAX_SEED)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise RequestError("stream_options is only allowed with stream=true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise RequestError(
                f"stream_options must be {{'include_usage': bool}}, got {options!r}", "stream_options"
            )
        include_usage = _bool(options, "include_usage", False)
    n = _int(body, "n", 1, 1, MAX_N)
    assert n is not None
    top_k = _int(body, "top_k", 0, -1, 1 << 20)
    assert top_k is not None
    return Sampling(
        n=n,
        temperature=_number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE, open_low=False),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
        top_k=max(top_k, 0),  # vLLM's -1 and 0 both mean off
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0, open_low=False),
        max_tokens=max_tokens,
        stop=_stop(body.get("stop")),
        seed=secrets.randbelow(MAX_SEED + 1) if seed is None else seed,
        stream=stream,
        include_usage=include_usage,
    )


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(f"model must be a non-empty string, got {model!r}", "model")
    return model


def _content(i: int, role: str, content: object) -> str | None:
    """A message's content as text: a string, or a list of text parts (joined)."""
    where = f"messages[{i}].content"
    if content is None:
        if role in ("assistant",):
            return None
        raise RequestError(f"{where} is required for a {role} message", where)
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(
                    f"{where}[{j}] must be a text part {{'type': 'text', 'text': ...}}; "
                    f"this server takes text only, got {kind!r}",
                    f"{where}[{j}]",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(
        f"{where} must be a string or a list of text parts, got {type(content).__name__}", where
    )


def _messages(value: object) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not value:
        raise RequestError(f"messages must be a non-empty list, got {value!r}", "messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{i}] must be an object, got {message!r}", f"messages[{i}]")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise RequestError(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                f"messages[{i}].role",
            )
        checked = dict(message)
        checked["content"] = _content(i, role, message.get("content"))
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise RequestError(
                    f"messages[{i}].tool_calls must be a list on an assistant message",
                    f"messages[{i}].tool_calls",
                )
            for j, call in enumerate(calls):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise RequestError(
                        f"messages[{i}].tool_calls[{j}] must be {{'type': 'function', 'function': "
                        f"{{'name': ..., 'arguments': ...}}}}, got {call!r}",
                        f"messages[{i}].tool_calls[{j}]",
                    )
        if role == "assistant" and checked["content"] is None and not calls:
            raise RequestError(
                f"messages[{i}] (assistant) needs content or tool_calls", f"messages[{i}].content"
            )
        out.append(checked)
    return tuple(out)


def _tools(value: object) -> tuple[dict[str, Any], ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise RequestError(f"tools must be a list, got {type(value).__name__}", "tools")
    names: set[str] = set()
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(name, str)
            or not name
        ):
            raise RequestError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}, "
                f"got {tool!r}",
                f"tools[{i}]",
            )
        if name in names:
            raise RequestError(f"tools[{i}]: function name {name!r} is declared twice", f"tools[{i}]")
        names.add(name)
    return tuple(dict(t) for t in value) or None


def _tool_choice(value: object, tools: tuple[dict[str, Any], ...] | None) -> bool:
    """Whether tool calls are parsed: "auto" (the default with tools) or "none"."""
    if value is None:
        return tools is not None
    if value == "none":
        return False
    if value == "auto":
        if tools is None:
            raise RequestError("tool_choice 'auto' needs tools", "tool_choice")
        return True
    raise RequestError(
        f"tool_choice {value!r} is not supported: this server cannot force a tool call (it does not "
        "constrain decoding); use 'auto' or 'none'",
        "tool_choice",
    )


def parse_chat(body: object) -> ChatRequest:
    checked = _body(body, CHAT_ARGS)
    tools = _tools(checked.get("tools"))
    logprobs = _bool(checked, "logprobs", False)
    top = _int(checked, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    assert top is not None
    if top and not logprobs:
        raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
    return ChatRequest(
        model=_model(checked),
        messages=_messages(checked.get("messages")),
        tools=tools,
        parse_tools=_tool_choice(checked.get("tool_choice"), tools),
        sampling=_sampling(checked, ("max_completion_tokens", "max_tokens")),
        logprobs=logprobs,
        top_logprobs=top,
    )


def _prompts(value: object) -> tuple[str | tuple[int, ...], ...]:
    def ids(v: object) -> bool:
        return (
            isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
        )

    if isinstance(value, str):
        return (value,)
    if ids(value):
        assert isinstance(value, list)
        return (tuple(value),)
    if isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        return tuple(value)
    if isinstance(value, list) and value and all(ids(p) for p in value):
        return tuple(tuple(p) for p in value)
    raise RequestError(
        "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids, "
        f"got {str(value)[:200]!r}",
        "prompt",
    )


def parse_text(body: object) -> TextRequest:
    checked = _body(body, TEXT_ARGS)
    sampling = _sampling(checked, ("max_tokens",))
    best_of = checked.get("best_of")
    if best_of is not None and best_of != sampling.n:
        raise RequestError(
            f"best_of={best_of!r} is not supported (only best_of = n = {sampling.n})", "best_of"
        )
    return TextRequest(
        model=_model(checked),
        prompts=_prompts(checked.get("prompt")),
        sampling=sampling,
        logprobs=_int(checked, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS),
    )
