"""How an engine draws tokens, as a validated value: temperature, top-k, top-p, length and seed.

Kept free of torch so that clients can build requests without importing it.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0
    top_k: int = 0          # 0 = off
    top_p: float = 1.0      # 1.0 = off
    max_new_tokens: int = 32
    seed: int = 0

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

    def filters_vocab(self, vocab_size: int) -> bool:
        """True when top-k or top-p can remove tokens from a vocabulary of this size."""
        return (0 < self.top_k < vocab_size) or self.top_p < 1.0
