"""How an engine draws tokens, as a validated value: temperature, top-k, top-p, min-p, length, seed
and stop strings; and the bound on how large a recorded sampling support may be.

Kept free of torch so that clients can build requests without importing it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_SEED = 2**63 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    max_new_tokens: int = 32
    seed: int = 0
    min_p: float = 0.0  # 0.0 = off; keep tokens with p >= min_p * p_max
    # A response ends at the token completing one of these strings (finish reason "stop"); the
    # returned text ends before it, the token ids keep every drawn token. Any sequence of str is
    # accepted and stored as a tuple.
    stop: Sequence[str] = ()

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or t == float("inf"):
            raise ValueError(f"temperature must be a finite number > 0, got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"max_new_tokens must be an integer > 0, got {n!r}")
        s = self.seed
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= MAX_SEED:
            raise ValueError(f"seed must be an integer in [0, 2**63 - 1], got {s!r}")
        m = self.min_p
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0.0 <= m < 1.0:
            raise ValueError(f"min_p must be in [0, 1) (0 = off), got {m!r}")
        object.__setattr__(self, "stop", check_stop_strings(self.stop))

    def filters_vocab(self, vocab_size: int) -> bool:
        """True when top-k, top-p or min-p can remove tokens from a vocabulary of this size."""
        return (0 < self.top_k < vocab_size) or self.top_p < 1.0 or self.min_p > 0.0


def check_stop_strings(stop: object) -> tuple[str, ...]:
    """`stop` as a tuple of at most MAX_STOP_STRINGS distinct non-empty strings of at most
    MAX_STOP_CHARS characters each; ValueError naming the bad value otherwise."""
    if isinstance(stop, (str, bytes)) or not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a list of strings, got {type(stop).__name__} {stop!r}")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(stop)} strings, at most {MAX_STOP_STRINGS} are allowed")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(
                f"stop string {s[:32]!r}... has {len(s)} characters, at most {MAX_STOP_CHARS} are allowed"
            )
    return tuple(dict.fromkeys(stop))


OVERFLOW_ERROR = "error"
OVERFLOW_TRUNCATE = "truncate"


class SupportOverflowError(ValueError):
    """A sampling support grew beyond the configured bound and the bound says to fail."""


@dataclass(frozen=True)
class SupportBound:
    """At most `max_size` token ids per recorded support (0 = unbounded).

    When a step's support is larger: `on_overflow="error"` fails the request with a
    SupportOverflowError naming both sizes; `"truncate"` keeps only the `max_size` most probable ids,
    samples from those (renormalised, so the support stays exactly what could be drawn) and flags
    the token as truncated. Never silent either way.
    """

    max_size: int = 0
    on_overflow: str = OVERFLOW_ERROR

    def __post_init__(self) -> None:
        n = self.max_size
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"max_support_size must be an integer >= 0 (0 = unbounded), got {n!r}")
        if self.on_overflow not in (OVERFLOW_ERROR, OVERFLOW_TRUNCATE):
            raise ValueError(
                f"on_overflow must be {OVERFLOW_ERROR!r} or {OVERFLOW_TRUNCATE!r}, got {self.on_overflow!r}"
            )

    def bounds(self, vocab_size: int) -> bool:
        """True when a support over this vocabulary can exceed the bound."""
        return 0 < self.max_size < vocab_size
