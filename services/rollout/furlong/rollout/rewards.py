"""Rewards by registered name: typed callables `(response_text, answer) -> float`.

Built in: the addition task's exact match and format rewards (`format_integer`, `format_single_line`).
A user reward is a callable registered under a name, or resolved once at start-up from an explicit
`module:function` reference (`resolve_user_reward`); either way its signature is checked when it is
registered, not when the first sample arrives. A run names its reward once (`ConfigureRun.reward`);
an unknown name is refused then, listing the known ones.

`score_all` runs a batch of rewards concurrently in a thread pool with a deadline; a reward that
raises, returns something other than a finite number, or does not finish in time fails the batch
with a `RewardError` naming the sample; it is never turned into a silent 0. (A reward thread that
overruns cannot be killed; it is abandoned and finishes on its own.) A step's groups are scored by
`core.group_scoring` instead, as they complete, a failed group being an infrastructure failure;
a run's weighted `reward` section is built by `run_reward`.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from furlong.core.tasks import ADDITION_REWARD, exact_match_reward

RewardFn = Callable[[str, str], float]

FORMAT_INTEGER = "format_integer"
FORMAT_SINGLE_LINE = "format_single_line"
_INTEGER = re.compile(r"-?\d+")


def format_integer_reward(response_text: str, answer: str) -> float:
    """1.0 iff the response, stripped, is an integer literal (whatever its value); else 0.0."""
    return 1.0 if _INTEGER.fullmatch(response_text.strip()) else 0.0


def format_single_line_reward(response_text: str, answer: str) -> float:
    """1.0 iff the response is non-empty after stripping and has no line break inside; else 0.0."""
    text = response_text.strip()
    return 1.0 if text and "\n" not in text and "\r" not in text else 0.0


class RewardError(RuntimeError):
    """A reward function failed, overran its deadline or returned something not a finite number."""


def check_signature(name: str, fn: object) -> RewardFn:
    """`fn` if it is callable as fn(response_text, answer); ValueError naming it otherwise."""
    if not callable(fn):
        raise ValueError(f"reward {name!r} is a {type(fn).__name__}, not a callable")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"reward {name!r}: cannot read its signature: {exc}") from None
    try:
        signature.bind("response", "answer")
    except TypeError as exc:
        raise ValueError(
            f"reward {name!r} must be callable as fn(response_text: str, answer: str)"
            f" -> float; its signature is {signature}: {exc}"
        ) from None
    return fn


_BUILTIN: dict[str, RewardFn] = {
    ADDITION_REWARD: exact_match_reward,
    FORMAT_INTEGER: format_integer_reward,
    FORMAT_SINGLE_LINE: format_single_line_reward,
}


def builtin_rewards() -> dict[str, RewardFn]:
    return dict(_BUILTIN)


def resolve_user_reward(reference: str) -> RewardFn:
    """Import `module:function` (e.g. "my_pkg.rewards:strict_match") and check its signature.
    ValueError naming the reference when the module, the attribute or the signature is wrong."""
    return check_signature(reference, resolve_reference(reference))


def resolve_reference(reference: str) -> object:
    """The object at `module:attribute` (dotted attributes allowed); ValueError naming the
    reference when the module or the attribute is missing."""
    module_name, sep, attr = reference.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"user reward {reference!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"user reward {reference!r}: cannot import {module_name!r}: {exc}") from None
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"user reward {reference!r}: {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    return fn


def reward_registry(
    user: Mapping[str, RewardFn] | None = None, include_builtin: bool = True
) -> dict[str, RewardFn]:
    """Built-in rewards plus `user` ones, every signature checked; a user name that shadows a
    built-in one is refused."""
    registry = builtin_rewards() if include_builtin else {}
    for name, fn in (user or {}).items():
        if not isinstance(name, str) or not name or any(ch.isspace() for ch in name):
            raise ValueError(f"reward name {name!r} must be a non-empty string without whitespace")
        if name in registry:
            raise ValueError(f"reward {name!r} is already registered")
        registry[name] = check_signature(name, fn)
    return registry


def get_reward(name: str, registry: Mapping[str, RewardFn] | None = None) -> RewardFn:
    """The reward registered under `name` (in `registry`, by default the built-in one); ValueError
    listing the known names otherwise."""
    registry = _BUILTIN if registry is None else registry
    fn = registry.get(name)
    if fn is None:
        raise ValueError(f"unknown reward {name!r}; known rewards: {', '.join(sorted(registry))}")
    return fn


def _checked(name: str, value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardError(f"reward {name!r} returned {value!r} on {where}; expected a finite number")
    return float(value)


def score(name: str, fn: RewardFn, response_text: str, answer: str, where: str) -> float:
    """fn(response_text, answer) as a finite float; RewardError naming `where` otherwise."""
    try:
        value = fn(response_text, answer)
    except Exception as exc:
        raise RewardError(f"reward {name!r} failed on {where}: {type(exc).__name__}: {exc}") from exc
    return _checked(name, value, where)


def score_all(
    name: str, fn: RewardFn, items: Sequence[tuple[str, str, str]], timeout_s: float, max_workers: int
) -> list[float]:
    """Score (response_text, answer, where) items concurrently; all must finish within timeout_s.
    The first failure in item order is raised as a RewardError."""
    if not items:
        return []
    pool = ThreadPoolExecutor(
        max_workers=max(1, min(max_workers, len(items))), thread_name_prefix=f"reward-{name}"
    )
    try:
        futures = [pool.submit(fn, text, answer) for text, answer, _ in items]
        deadline = time.monotonic() + timeout_s
        out: list[float] = []
        for future, (_, _, where) in zip(futures, items):
            try:
                value = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise RewardError(f"reward {name!r} did not finish within {timeout_s} s on {where}") from None
            except Exception as exc:
                raise RewardError(f"reward {name!r} failed on {where}: {type(exc).__name__}: {exc}") from exc
            out.append(_checked(name, value, where))
        return out
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
