"""How an engine draws tokens: the run's `SamplingSettings` (declared in furlong.core.settings) plus
the seed of one request (`SamplingConfig`); and the bound on how large a recorded sampling support
may be.

Kept free of torch so that clients can build requests without importing it.
"""

from __future__ import annotations

from dataclasses import dataclass

from furlong.core.settings import SamplingSettings
from furlong.core.settings.fields import setting
from furlong.core.settings.sampling import MAX_SEED, MAX_STOP_CHARS, MAX_STOP_STRINGS

__all__ = [
    "MAX_SEED",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "OVERFLOW_ERROR",
    "OVERFLOW_TRUNCATE",
    "SamplingConfig",
    "SupportBound",
    "SupportOverflowError",
]


@dataclass(frozen=True)
class SamplingConfig(SamplingSettings):
    """The sampling settings of one request and its seed: the same seed, settings, prompt and weights
    give the same tokens."""

    seed: int = setting(0, ge=0, le=MAX_SEED)

    @classmethod
    def of(cls, settings: SamplingSettings, seed: int) -> SamplingConfig:
        return cls(**{k: getattr(settings, k) for k in settings.__dataclass_fields__}, seed=seed)

    def settings(self) -> SamplingSettings:
        """The request's settings without its seed."""
        return SamplingSettings(**{k: getattr(self, k) for k in SamplingSettings.__dataclass_fields__})


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
