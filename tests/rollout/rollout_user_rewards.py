"""User reward callables referenced by `module:function` in the rollout reward tests."""


def length_reward(response_text, answer):
    return float(len(response_text))


def needs_three(response_text, answer, extra):
    return 0.0


not_callable = 3


def contains_answer(response_text, answer, metadata=None):
    """Sync, with metadata: 1 when the answer is in the response, times the row's `scale`."""
    scale = float((metadata or {}).get("scale") or 1.0)
    return scale * float(answer in response_text)


async def async_length(response_text, answer):
    import asyncio

    await asyncio.sleep(0)
    return float(len(response_text)) / 10.0
