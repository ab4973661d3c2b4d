"""Rank 0's reads and writes of a run's whole state under torchrun: a publish, an export, a
training checkpoint. With one rank, or a state every rank holds whole (one rank, ddp), rank 0 does
them alone. With a sharded state (fsdp2, megatron tensor or pipeline parallelism: `TrainerRunConfig.
gathers_state`) each is a command the other ranks join (`ranks`):

- a publish gathers the tensors one staging round at a time as the publisher reads them, every rank
  in the publisher's order (`GatherCommand` with the rounds, `Learner.gathered_rounds`), so rank 0
  holds about one round of gathered tensors beyond its shards, never a second copy of the model;
- an export gathers them all first (`GatherCommand` without rounds);
- a training checkpoint: with fsdp2 every rank writes its shards of the sharded format and rank 0
  the manifest; with megatron's tensor parallelism every rank joins the gathers of the whole
  tensors and rank 0 writes them (`CheckpointCommand`, see `train_checkpoint`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from furlong.trainer.core.learner import Learner
from furlong.trainer.ranks import CheckpointCommand, GatherCommand, TrainerRanks
from furlong.trainer.train_checkpoint import CheckpointInfo, save_training_checkpoint
from furlong.transfer.publisher import PublishResult, WeightPublisher

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunState:
    """A run's learner as rank 0 reads and writes its whole state. `ranks` None: one rank;
    `sharded`: the state is a collective of every rank (fsdp2, megatron tensor or pipeline parallelism)."""

    run_id: str
    learner: Learner
    ranks: TrainerRanks | None
    sharded: bool

    @property
    def _alone(self) -> bool:
        return self.ranks is None or not self.sharded

    def publish(self, publisher: WeightPublisher, version: int) -> PublishResult:
        """Publish the policy as `version` (a sharded one round by round, gathered as it is read)."""
        if self._alone:
            return publisher.publish(version, self.learner.state_dict())
        assert self.ranks is not None  # not alone
        order = publisher.publish_order
        with self.ranks.command(GatherCommand(self.run_id, order)):
            with self.learner.gathered_rounds(order) as rounds:  # leaving it gathers what is unread
                result = publisher.publish(version, rounds)
        log.info(
            "run %s: version %d gathered in %d collectives, at most %d bytes at once",
            self.run_id,
            version,
            rounds.num_gathers,
            rounds.peak_bytes,
        )
        return result

    def full(self) -> dict[str, torch.Tensor]:
        """The whole policy state dict (exports)."""
        if self._alone:
            return self.learner.state_dict()
        assert self.ranks is not None
        with self.ranks.command(GatherCommand(self.run_id)):
            return self.learner.state_dict()

    def save_checkpoint(self, target: Path, step: int, cursor: Any) -> CheckpointInfo:
        """Write the run's training checkpoint of `step` to `target`."""
        if self._alone:
            return save_training_checkpoint(self.learner, target, step, cursor)
        assert self.ranks is not None
        with self.ranks.command(CheckpointCommand(self.run_id, str(target), step)):
            return save_training_checkpoint(self.learner, target, step, cursor)
