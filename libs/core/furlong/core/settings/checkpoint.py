"""When the trainer makes a run's progress durable, as the REST run spec (`checkpoint`) declares it
and the trainer applies it (sent with ConfigureRun)."""

from __future__ import annotations

from dataclasses import dataclass

from furlong.core.settings.fields import check_fields, setting
from furlong.core.settings.run_shape import MAX_STEPS


@dataclass(frozen=True)
class CheckpointSettings:
    every_steps: int = setting(
        1, ge=1, le=MAX_STEPS, doc="a training checkpoint after every N-th step (and the last)"
    )

    def __post_init__(self) -> None:
        check_fields(self)
