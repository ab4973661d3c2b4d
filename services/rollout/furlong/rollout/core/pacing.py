"""Asynchronous mode: staleness-paced admission, as pure decisions.

Generation for step s may start while the trainer is still training earlier steps, but only once
the engines serve at least version `s - max_staleness`: the trainer trains step s with version s
(one optimizer step per RL step, versions counted from 0), so every sample it trains is at most
`max_staleness` versions old. Admission waits instead of discarding, so every submitted prompt is
trained and the trained prompts are exactly the submitted ones (no bias against long or hard
prompts). `RolloutService.generate(min_policy_version=...)` is the wait: pass
`StalenessPacer.min_version(step)`.

Weight updates during a generation: an engine holds its weights for a whole `generate` call and a
new version waits for the running batch (`Engine.load_weights`), so every sample is drawn with one
version, which it records ("finish, then switch"); no sample mixes versions.

Knows nothing about engines, Redis or transports.
"""

from __future__ import annotations

from dataclasses import dataclass

from furlong.core.settings.rollout import MAX_STALENESS


@dataclass(frozen=True)
class StalenessPacer:
    max_staleness: int  # 0 = synchronous: step s is generated with version s

    def __post_init__(self) -> None:
        s = self.max_staleness
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= MAX_STALENESS:
            raise ValueError(f"max_staleness must be an integer in [0, {MAX_STALENESS}], got {s!r}")

    def min_version(self, step: int) -> int:
        """The oldest policy version allowed to generate samples for `step`."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        return max(0, step - self.max_staleness)

    def can_admit(self, step: int, served_version: int) -> bool:
        return served_version >= self.min_version(step)

    def staleness(self, trained_version: int, sample_version: int) -> int:
        """How many versions behind the trained policy a sample was drawn."""
        return trained_version - sample_version

    def check_trained(self, trained_version: int, sample_versions: list[int]) -> None:
        """ValueError naming the oldest sample when a batch is staler than allowed."""
        oldest = min(sample_versions)
        if self.staleness(trained_version, oldest) > self.max_staleness:
            raise ValueError(
                f"a sample drawn with version {oldest} is {trained_version - oldest} "
                f"versions older than the trained version {trained_version} "
                f"(max_staleness {self.max_staleness})"
            )
