"""How a run's rollout is shaped: engines, dynamic sampling, over-sampling and asynchronous mode, as
the REST run spec (`rollout`) declares them and the rollout service applies them. Rollout alone
decides, from these, how many prompts to draw, which groups to redraw and which to cut; the
controller paces generation by `max_staleness`. The proto form is `furlong.v1.RolloutConfig`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from furlong.core.settings.fields import check_fields, setting

MAX_ENGINES = 64
MAX_REFILL_ROUNDS = 16
MAX_OVER_SAMPLING = 4.0
MAX_STALENESS = 64


@dataclass(frozen=True)
class RolloutSettings:
    """`max_refill_rounds` > 0 turns on dynamic sampling: a group whose rewards are all equal is
    drawn again, up to that many rounds, then dropped. `over_sampling` > 1 draws
    ceil(groups needed x over_sampling) prompts and keeps the first groups to complete; the rest are
    cut and recorded as such, never trained. `max_staleness` K > 0 is asynchronous mode: the samples
    of step s are generated while the trainer still trains earlier steps, with a policy at most K
    versions older than the one that trains on them; 0 is the synchronous loop."""

    num_engines: int = setting(1, ge=1, le=MAX_ENGINES, doc="built-in engines in the rollout service")
    max_refill_rounds: int = setting(
        0, ge=0, le=MAX_REFILL_ROUNDS, doc="dynamic sampling: redraws of an equal-reward group; 0 = off"
    )
    over_sampling: float = setting(
        1.0, ge=1.0, le=MAX_OVER_SAMPLING, doc="prompts drawn per group needed; 1 = off"
    )
    max_staleness: int = setting(
        0,
        ge=0,
        le=MAX_STALENESS,
        doc="asynchronous mode: versions a trained sample may lag the trained policy; 0 = synchronous",
    )

    def __post_init__(self) -> None:
        check_fields(self)

    def prompts_to_draw(self, groups_needed: int) -> int:
        """Prompts to draw for `groups_needed` groups."""
        return max(groups_needed, math.ceil(groups_needed * self.over_sampling - 1e-9))
