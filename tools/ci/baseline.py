"""Check that a dependency override replaced only the dependencies that were named.

The GPU suite records `pip freeze --all` of its environment before and after installing overrides
(each with `pip install --no-deps`). Every distribution other than the overridden ones must be
identical before and after; each overridden one must be present afterwards and differ from the
baseline. Anything else means the install moved the environment off the image baseline.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")


class BaselineDrift(RuntimeError):
    """The environment changed beyond the named overrides."""


def normalize(name: str) -> str:
    """PEP 503 name normalization: `Megatron_Core` -> `megatron-core`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_freeze(text: str) -> dict[str, str]:
    """`pip freeze` text -> {normalized name: the whole requirement line}."""
    entries: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-e "):
            # `-e git+https://...#egg=name` or `-e /path` (older pip); key on the whole line.
            egg = re.search(r"#egg=([A-Za-z0-9._-]+)", line)
            name = normalize(egg.group(1)) if egg else line
        else:
            match = _NAME.match(line)
            if match is None:
                raise ValueError(f"unreadable pip freeze line: {raw!r}")
            name = normalize(match.group(0))
        if name in entries and entries[name] != line:
            raise ValueError(f"distribution {name!r} listed twice: {entries[name]!r}, {line!r}")
        entries[name] = line
    return entries


def drift(before: str, after: str, overridden: Iterable[str]) -> list[str]:
    """Human-readable violations; an empty list means only the named overrides moved."""
    allowed = {normalize(n) for n in overridden}
    old, new = parse_freeze(before), parse_freeze(after)
    problems: list[str] = []
    for name in sorted(set(old) | set(new)):
        if name in allowed:
            continue
        if name not in new:
            problems.append(f"removed: {old[name]}")
        elif name not in old:
            problems.append(f"added: {new[name]}")
        elif old[name] != new[name]:
            problems.append(f"changed: {old[name]} -> {new[name]}")
    for name in sorted(allowed):
        if name not in new:
            problems.append(f"override {name} is not installed after the override step")
        elif old.get(name) == new[name]:
            problems.append(f"override {name} is unchanged ({new[name]}); it was not installed")
    return problems


def check(before: str, after: str, overridden: Iterable[str]) -> None:
    problems = drift(before, after, overridden)
    if problems:
        raise BaselineDrift(
            "the dependency override moved the environment off the image baseline:\n  "
            + "\n  ".join(problems)
        )
