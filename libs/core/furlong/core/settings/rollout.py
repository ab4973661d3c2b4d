"""How a run's rollout is shaped: engines, dynamic sampling and over-sampling, as the REST run spec
(`rollout`) declares them and the rollout service applies them. Rollout alone decides, from these,
how many prompts to draw, which groups to redraw and which to cut. The proto form is
`furlong.v1.RolloutConfig`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from furlong.core.settings.fields import check_fields, setting

MAX_ENGINES = 64
MAX_REFILL_ROUNDS = 16
MAX_OVER_SAMPLING = 4.0


@dataclass(frozen=True)
class RolloutSettings:
    """`max_refill_rounds` > 0 turns on dynamic sampling: a group whose rewards are all equal is
    drawn again, up to that many rounds, then dropped. `over_sampling` > 1 draws
    ceil(groups needed x over_sampling) prompts and keeps the first groups to complete; the rest are
    cut and recorded as such, never trained."""

    num_engines: int = setting(1, ge=1, le=MAX_ENGINES, doc="built-in engines in the rollout service")
    max_refill_rounds: int = setting(
        0, ge=0, le=MAX_REFILL_ROUNDS, doc="dynamic sampling: redraws of an equal-reward group; 0 = off"
    )
    over_sampling: float = setting(
        1.0, ge=1.0, le=MAX_OVER_SAMPLING, doc="prompts drawn per group needed; 1 = off"
    )

    def __post_init__(self) -> None:
        check_fields(self)

    def prompts_to_draw(self, groups_needed: int) -> int:
        """Prompts to draw for `groups_needed` groups."""
        return max(groups_needed, math.ceil(groups_needed * self.over_sampling - 1e-9))
