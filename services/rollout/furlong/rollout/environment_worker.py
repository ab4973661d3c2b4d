"""The environment worker process: `python -m furlong.rollout.environment_worker NAME` hosts the
run's environments (one instance per episode) and answers its parent, one JSON line per request on
stdin with one JSON line on its original stdout (what the environments print goes to stderr).

Requests: {"op": "reset", "episode": id, "row": {...}}, {"op": "step", "episode": id, "turn":
{...}}, {"op": "close", "episode": id}. Replies: {"ok": value} or {"error": "Type: message"}. The
environment is built in the worker (its imports and set-up count against the first call's deadline
in the parent). Knows nothing about engines or the rollout service.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from furlong.rollout.core.environment import AssistantTurn, Environment
from furlong.rollout.core.tool_calls import ToolCall
from furlong.rollout.environments.registry import build_environment


def turn_from_json(d: dict[str, Any]) -> AssistantTurn:
    return AssistantTurn(
        text=str(d["text"]),
        content=d["content"],
        tool_calls=tuple(ToolCall(name=c["name"], arguments=c["arguments"]) for c in d["tool_calls"]),
        truncated=bool(d["truncated"]),
    )


def turn_to_json(turn: AssistantTurn) -> dict[str, Any]:
    return {
        "text": turn.text,
        "content": turn.content,
        "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in turn.tool_calls],
        "truncated": turn.truncated,
    }


def _handle(name: str, episodes: dict[str, Environment], request: dict[str, Any]) -> Any:
    op, episode = request["op"], str(request["episode"])
    if op == "reset":
        env = episodes[episode] = build_environment(name)
        start = env.reset(request["row"])
        return {"messages": start.messages, "tools": start.tools}
    if op == "step":
        if episode not in episodes:
            raise KeyError(f"episode {episode!r} is not open in this worker (it was restarted)")
        result = episodes[episode].step(turn_from_json(request["turn"]))
        return {"messages": result.messages, "reward": result.reward, "done": result.done}
    if op == "close":
        episodes.pop(episode, None)
        return None
    raise ValueError(f"unknown op {op!r}")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m furlong.rollout.environment_worker NAME", file=sys.stderr)
        return 2
    name = argv[0]
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # what environments print must not reach the reply channel
    sys.stdout = sys.stderr
    episodes: dict[str, Environment] = {}
    for line in sys.stdin:
        try:
            reply: dict[str, Any] = {"ok": _handle(name, episodes, json.loads(line))}
        except Exception as exc:  # noqa: BLE001 - any failure of an environment is reported to the parent
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
