"""Tool calls in a model's output, in the Hermes form that Qwen's chat templates teach:

    some optional text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call><tool_call>
    ...
    </tool_call>

`parse_tool_calls(text, tool_names)` returns the text before the first `<tool_call>` (without its
trailing whitespace; None when nothing else is left) and the calls in order. It is all or nothing: when any
block is unterminated, is not a JSON object with a string `name` and an object (or JSON-string)
`arguments`, names a tool that was not offered, or text other than whitespace follows a block, the
output is not a tool call and the whole text is returned as content with no calls (a model's
malformed attempt is shown as it is, never half-executed). Knows nothing about tokens or the wire
format.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (what OpenAI's `function.arguments` holds)


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: tuple[ToolCall, ...]


def parse_tool_calls(text: str, tool_names: Collection[str]) -> ParsedOutput:
    """See the module docstring. `tool_names`: the functions the request offered."""
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return ParsedOutput(text, ())
    calls: list[ToolCall] = []
    rest = text[start:]
    while rest:
        if not rest.startswith(TOOL_CALL_OPEN):
            return ParsedOutput(text, ())
        end = rest.find(TOOL_CALL_CLOSE)
        if end < 0:
            return ParsedOutput(text, ())
        call = _one_call(rest[len(TOOL_CALL_OPEN) : end], tool_names)
        if call is None:
            return ParsedOutput(text, ())
        calls.append(call)
        rest = rest[end + len(TOOL_CALL_CLOSE) :].lstrip()
    content = text[:start].rstrip()
    return ParsedOutput(content if content.strip() else None, tuple(calls))


def _one_call(body: str, tool_names: Collection[str]) -> ToolCall | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or set(data) - {"name", "arguments"}:
        return None
    name, arguments = data.get("name"), data.get("arguments", {})
    if not isinstance(name, str) or name not in tool_names:
        return None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))
