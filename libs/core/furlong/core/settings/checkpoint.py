"""When the trainer makes a run's progress durable, as the REST run spec (`checkpoint`) declares it:
training checkpoints (the trainer applies `every_steps` and keeps the newest `keep_last`, sent with
ConfigureRun) and the trained policy as a Hugging Face directory (the controller asks the trainer
for one after the last step and every `export_every_steps`-th step, each in shards of at most
`export_max_shard_bytes`)."""

from __future__ import annotations

from dataclasses import dataclass

from furlong.core.settings.fields import check_fields, setting
from furlong.core.settings.run_shape import MAX_STEPS

DEFAULT_EXPORT_SHARD_BYTES = 5_000_000_000  # Hugging Face's customary 5 GB shards


@dataclass(frozen=True)
class CheckpointSettings:
    every_steps: int = setting(
        1, ge=1, le=MAX_STEPS, doc="a training checkpoint after every N-th step (and the last)"
    )
    keep_last: int = setting(
        2,
        ge=1,
        le=1000,
        doc="how many of the run's newest training checkpoints the trainer keeps (older ones are removed)",
    )
    export_every_steps: int = setting(
        0,
        ge=0,
        le=MAX_STEPS,
        doc="the policy as a Hugging Face directory after every N-th step as well as the final one "
        "(0 = the final one only)",
    )
    export_max_shard_bytes: int = setting(
        DEFAULT_EXPORT_SHARD_BYTES,
        ge=1 << 10,
        le=1 << 40,
        doc="largest safetensors shard of an exported policy, in bytes",
    )

    def __post_init__(self) -> None:
        check_fields(self)

    def exports_at(self, step: int, total_steps: int) -> bool:
        """Whether the policy after `step` of a run of `total_steps` is exported."""
        every = self.export_every_steps
        return step == total_steps or (every > 0 and step % every == 0)
