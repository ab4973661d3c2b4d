"""Scoring a request's groups while the engines are still generating the others: each group is
handed to a thread pool the moment its last sample arrives, and the request waits only for what is
left when generation ends.

A response's reward must finish within `timeout_s` of starting (a call still queued behind others
gets the time of the calls ahead of it as well). A reward that raises, returns something other than
a finite number or overruns fails its whole group with a `RewardFailure` ("error" or "timeout"):
an infrastructure failure, never a reward of 0; the caller leaves the group out or draws it again.
A reward thread that overruns cannot be killed: it is abandoned with the pool and finishes on its
own. Knows nothing about engines, ledgers or transports.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Protocol

from furlong.core.settings import RewardSettings
from furlong.rollout.core.types import Prompt

# score(response_text, prompt) -> reward; raises on failure.
Scorer = Callable[[str, Prompt], float]

ERROR = "error"
TIMEOUT = "timeout"
_MAX_WAIT_S = 0.05  # how long one wait may block before the deadlines are looked at again


@dataclass(frozen=True)
class RewardFailure:
    kind: str  # ERROR | TIMEOUT
    message: str
    source: str = "reward"  # "reward", "environment" (an episode's environment) or "agent" (a session's)


@dataclass
class _Call:
    where: str
    rank: int  # submission order
    submitted: float
    future: Future[float] = field(default_factory=Future)
    started: float | None = None


def finite_reward(name: str, value: object, where: str) -> float:
    """value as a float; ValueError naming `where` when it is not a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"reward {name!r} returned {value!r} on {where}; expected a finite number")
    return float(value)


class GroupScorer:
    """One request's scoring. `submit` from any thread; `results` once, after the last submit."""

    def __init__(self, name: str, score: Scorer, timeout_s: float, max_workers: int) -> None:
        self._name = name
        self._score = score
        self._timeout_s = timeout_s
        self._workers = max(1, max_workers)
        self._pool = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix=f"reward-{name}")
        self._lock = threading.Lock()
        self._groups: dict[int, list[_Call]] = {}
        self._count = 0

    def submitted(self, group: int) -> bool:
        with self._lock:
            return group in self._groups

    def submit(self, group: int, items: Sequence[tuple[str, Prompt, str]]) -> None:
        """Score a group's (response_text, prompt, where) items; a group is submitted once."""
        with self._lock:
            if group in self._groups:
                return
            calls = []
            for text, prompt, where in items:
                call = _Call(where=where, rank=self._count, submitted=time.monotonic())
                self._count += 1
                call.future = self._pool.submit(self._run, call, text, prompt)
                calls.append(call)
            self._groups[group] = calls

    def _run(self, call: _Call, text: str, prompt: Prompt) -> float:
        call.started = time.monotonic()
        return finite_reward(self._name, self._score(text, prompt), call.where)

    def _deadline(self, call: _Call) -> float:
        if call.started is not None:
            return call.started + self._timeout_s
        ahead = call.rank // self._workers + 2  # queued: the calls ahead of it may each take it all
        return call.submitted + self._timeout_s * ahead

    def results(self) -> dict[int, list[float] | RewardFailure]:
        """Every submitted group's rewards (in item order) or its failure; then the pool is shut
        down without waiting for abandoned calls."""
        try:
            with self._lock:
                groups = dict(self._groups)
            calls = [c for cs in groups.values() for c in cs]
            overdue: set[int] = set()
            while True:
                now = time.monotonic()
                waiting = [c for c in calls if not c.future.done() and c.rank not in overdue]
                for c in waiting:
                    if now >= self._deadline(c):
                        overdue.add(c.rank)
                waiting = [c for c in waiting if c.rank not in overdue]
                if not waiting:
                    break
                until = min(self._deadline(c) for c in waiting) - now
                wait(
                    [c.future for c in waiting],
                    timeout=max(0.001, min(until, _MAX_WAIT_S)),
                    return_when=FIRST_COMPLETED,
                )
            return {g: self._outcome(cs, overdue) for g, cs in groups.items()}
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Give up on every call (idempotent)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _outcome(self, calls: list[_Call], overdue: set[int]) -> list[float] | RewardFailure:
        out: list[float] = []
        for c in calls:
            if c.rank in overdue and not c.future.done():
                return RewardFailure(
                    TIMEOUT, f"reward {self._name!r} did not finish within {self._timeout_s:g} s on {c.where}"
                )
            try:
                out.append(c.future.result(timeout=0))
            except Exception as exc:  # noqa: BLE001 - any failure of a reward is a failure of its group
                if isinstance(exc, ValueError) and "expected a finite number" in str(exc):
                    return RewardFailure(ERROR, str(exc))
                return RewardFailure(
                    ERROR, f"reward {self._name!r} failed on {c.where}: {type(exc).__name__}: {exc}"
                )
        return out


class RunReward(Protocol):
    """A run's reward built from its `RewardSettings` (`furlong.rollout.run_reward`): called from
    reward threads concurrently (thread-safe), raising on failure; `close` releases what it holds
    (idempotent)."""

    name: str

    def __call__(self, response_text: str, prompt: Prompt) -> float: ...

    def close(self) -> None: ...


RunRewardFactory = Callable[[RewardSettings], RunReward]
