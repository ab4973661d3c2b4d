"""Environments for the rollout tests, imported by name in the environment worker processes (so no
torch here). `CountingEnvironment` answers every assistant turn with a tool message that names the
turn and the length of what the policy wrote, rewards 0.25 per turn and ends after three turns (or
the row's metadata "turns"); a row whose metadata says "crash" or "hang" makes its step kill the
worker or never answer."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from furlong.rollout.core.environment import AssistantTurn, EpisodeStart, StepResult

TURNS = 3
TURN_REWARD = 0.25
COUNT_TOOL = {
    "type": "function",
    "function": {"name": "count", "parameters": {"type": "object", "properties": {}}},
}


def tool_answer(turn: int, text: str) -> str:
    return f"turn {turn}: {len(text)} chars"


class CountingEnvironment:
    def __init__(self) -> None:
        self._turn = 0
        self._turns = TURNS
        self._mode = ""

    def reset(self, row: Mapping[str, Any]) -> EpisodeStart:
        self._turn = 0
        self._mode = str(row["metadata"].get("mode", ""))
        self._turns = int(row["metadata"].get("turns", TURNS))
        if self._mode == "hang_reset":
            time.sleep(3600)
        return EpisodeStart(messages=list(row["messages"]), tools=[COUNT_TOOL])

    def step(self, turn: AssistantTurn) -> StepResult:
        self._turn += 1
        if self._mode == "crash":
            os._exit(3)
        if self._mode == "hang":
            time.sleep(3600)
        done = self._turn >= self._turns
        messages = [] if done else [{"role": "tool", "content": tool_answer(self._turn, turn.text)}]
        return StepResult(messages=messages, reward=TURN_REWARD, done=done)


class NotAnEnvironment:
    pass
