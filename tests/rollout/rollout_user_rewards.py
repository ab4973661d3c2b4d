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


import threading  # noqa: E402 - the rewards below share state with the tests that use them

RELEASE = threading.Event()  # set by a test to let the hung rewards finish
CALLS: dict[str, int] = {}


def hangs_on_flagged(response_text, answer, metadata=None):
    """Hangs (until RELEASE) for rows whose metadata has hang=1; else 1.0."""
    if (metadata or {}).get("hang"):
        RELEASE.wait(120)
    return 1.0


def fails_first_time(response_text, answer, metadata=None):
    """Raises the first time each row's answer is scored; 0.5 after."""
    key = f"{answer}:{(metadata or {}).get('index')}"
    CALLS[key] = CALLS.get(key, 0) + 1
    if (metadata or {}).get("flaky") and CALLS[key] <= 1:
        raise ConnectionError(f"judge unavailable for {key}")
    return 0.5
