"""The trainer's ranks under torchrun: how rank 0 drives the others.

`torchrun --nproc-per-node N -m furlong.trainer ...` starts N processes. Rank 0 serves gRPC as a
one-rank trainer does; every call that needs the other ranks (configure a run, train a step, end a
run, gather an FSDP2-sharded state dict whole or round by round for a publish, write an
FSDP2-sharded training checkpoint) is posted by rank 0 as a `RankCommand` and executed by the
others' `furlong.trainer.rank_follower` loop while rank 0 executes its own part. Commands travel
through the rendezvous store (a key per command, numbered in order), not through collectives, so an
idle follower waits on the store without a collective timeout; the collectives themselves (DDP's
gradient all-reduce, FSDP2's gathers, DCP's checkpoint writes) run on the group's process group.
Each follower reports the outcome of every command under a key of its own, and rank 0 raises
`RanksFailed` naming the ranks that failed and why.

Knows nothing of gRPC or Redis: commands carry plain values (sample groups read by rank 0, the
run's config). One command at a time across all runs (`command` holds a lock), since two runs'
collectives must never interleave.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, Store
from torch.distributed.rendezvous import rendezvous

from furlong.core.samples import SampleGroup
from furlong.trainer.api import TrainerRunConfig

log = logging.getLogger(__name__)

_COMMAND_KEY = "furlong/command/{seq}"
_RESULT_KEY = "furlong/result/{seq}/{rank}"
_GONE_KEY = "furlong/gone/{rank}"  # a follower that left its loop (stopped, or its store failed)
# How long one store wait blocks before the waiter looks around (torch logs a warning at each
# wait that times out, so not too often).
_COLLECT_POLL_S = 5.0  # rank 0 waiting for a result: whether the rank has left
_COMMAND_POLL_S = 10.0
# After rank 0's own part of a command failed: how long it waits for the followers' outcomes
# before it raises its error anyway (a follower stuck in a collective stays stuck).
_AFTER_ERROR_TIMEOUT_S = 60.0  # a follower waiting for the next command: whether it is stopping


class RanksFailed(RuntimeError):
    """One or more follower ranks failed a command (the message names each rank and its error)."""


@dataclass(frozen=True)
class ConfigureCommand:
    """Build the run's learner over the group (and load `resume`, a training checkpoint, if set).
    `gather_state`: rank 0 gathers the whole state dict once (the weight-update equality check),
    a collective every rank joins when the run's state is sharded."""

    config: TrainerRunConfig
    resume: str | None
    gather_state: bool = False


@dataclass(frozen=True)
class TrainCommand:
    """Train one step on rank 0's batch at policy version `version` (each rank its slice of it)."""

    run_id: str
    groups: list[SampleGroup]
    version: int


@dataclass(frozen=True)
class GatherCommand:
    """Gather the run's full state dict (FSDP2: a collective every rank joins; only rank 0 keeps it).
    With `rounds` (a publish: `WeightPublisher.publish_order`), gather it one round at a time in
    that order instead (`Learner.gathered_rounds`), never all of it at once."""

    run_id: str
    rounds: tuple[tuple[str, ...], ...] | None = None


@dataclass(frozen=True)
class CheckpointCommand:
    """Write the run's training checkpoint of `step` to `directory` (FSDP2: every rank writes its
    shards, rank 0 the manifest; megatron tensor parallelism: every rank joins the gathers of the
    whole tensors, rank 0 writes them)."""

    run_id: str
    directory: str
    step: int


@dataclass(frozen=True)
class EndCommand:
    run_id: str


@dataclass(frozen=True)
class ShutdownCommand:
    """The follower loop returns."""


RankCommand = (
    ConfigureCommand | TrainCommand | GatherCommand | CheckpointCommand | EndCommand | ShutdownCommand
)


class TrainerRanks:
    """This process's place in the trainer's group of ranks: its rank, the world size, the process
    group the learners run over and the store commands travel through.

    `command` (rank 0) is thread-safe and serialises commands; `next_command` and `report`
    (followers) are called from the follower loop only."""

    def __init__(
        self,
        store: Store,
        group: dist.ProcessGroup,
        rank: int,
        world_size: int,
        result_timeout_s: float = 1800.0,
        command_poll_s: float = _COMMAND_POLL_S,
    ) -> None:
        """`result_timeout_s`: how long rank 0 waits for a follower's outcome of one command;
        `command_poll_s`: how often a waiting follower looks at `stopping` (`next_command`)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world of {world_size} ranks")
        if result_timeout_s <= 0 or command_poll_s <= 0:
            raise ValueError(
                f"result_timeout_s and command_poll_s must be > 0, got {result_timeout_s}, {command_poll_s}"
            )
        self._command_poll_s = command_poll_s
        self.store = store
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self._result_timeout_s = result_timeout_s
        self._seq = 0
        self._lock = threading.Lock()

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # -- rank 0 -------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def command(self, command: RankCommand) -> Iterator[None]:
        """Post `command` to the followers, run the body (rank 0's own part of it), then wait for
        every follower's outcome: RanksFailed names those that failed. An error of the body itself
        wins over the followers' (they most likely failed the same way)."""
        if not self.is_leader:
            raise RuntimeError(f"rank {self.rank} cannot post commands; only rank 0 drives the ranks")
        with self._lock:
            try:
                seq = self._post(command)
            except dist.DistError as exc:
                raise RanksFailed(f"cannot post {type(command).__name__} to the ranks: {exc}") from exc
            try:
                yield
            except BaseException:
                # A follower may be waiting in a collective rank 0 never joined: do not wait long.
                with contextlib.suppress(RanksFailed, TimeoutError):
                    self._collect(seq, min(self._result_timeout_s, _AFTER_ERROR_TIMEOUT_S))
                raise
            self._collect(seq, self._result_timeout_s)

    def _post(self, command: RankCommand) -> int:
        self._seq += 1
        # torch annotates values as str; the store keeps bytes as they are
        self.store.set(_COMMAND_KEY.format(seq=self._seq), pickle.dumps(command))  # type: ignore[arg-type]
        return self._seq

    def _collect(self, seq: int, timeout_s: float) -> None:
        try:
            self._collect_results(seq, timeout_s)
        except dist.DistError as exc:  # the store itself failed (torchrun's agent is gone)
            raise RanksFailed(f"cannot read the ranks' outcomes of command {seq}: {exc}") from exc

    def _collect_results(self, seq: int, timeout_s: float) -> None:
        failures = []
        deadline = time.monotonic() + timeout_s
        for rank in range(1, self.world_size):
            key = _RESULT_KEY.format(seq=seq, rank=rank)
            if not self._wait_result(key, rank, deadline, timeout_s):
                failures.append(f"rank {rank}: left its loop before reporting command {seq}")
                continue
            error = self.store.get(key).decode()
            self.store.delete_key(key)
            if error:
                failures.append(f"rank {rank}: {error}")
        self.store.delete_key(_COMMAND_KEY.format(seq=seq))
        if failures:
            raise RanksFailed("; ".join(failures))

    def _wait_result(self, key: str, rank: int, deadline: float, timeout_s: float) -> bool:
        """Whether `key` was written (False: the rank has left its loop). TimeoutError at deadline."""
        while True:
            if self.store.check([key]):
                return True
            if self.store.check([_GONE_KEY.format(rank=rank)]):
                return False
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank} did not report {key} within {timeout_s:g}s")
            slice_s = min(_COLLECT_POLL_S, max(0.05, deadline - time.monotonic()))
            with contextlib.suppress(dist.DistStoreError):  # a slice ran out: look around again
                self.store.wait([key], datetime.timedelta(seconds=slice_s))

    def shutdown(self) -> None:
        """Stop the followers' loops (rank 0, once, when the service closes)."""
        with contextlib.suppress(RanksFailed, TimeoutError), self.command(ShutdownCommand()):
            pass
        log.info("the %d follower ranks stopped", self.world_size - 1)

    # -- followers ----------------------------------------------------------------------------------

    def next_command(self, stopping: Callable[[], bool]) -> RankCommand | None:
        """Block until rank 0 posts the next command; None once `stopping()` is true while waiting.
        A `dist.DistError` once the store is gone (the job is ending)."""
        self._seq += 1
        key = _COMMAND_KEY.format(seq=self._seq)
        while True:
            try:
                self.store.wait([key], datetime.timedelta(seconds=self._command_poll_s))
                break
            except dist.DistStoreError as exc:
                if "timeout" not in str(exc).lower():
                    raise
                if stopping():
                    return None
        command: RankCommand = pickle.loads(self.store.get(key))  # from rank 0 of this job only
        return command

    def leave(self) -> None:
        """Tell rank 0 that this follower runs no more commands (best effort: the store may be gone)."""
        with contextlib.suppress(dist.DistStoreError, RuntimeError):
            self.store.set(_GONE_KEY.format(rank=self.rank), "1")

    def report(self, error: str) -> None:
        """This rank's outcome of the current command ("" = done)."""
        self.store.set(_RESULT_KEY.format(seq=self._seq, rank=self.rank), error)


def join(backend: str, timeout_s: float = 1800.0) -> TrainerRanks:
    """Join the job's group from torchrun's environment (`env://`: RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) with `backend` (gloo on CPU, nccl on CUDA)."""
    store, rank, world_size = next(iter(rendezvous("env://")))
    timeout = datetime.timedelta(seconds=timeout_s)
    store.set_timeout(timeout)
    dist.init_process_group(
        backend, store=PrefixStore("pg", store), rank=rank, world_size=world_size, timeout=timeout
    )
    group = dist.group.WORLD
    assert group is not None  # init_process_group made it
    log.info("rank %d of %d joined (%s)", rank, world_size, backend)
    return TrainerRanks(PrefixStore("furlong", store), group, rank, world_size, timeout_s)
