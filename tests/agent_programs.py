"""Agent programs as users write them, against the `openai` package only: the rollout service's
agent harness imports them by `module:function` and trains on what they sample."""

from __future__ import annotations

import asyncio

MODEL = "any-name"  # an agent keeps its own model name: the harness serves the run's policy


async def two_turn_chat(row, client):
    """Asks, then follows up on its own answer; the reward is whether the second answer's length is
    even (it varies within a group)."""
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0.7
    )
    reply = first.choices[0].message.content or ""
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "again"}]
    second = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
    return float(len(second.choices[0].message.content or "") % 2 == 0)


async def raises_on_row_1(row, client):
    if row["metadata"]["index"] == 1:
        raise RuntimeError("the agent's tool crashed")
    return await two_turn_chat(row, client)


async def hangs(row, client):
    await asyncio.sleep(3600)
    return 0.0


def not_async(row, client):
    return 0.0
