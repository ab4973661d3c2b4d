"""An environment whose episode is a question answered with the help of tools: the assistant may
call the offered tools (each call answered by a `tool` message with its result) and ends the
episode with a turn without tool calls, its final answer. The reward is 1 when the final answer
(its last number, or else its stripped text) equals the row's answer, else 0; turns with tool calls
earn nothing. A tool call that the tool itself rejects (bad arguments, an error in the expression)
is answered with the error text: the policy sees its mistake, the episode goes on.

Subclasses declare `tools` (OpenAI function schemas) and implement `call`. Knows nothing about
tokens or processes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from furlong.rollout.core.environment import AssistantTurn, EpisodeStart, StepResult

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


class ToolError(ValueError):
    """A tool refused its arguments; the message is shown to the policy."""


def final_answer(text: str) -> str:
    """The last number in `text` (commas dropped), else the stripped text."""
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else text.strip()


def answer_matches(text: str, answer: str) -> bool:
    got, want = final_answer(text), answer.strip()
    try:
        return float(got) == float(want)
    except ValueError:
        return got == want


class ToolEnvironment:
    tools: list[dict[str, Any]] = []
    system_prompt: str = ""

    def __init__(self) -> None:
        self._answer = ""

    def call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """The result of tool `name` (one of `tools`); each built-in environment answers its own."""
        raise NotImplementedError(f"{type(self).__name__} does not answer tool calls ({name!r})")

    def reset(self, row: Mapping[str, Any]) -> EpisodeStart:
        self._answer = str(row.get("answer", ""))
        messages = row.get("messages")
        if messages is None:
            messages = [{"role": "user", "content": str(row.get("prompt") or "")}]
            if self.system_prompt:
                messages.insert(0, {"role": "system", "content": self.system_prompt})
        tools = list(row.get("tools") or []) or list(self.tools)
        return EpisodeStart(messages=[dict(m) for m in messages], tools=tools)

    def step(self, turn: AssistantTurn) -> StepResult:
        if not turn.tool_calls:
            return StepResult(
                messages=[], reward=float(answer_matches(turn.content or turn.text, self._answer)), done=True
            )
        results = []
        for c in turn.tool_calls:
            try:
                content = self.call(c.name, json.loads(c.arguments))
            except ToolError as exc:
                content = f"error: {exc}"
            results.append({"role": "tool", "name": c.name, "content": content})
        return StepResult(messages=results, reward=0.0, done=False)
