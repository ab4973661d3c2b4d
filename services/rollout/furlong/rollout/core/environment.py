"""The protocol a multi-turn environment implements, and the values that cross it.

An episode: `reset(row)` gives the conversation's first messages (and the tools offered, as
OpenAI function schemas); then, turn after turn, the policy writes an assistant turn and
`step(turn)` answers with the messages that follow it (`tool` results, a `user` observation), a
reward for the turn and whether the episode is done. The episode's reward is the sum of its turns'
rewards. Everything that crosses the protocol is plain JSON (an environment runs in a worker
process, see `furlong.rollout.environment_workers`).

Environment failures are infrastructure failures (`EnvironmentFailure`), never a reward of 0.
Knows nothing about tokens, engines or processes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from furlong.rollout.core.tool_calls import ToolCall

ERROR = "error"
TIMEOUT = "timeout"
FAILURE_KINDS = (ERROR, TIMEOUT)
MESSAGE_ROLES = ("system", "user", "assistant", "tool")


class EnvironmentFailure(RuntimeError):
    """An environment raised, overran its deadline or its worker died. `kind`: error | timeout."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class EpisodeStart:
    messages: list[dict[str, Any]]  # the chat before the first assistant turn
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI {"type": "function", ...} schemas

    def __post_init__(self) -> None:
        check_messages(self.messages, "reset", allow_empty=False)
        for i, tool in enumerate(self.tools):
            if not isinstance(tool, Mapping) or not tool_name(tool):
                raise ValueError(f"reset: tool {i} is not an OpenAI function schema with a name: {tool!r}")

    @property
    def tool_names(self) -> list[str]:
        return [tool_name(t) for t in self.tools]


@dataclass(frozen=True)
class AssistantTurn:
    """What the policy wrote: its text (special tokens dropped), the text before any tool call,
    and the tool calls parsed from it (in the chat template's tool-call form)."""

    text: str
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    truncated: bool = False  # the turn hit its token budget before its end-of-turn token

    def message(self) -> dict[str, Any]:
        """The turn as an OpenAI assistant message."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or ""}
        if self.tool_calls:
            msg["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        return msg


@dataclass(frozen=True)
class StepResult:
    messages: list[dict[str, Any]]  # what follows the assistant turn (tool results, observations)
    reward: float
    done: bool

    def __post_init__(self) -> None:
        check_messages(self.messages, "step", allow_empty=True)
        if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)):
            raise ValueError(f"step: reward must be a number, got {self.reward!r}")
        if not math.isfinite(self.reward):
            raise ValueError(f"step: reward {self.reward} is not finite")
        if not isinstance(self.done, bool):
            raise ValueError(f"step: done must be true or false, got {self.done!r}")
        if not self.done and not self.messages:
            raise ValueError("step: an episode that is not done must answer with at least one message")


class Environment(Protocol):
    """One episode at a time per instance; `reset` starts a new one. Called from one thread. A
    method that raises fails the episode (an infrastructure failure). Deterministic given the row
    where it can be, so that a repeated step draws the same episodes."""

    def reset(self, row: Mapping[str, Any]) -> EpisodeStart:
        """`row`: {"prompt", "messages", "tools", "answer", "metadata"} of the prompt's dataset row
        or task prompt ("messages" None for a plain prompt)."""
        ...

    def step(self, turn: AssistantTurn) -> StepResult: ...


def tool_name(tool: Mapping[str, Any]) -> str:
    function = tool.get("function", tool)
    name = function.get("name") if isinstance(function, Mapping) else None
    return name if isinstance(name, str) else ""


def check_messages(messages: Sequence[Any], where: str, allow_empty: bool) -> None:
    if not isinstance(messages, list) or (not messages and not allow_empty):
        raise ValueError(f"{where}: messages must be a non-empty list, got {messages!r}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in MESSAGE_ROLES:
            raise ValueError(
                f"{where}: message {i} must be a mapping with a role in {MESSAGE_ROLES}, got {m!r}"
            )
        if not isinstance(m.get("content", ""), str):
            raise ValueError(f"{where}: message {i} content must be a string, got {m.get('content')!r}")
