"""Requests and results of the rollout service as plain values, shared by the service, its gRPC
server and its clients; plus the seams the service is built on (weight receivers, observers).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

# apply(version, tensors): called by a receiver with a verified version keyed by state_dict names.
ApplyWeightsFn = Callable[[int, Mapping[str, "torch.Tensor"]], None]


@dataclass(frozen=True)
class Prompt:
    prompt_id: str  # unique within the run
    text: str
    answer: str  # reference the reward compares against


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    policy_version: int
    engine_ids: list[str]


@dataclass(frozen=True)
class GenerateResult:
    run_id: str
    step: int
    num_groups: int
    num_samples: int
    reward_mean: float
    policy_version: int  # the oldest version any sample of the request was drawn with
    num_tokens: int  # generated tokens (refill rounds included)
    generate_seconds: float
    num_groups_dropped: int = 0  # dynamic sampling: constant after every refill round
    num_groups_refilled: int = 0  # dynamic sampling: groups drawn again, summed over rounds
    num_groups_surplus: int = 0  # over-sampling: groups beyond keep_groups, not written
    request_id: str = ""  # the request's sample ledger (refill round k: "<id>/r<k>")


class EngineState(enum.Enum):
    SERVING = "serving"  # takes new work
    DRAINING = "draining"  # drained, still finishing work it had taken
    DRAINED = "drained"  # drained, nothing in flight


@dataclass(frozen=True)
class EngineStatus:
    engine_id: str
    policy_version: int
    healthy: bool
    state: EngineState = EngineState.SERVING
    pid: int = 0  # engine process id; 0 for an engine inside the rollout service
    restarts: int = 0
    in_flight: int = 0  # chunks of work running on the engine now


@dataclass(frozen=True)
class LedgerCounts:
    """Where a run's samples are in the sample ledger, summed over its requests."""

    pending: int = 0
    in_flight: int = 0
    done: int = 0
    surplus: int = 0  # closed unwritten by over-sampling
    duplicates_refused: int = 0  # second results for a sample already done


@dataclass(frozen=True)
class RunStatus:
    run_id: str
    engines: list[EngineStatus]
    ledger: LedgerCounts = field(default_factory=LedgerCounts)


class WeightReceiverLike(Protocol):
    """Delivers new policy versions of one engine by calling its apply function from its own thread.
    `start` may raise (the run is then not configured); `close` is idempotent."""

    def start(self) -> None: ...

    def close(self) -> None: ...


class ReceiverFactory(Protocol):
    """Builds (does not start) the weight receiver of one engine of a run."""

    def __call__(self, run_id: str, engine_id: str, apply: ApplyWeightsFn) -> WeightReceiverLike: ...


class RolloutObserver(Protocol):
    """Told what the service did (metrics). Called from request and receiver threads; must not raise."""

    def generated(
        self, run_id: str, num_samples: int, num_tokens: int, seconds: float, reward_mean: float
    ) -> None: ...

    def version_applied(self, run_id: str, engine_id: str, version: int) -> None: ...

    def groups_filtered(self, run_id: str, dropped: int, refilled: int) -> None: ...

    def groups_surplus(self, run_id: str, surplus: int) -> None: ...

    def run_ended(self, run_id: str, engine_ids: list[str]) -> None: ...


class NullObserver:
    def generated(
        self, run_id: str, num_samples: int, num_tokens: int, seconds: float, reward_mean: float
    ) -> None:
        pass

    def version_applied(self, run_id: str, engine_id: str, version: int) -> None:
        pass

    def groups_filtered(self, run_id: str, dropped: int, refilled: int) -> None:
        pass

    def groups_surplus(self, run_id: str, surplus: int) -> None:
        pass

    def run_ended(self, run_id: str, engine_ids: list[str]) -> None:
        pass
