"""How the trainer of a run is laid out, as the REST run spec (`trainer`) declares it.

`parallel`: data parallelism over the trainer's ranks (`torchrun --nproc-per-node N -m
furlong.trainer`). `world_size` must equal the number of ranks of the trainer the run is sent to;
the trainer refuses a run that asks for another. `ddp` replicates the policy on every rank and sums
gradients; `fsdp2` shards parameters, gradients and optimizer state over the ranks. The proto form
is `furlong.v1.ParallelConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

from furlong.core.settings.fields import SettingError, check_fields, setting

STRATEGIES = ("none", "ddp", "fsdp2")
MAX_WORLD_SIZE = 1024


@dataclass(frozen=True)
class ParallelSettings:
    strategy: str = setting(
        "none",
        choices=STRATEGIES,
        doc="data parallelism over the trainer's ranks: none (one rank), ddp (replicated policy, "
        "summed gradients) or fsdp2 (sharded parameters, gradients and optimizer state)",
    )
    world_size: int = setting(
        1, ge=1, le=MAX_WORLD_SIZE, doc="the trainer's number of ranks; must match the trainer's own"
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.strategy == "none" and self.world_size != 1:
            raise SettingError(
                "world_size",
                f"{self.world_size} ranks need a strategy (ddp or fsdp2), got strategy 'none'",
            )

    @property
    def data_parallel(self) -> bool:
        """Whether the learner runs over a process group (one rank with ddp or fsdp2 counts)."""
        return self.strategy != "none"


@dataclass(frozen=True)
class TrainerSettings:
    parallel: ParallelSettings = setting(default_factory=ParallelSettings)

    def __post_init__(self) -> None:
        check_fields(self)
