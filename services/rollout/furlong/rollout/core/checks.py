"""Validation of the rollout service's request fields: each failure is a ValueError naming the field
and the bad value. Knows nothing about transports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from furlong.rollout.core.types import Prompt

MAX_ID_CHARS = 256


def check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")
    return value


def check_id(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    if len(value) > MAX_ID_CHARS or any(ch.isspace() or not ch.isprintable() for ch in value):
        raise ValueError(
            f"{name} {value!r} must be at most {MAX_ID_CHARS} printable characters without whitespace"
        )
    return value


def check_timeout(name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def check_prompts(prompts: Sequence[Prompt]) -> list[Prompt]:
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts must not be empty")
    seen: set[str] = set()
    for i, p in enumerate(prompts):
        if not isinstance(p, Prompt):
            raise ValueError(f"prompts[{i}] must be a Prompt, got {type(p).__name__}")
        check_id(f"prompts[{i}].prompt_id", p.prompt_id)
        if p.prompt_id in seen:
            raise ValueError(f"prompts[{i}].prompt_id {p.prompt_id!r} is not unique in the request")
        seen.add(p.prompt_id)
        if not isinstance(p.text, str) or not p.text:
            raise ValueError(f"prompts[{i}].text (prompt {p.prompt_id!r}) must be a non-empty string")
        if not isinstance(p.answer, str):
            raise ValueError(
                f"prompts[{i}].answer (prompt {p.prompt_id!r}) must be a string, "
                f"got {type(p.answer).__name__}"
            )
    return prompts


def split_evenly(num_items: int, num_parts: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges covering num_items in at most num_parts non-empty parts whose
    sizes differ by at most one."""
    parts = min(num_parts, num_items)
    base, extra = divmod(num_items, parts) if parts else (0, 0)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out
