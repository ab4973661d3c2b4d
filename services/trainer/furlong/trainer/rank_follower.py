"""The loop of a trainer rank other than 0: execute what rank 0 posts (`ranks`), report each
outcome, until rank 0 shuts the ranks down, the job's store goes away, or `stopping()` (SIGTERM in
the process) turns true between commands; a command under way is finished first.

A follower holds one `Learner` per configured run, built like rank 0's (`run_learner`) over the
trainer's process group, and trains its slice of the batch rank 0 read from Redis. It never reads
Redis, serves gRPC, publishes weights or writes exports: with ddp every rank holds the whole policy
and rank 0 writes it and its training checkpoints; with fsdp2 a follower joins the gathers of the
full tensors (`GatherCommand`: for a publish one round at a time in the order rank 0's publisher
reads them, for an export all of them) and drops the result, and writes its own shards of each training
checkpoint (`CheckpointCommand`; rank 0 writes the manifest). With the megatron backend over
tensor-parallel ranks a follower holds its shards and joins every gather of the whole tensors, a
training checkpoint's too (`CheckpointCommand`: rank 0 writes the whole tensors), and on resume
takes its shards of the checkpoint's whole tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from furlong.trainer.core.learner import Learner
from furlong.trainer.ranks import (
    CheckpointCommand,
    ConfigureCommand,
    EndCommand,
    GatherCommand,
    RankCommand,
    ShutdownCommand,
    TrainCommand,
    TrainerRanks,
)
from furlong.trainer.run_learner import LearnerMemory, build_learner, check_world_size
from furlong.trainer.train_checkpoint import load_training_checkpoint, save_training_checkpoint

log = logging.getLogger(__name__)


class RankFollower:
    """Not thread-safe: `serve` runs on the process's main thread."""

    def __init__(
        self,
        ranks: TrainerRanks,
        device: torch.device,
        stopping: Callable[[], bool] = lambda: False,
        memory: LearnerMemory | None = None,
    ) -> None:
        if ranks.is_leader:
            raise ValueError("rank 0 serves gRPC; a follower is any other rank")
        self._ranks = ranks
        self._device = device
        self._memory = memory or LearnerMemory()  # rank 0's: every rank runs the same command line
        self._stopping = stopping
        self._learners: dict[str, Learner] = {}

    def serve(self) -> int:
        """Run commands until ShutdownCommand or `stopping()` (returns 0) or until the store is
        gone (returns 1). Rank 0 learns that this rank left (`TrainerRanks.leave`)."""
        log.info("rank %d of %d follows rank 0", self._ranks.rank, self._ranks.world_size)
        try:
            return self._loop()
        finally:
            self._learners.clear()
            self._ranks.leave()

    def _loop(self) -> int:
        while True:
            try:
                command = self._ranks.next_command(self._stopping)
            except dist.DistError as exc:  # DistStoreError, DistNetworkError: the agent is gone
                log.error("rank %d: the job's store is gone (%s); exiting", self._ranks.rank, exc)
                return 1
            if command is None:
                log.info("rank %d: stopped between commands", self._ranks.rank)
                return 0
            if isinstance(command, ShutdownCommand):
                self._learners.clear()
                self._ranks.report("")
                log.info("rank %d: shut down by rank 0", self._ranks.rank)
                return 0
            try:
                self.execute(command)
            except Exception as exc:  # reported to rank 0, which fails the call it serves
                log.exception("rank %d: %s failed", self._ranks.rank, type(command).__name__)
                self._ranks.report(f"{type(exc).__name__}: {exc}" or type(exc).__name__)
            else:
                self._ranks.report("")

    def execute(self, command: RankCommand) -> None:
        if isinstance(command, ConfigureCommand):
            config = command.config
            check_world_size(config.parallel, self._ranks.world_size)
            # Rank 0 refuses a run configured twice; one left here is from a configuration that
            # failed on rank 0 after this rank had built it.
            self._learners.pop(config.run_id, None)
            learner = build_learner(config, self._device, self._ranks.group, self._memory)
            if command.resume is not None:
                load_training_checkpoint(learner, command.resume)
            if config.gathers_state and command.gather_state:
                learner.state_dict()  # rank 0's equality check gathers the whole state: a collective
            self._learners[config.run_id] = learner
        elif isinstance(command, TrainCommand):
            learner = self._learner(command.run_id)
            learner.version = command.version
            learner.train_step(command.groups)
        elif isinstance(command, GatherCommand):
            learner = self._learner(command.run_id)
            if command.rounds is None:  # an export: the whole state dict
                learner.state_dict()
            else:  # a publish: the rounds in rank 0's publisher's order
                learner.gathered_rounds(command.rounds).drain()
        elif isinstance(command, CheckpointCommand):
            save_training_checkpoint(self._learner(command.run_id), command.directory, command.step)
        elif isinstance(command, EndCommand):
            self._learners.pop(command.run_id, None)
        else:
            raise ValueError(f"unknown rank command {command!r}")

    def _learner(self, run_id: str) -> Learner:
        learner = self._learners.get(run_id)
        if learner is None:
            raise ValueError(f"run {run_id!r} is not configured on rank {self._ranks.rank}")
        return learner
