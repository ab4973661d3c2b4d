"""The Hermes tool-call parser on strings: calls, content before them, and every malformed form
returned as plain content (all or nothing)."""

from __future__ import annotations

import json

import pytest

from furlong.rollout.core.tool_calls import ParsedOutput, ToolCall, parse_tool_calls

pytestmark = pytest.mark.unit

TOOLS = ("get_weather", "add")


def test_one_call_without_content():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed == ParsedOutput(None, (ToolCall("get_weather", '{"city": "Paris"}'),))
    assert json.loads(parsed.tool_calls[0].arguments) == {"city": "Paris"}


def test_content_before_two_calls_and_string_arguments():
    text = (
        'Let me check.\n<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>\n'
    )
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.content == "Let me check."
    assert [c.name for c in parsed.tool_calls] == ["add", "get_weather"]
    assert json.loads(parsed.tool_calls[0].arguments) == {"a": 1, "b": 2}
    assert json.loads(parsed.tool_calls[1].arguments) == {"city": "Zürich"}


def test_missing_arguments_is_an_empty_object():
    parsed = parse_tool_calls('<tool_call>{"name": "add"}</tool_call>', TOOLS)
    assert parsed.tool_calls == (ToolCall("add", "{}"),)


def test_text_without_calls_is_content():
    assert parse_tool_calls("just words", TOOLS) == ParsedOutput("just words", ())
    assert parse_tool_calls("", TOOLS) == ParsedOutput("", ())


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}',  # unterminated
        "<tool_call>not json</tool_call>",
        '<tool_call>["get_weather"]</tool_call>',
        '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>',  # not offered
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
        '<tool_call>{"name": "add", "arguments": "not json"}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {}, "extra": 1}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {}}</tool_call> and then more text',
    ],
)
def test_malformed_calls_are_returned_as_content(text):
    assert parse_tool_calls(text, TOOLS) == ParsedOutput(text, ())
