"""Groups and filters: which prompt groups a request keeps, as pure decisions over rewards.

Dynamic sampling (DAPO): a group whose rewards are all equal carries no learning signal under
group-normalised advantages, so it is dropped and its prompt drawn again, up to `max_refill_rounds`
times; a group still constant after the last round is dropped for good. Both are counted.
Over-sampling (`OverSampling`): submit more prompts than needed, keep the first groups to complete.
Knows nothing about engines, Redis or transports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from furlong.core.settings.rollout import MAX_REFILL_ROUNDS
from furlong.rollout.core.checks import check_int


@dataclass(frozen=True)
class DynamicSampling:
    """max_refill_rounds = 0 keeps every group (off)."""

    max_refill_rounds: int = 0

    def __post_init__(self) -> None:
        check_int("max_refill_rounds", self.max_refill_rounds, 0, MAX_REFILL_ROUNDS)

    @property
    def enabled(self) -> bool:
        return self.max_refill_rounds > 0

    def check_group_size(self, samples_per_prompt: int) -> None:
        if self.enabled and samples_per_prompt < 2:
            raise ValueError(
                f"dynamic sampling (max_refill_rounds {self.max_refill_rounds}) needs "
                f"samples_per_prompt >= 2, got {samples_per_prompt}: a group of one "
                f"always has zero reward variance"
            )


def zero_variance(rewards: Sequence[float]) -> bool:
    """True when every reward of the group is the same value."""
    return len(set(rewards)) <= 1


@dataclass(frozen=True)
class GroupOutcome:
    kept: list[int]  # group indices written, in request order
    dropped: list[int]  # constant after every round
    refills: int  # groups drawn again (summed over rounds)


@dataclass(frozen=True)
class OverSampling:
    """Over-sampling: a request carries more prompts than the step needs and keeps the first
    `keep_groups` groups to complete (0 = keep every group, off). Rollout sizes a step's draw with
    `RolloutSettings.prompts_to_draw`; the groups beyond keep_groups are surplus: not written, closed in
    the ledger, counted. Picking the first to complete (not the first submitted) is the point: a
    slow engine or a long response no longer holds the step back."""

    keep_groups: int = 0

    def __post_init__(self) -> None:
        check_int("keep_groups", self.keep_groups, 0)

    @property
    def enabled(self) -> bool:
        return self.keep_groups > 0

    def check(self, num_prompts: int) -> None:
        if self.keep_groups > num_prompts:
            raise ValueError(f"keep_groups {self.keep_groups} exceeds the request's {num_prompts} prompts")

    def keep(self, completed: Sequence[int]) -> list[int]:
        """The groups kept, from group indices in the order they completed."""
        return list(completed[: self.keep_groups]) if self.enabled else list(completed)
