"""Rewards by registered name: pure functions `(response_text, answer) -> float`.

A run names its reward once (`ConfigureRun.reward`); an unknown name is refused then, listing the
known ones. A reward that raises or returns something other than a finite number fails the request
that scored it with a `RewardError` naming the prompt; it is never turned into a silent 0.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

from furlong.core.tasks import ADDITION_REWARD, exact_match_reward

RewardFn = Callable[[str, str], float]

_REWARDS: dict[str, RewardFn] = {
    ADDITION_REWARD: exact_match_reward,
}


class RewardError(RuntimeError):
    """A reward function failed or returned a value that is not a finite number."""


def known_rewards() -> list[str]:
    return sorted(_REWARDS)


def get_reward(name: str, registry: Mapping[str, RewardFn] | None = None) -> RewardFn:
    """The reward registered under `name` (in `registry`, by default the built-in one); ValueError
    listing the known names otherwise."""
    registry = _REWARDS if registry is None else registry
    fn = registry.get(name)
    if fn is None:
        raise ValueError(f"unknown reward {name!r}; known rewards: {', '.join(sorted(registry))}")
    return fn


def score(name: str, fn: RewardFn, response_text: str, answer: str, where: str) -> float:
    """fn(response_text, answer) as a finite float; RewardError naming `where` otherwise."""
    try:
        value = fn(response_text, answer)
    except Exception as exc:  # noqa: BLE001 - any failure of a reward fails the request, loudly
        raise RewardError(f"reward {name!r} failed on {where}: {type(exc).__name__}: {exc}") from exc
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardError(f"reward {name!r} returned {value!r} on {where}; expected a finite number")
    return float(value)
