"""When the local stack's supervisor starts a service again that exited: backoff and a budget.

A pure decision: given when a service was restarted before, `RestartPolicy.decide` says whether to
restart it and after which delay. The delay doubles with each restart inside the budget's window
(`backoff_s`, 2x, 4x ... capped at `max_backoff_s`), so a service that dies at start-up does not
spin; once `budget` restarts fall inside `window_s` the service is given up on (`None`), with one
short reason. Knows nothing about processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartDecision:
    restart: int  # which restart within the window this is (1 = the first)
    delay_s: float


@dataclass(frozen=True)
class RestartPolicy:
    budget: int = 5  # restarts of one service within window_s
    window_s: float = 600.0
    backoff_s: float = 0.5  # before the first restart within the window
    max_backoff_s: float = 8.0

    def __post_init__(self) -> None:
        if self.budget < 0:
            raise ValueError(f"restart budget must be >= 0, got {self.budget}")
        if not self.window_s > 0 or self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError(
                f"restart window_s must be > 0 and 0 <= backoff_s <= max_backoff_s, got "
                f"{self.window_s}, {self.backoff_s}, {self.max_backoff_s}"
            )

    def decide(self, previous_restarts: Sequence[float], now: float) -> RestartDecision | None:
        """Restart (after the decision's delay) a service that exited at now, having been
        restarted at previous_restarts (monotonic seconds); None: the budget is spent."""
        recent = [t for t in previous_restarts if now - t < self.window_s]
        if len(recent) >= self.budget:
            return None
        return RestartDecision(
            restart=len(recent) + 1, delay_s=min(self.max_backoff_s, self.backoff_s * 2 ** len(recent))
        )

    def spent(self, service: str, exit_words: str) -> str:
        """The one short reason a service is given up on."""
        return (
            f"{service} {exit_words} after {self.budget} restarts within {self.window_s:g}s "
            "(the restart budget); it is not restarted again"
        )
