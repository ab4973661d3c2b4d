"""A run's reward from its `RewardSettings`: the weighted sum of the built-in terms with a weight
> 0 (see `furlong.core.settings.reward`), called as reward(response_text, prompt).

Terms: `exact_match`, `math`, `regex`, `format` (`answer_rewards`), `code` (`code_sandbox`: the
response's code, then the row's tests, which are its reference answer), `python` (a user callable
`module:function`, resolved and checked when the run is configured; sync or async; given
`metadata=` when it takes that keyword) and `http` (`HttpReward`). A term that raises fails the
whole reward (an infrastructure failure, see core.group_scoring); nothing is turned into 0 here.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from furlong.core.settings import RewardSettings
from furlong.core.settings.reward import HttpReward as HttpSettings
from furlong.rollout.answer_rewards import exact_match, format_reward, math_reward, regex_reward
from furlong.rollout.code_sandbox import CodeSandbox, SandboxLimits, code_reward
from furlong.rollout.core.group_scoring import finite_reward
from furlong.rollout.core.types import Prompt
from furlong.rollout.rewards import check_signature, resolve_reference

log = logging.getLogger(__name__)

TermFn = Callable[[str, Prompt], float]
_RETRY_BASE_S = 0.1


class HttpRewardError(RuntimeError):
    """The remote reward answered with an error or something that is not {"reward": number}."""


class HttpReward:
    """POST {"response", "answer", "metadata", "prompt_id"} to `url`; the reply must be
    {"reward": <finite number>}. A transport error or a 5xx is retried `retries` times with
    exponential backoff; a 4xx or a malformed reply is not. Thread-safe (one httpx client)."""

    def __init__(self, settings: HttpSettings) -> None:
        self._url = settings.url
        self._retries = settings.retries
        self._client = httpx.Client(timeout=settings.timeout_s)

    def __call__(self, response_text: str, prompt: Prompt) -> float:
        body = {
            "response": response_text,
            "answer": prompt.answer,
            "metadata": dict(prompt.metadata),
            "prompt_id": prompt.prompt_id,
        }
        last = ""
        for attempt in range(self._retries + 1):
            if attempt:
                time.sleep(_RETRY_BASE_S * 2 ** (attempt - 1))
            try:
                reply = self._client.post(self._url, json=body)
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            if reply.status_code >= 500:
                last = f"HTTP {reply.status_code}: {reply.text[:200]}"
                continue
            if reply.status_code != 200:
                raise HttpRewardError(f"{self._url} answered HTTP {reply.status_code}: {reply.text[:200]}")
            try:
                value = reply.json()["reward"]
            except (ValueError, KeyError, TypeError):
                raise HttpRewardError(
                    f'{self._url} answered {reply.text[:200]!r}; expected {{"reward": <number>}}'
                ) from None
            return finite_reward(self._url, value, f"prompt {prompt.prompt_id!r}")
        raise HttpRewardError(f"{self._url}: {self._retries + 1} attempts failed; last: {last}")

    def close(self) -> None:
        self._client.close()


def user_reward(reference: str) -> TermFn:
    """The callable at `module:function`, called as fn(response, answer) or, when it takes a
    `metadata` keyword, fn(response, answer, metadata=...); a coroutine function is run to
    completion in the calling (reward) thread. ValueError naming the reference when it cannot be
    imported or called so."""
    fn = check_signature(reference, resolve_reference(reference))
    params = inspect.signature(fn).parameters
    takes_metadata = "metadata" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    is_async = inspect.iscoroutinefunction(fn)

    def call(response_text: str, prompt: Prompt) -> float:
        kwargs: dict[str, Any] = {"metadata": dict(prompt.metadata)} if takes_metadata else {}
        value: Any = fn(response_text, prompt.answer, **kwargs)
        if is_async or inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
        return finite_reward(reference, value, f"prompt {prompt.prompt_id!r}")

    return call


async def _awaited(value: Any) -> Any:
    return await value


def _on_answer(fn: Callable[[str, str], float]) -> TermFn:
    return lambda response_text, prompt: fn(response_text, prompt.answer)


@dataclass
class WeightedReward:
    """sum(weight x term(response, prompt)) over the terms; implements core.group_scoring.RunReward."""

    name: str
    terms: list[tuple[str, float, TermFn]]
    closers: list[Callable[[], None]]

    def __call__(self, response_text: str, prompt: Prompt) -> float:
        total = 0.0
        for kind, weight, fn in self.terms:
            total += weight * finite_reward(kind, fn(response_text, prompt), f"prompt {prompt.prompt_id!r}")
        return total

    def close(self) -> None:
        for close in self.closers:
            close()
        self.closers = []


def build_run_reward(settings: RewardSettings) -> WeightedReward:
    """The weighted reward of `settings`; ValueError naming the bad setting (a regex that does not
    compile, a user reward that cannot be imported, a sandbox that cannot run here)."""
    if not isinstance(settings, RewardSettings):
        raise ValueError(f"expected RewardSettings, got {type(settings).__name__}")
    terms: list[tuple[str, float, TermFn]] = []
    closers: list[Callable[[], None]] = []
    for kind, weight in settings.terms():
        fn: TermFn
        if kind == "exact_match":
            fn = _on_answer(exact_match)
        elif kind == "math":
            fn = _on_answer(math_reward)
        elif kind == "regex":
            fn = _on_answer(regex_reward(settings.regex.pattern, settings.regex.mode))
        elif kind == "format":
            fn = _on_answer(format_reward(settings.format.check))
        elif kind == "code":
            c = settings.code
            sandbox = CodeSandbox(SandboxLimits(c.timeout_s, c.cpu_s, c.memory_bytes), c.sandbox)
            fn = _on_answer(code_reward(sandbox))
        elif kind == "python":
            try:
                fn = user_reward(settings.python.function)
            except ValueError as exc:
                raise ValueError(f"reward.python.function: {exc}") from None
        elif kind == "http":
            remote = HttpReward(settings.http)
            closers.append(remote.close)
            fn = remote
        else:
            raise ValueError(f"reward: unknown term {kind!r}")
        terms.append((kind, weight, fn))
    if not terms:
        raise ValueError("reward: no term has a weight > 0")
    name = "+".join(f"{weight:g}*{kind}" for kind, weight, _ in terms)
    log.info("run reward %s", name)
    return WeightedReward(name=name, terms=terms, closers=closers)
