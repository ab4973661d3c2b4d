"""A run's lifecycle: its states, the transitions allowed between them, and the run record.

    pending  -> starting | cancelled (stopped while pending) | failed
    starting -> running | stopping (stopped while configuring) | failed
    running  -> paused | stopping | failed
    paused   -> running | stopping | failed
    stopping -> succeeded | failed | cancelled

`stopping` is the teardown phase (EndRun on every service), entered both after the last step and
after a stop request; the terminal state says why the run ended. A stop request on a started run is
recorded as `stop_requested`, a pause request as `pause_requested`; the run's driver acts on both
between phases (it enters `paused` before the next step and leaves it when the request is
cleared). `-> failed` from pending, starting, running or paused is for runs a restarted controller
finds orphaned. Knows nothing about Redis or HTTP.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any

from furlong.controller.run_spec import RunSpec, parse_run_spec
from furlong.core.errors import ConflictError


class RunState(str, enum.Enum):
    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES

    @classmethod
    def parse(cls, value: str) -> RunState:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown run state {value!r}; known: {[s.value for s in cls]}") from None


TERMINAL_STATES = frozenset({RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED})
ACTIVE_STATES = frozenset({RunState.STARTING, RunState.RUNNING, RunState.PAUSED, RunState.STOPPING})

TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    RunState.PENDING: frozenset({RunState.STARTING, RunState.CANCELLED, RunState.FAILED}),
    RunState.STARTING: frozenset({RunState.RUNNING, RunState.STOPPING, RunState.FAILED}),
    RunState.RUNNING: frozenset({RunState.PAUSED, RunState.STOPPING, RunState.FAILED}),
    RunState.PAUSED: frozenset({RunState.RUNNING, RunState.STOPPING, RunState.FAILED}),
    RunState.STOPPING: frozenset({RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED}),
    RunState.SUCCEEDED: frozenset(),
    RunState.FAILED: frozenset(),
    RunState.CANCELLED: frozenset(),
}


def check_transition(run_id: str, current: RunState, target: RunState) -> None:
    """Raise ConflictError unless current -> target is in the transition table."""
    if target not in TRANSITIONS[current]:
        allowed = sorted(s.value for s in TRANSITIONS[current]) or "none (terminal)"
        raise ConflictError(
            f"run {run_id}: illegal transition {current.value} -> {target.value} "
            f"(allowed from {current.value}: {allowed})"
        )


@dataclass(frozen=True)
class CheckpointRef:
    """A training checkpoint the trainer wrote for a run on request: the last completed step it
    holds, the policy version, the directory (as the trainer sees it) and when it was taken."""

    step: int
    path: str
    policy_version: int
    created_at: float

    def __post_init__(self) -> None:
        if self.step < 0 or not self.path:
            raise ValueError(f"checkpoint step {self.step} must be >= 0 and path {self.path!r} non-empty")

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "path": self.path,
            "policy_version": self.policy_version,
            "created_at": self.created_at,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckpointRef:
        return cls(
            step=int(data["step"]),
            path=str(data["path"]),
            policy_version=int(data["policy_version"]),
            created_at=float(data["created_at"]),
        )


@dataclass(frozen=True)
class PolicyRef:
    """A trained policy the trainer exported for a run as a Hugging Face model directory: the step
    it holds, whether that is the run's last (`final`), the policy version, the directory (as the
    trainer sees it), its safetensors shards and when it was written."""

    step: int
    path: str
    policy_version: int
    final: bool
    shards: tuple[str, ...]
    created_at: float

    def __post_init__(self) -> None:
        if self.step < 0 or not self.path or not self.shards:
            raise ValueError(
                f"policy step {self.step} must be >= 0, path {self.path!r} and shards "
                f"{self.shards!r} non-empty"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "path": self.path,
            "policy_version": self.policy_version,
            "final": self.final,
            "shards": list(self.shards),
            "created_at": self.created_at,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PolicyRef:
        return cls(
            step=int(data["step"]),
            path=str(data["path"]),
            policy_version=int(data["policy_version"]),
            final=bool(data["final"]),
            shards=tuple(str(s) for s in data["shards"]),
            created_at=float(data["created_at"]),
        )


@dataclass(frozen=True)
class Run:
    """What the controller knows about one run. Times are Unix seconds; `current_step` is the last
    completed step (0 before the first) and `policy_version` the last committed version."""

    run_id: str
    spec: RunSpec
    state: RunState
    created_at: float
    updated_at: float
    reason: str = ""
    started_at: float | None = None
    finished_at: float | None = None
    current_step: int = 0
    policy_version: int = 0
    stop_requested: bool = False
    pause_requested: bool = False
    checkpoint: CheckpointRef | None = None  # the latest checkpoint taken on request
    policies: tuple[PolicyRef, ...] = ()  # exported policies, by step (the final one last)

    def transitioned(self, target: RunState, now: float, reason: str | None = None) -> Run:
        """This run moved to target at time now; raises ConflictError for an illegal move."""
        check_transition(self.run_id, self.state, target)
        return replace(
            self,
            state=target,
            updated_at=now,
            reason=self.reason if reason is None else reason,
            started_at=now if target == RunState.STARTING else self.started_at,
            finished_at=now if target.terminal else self.finished_at,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "name": self.spec.name,
            "state": self.state.value,
            "reason": self.reason,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "current_step": self.current_step,
            "total_steps": self.spec.steps,
            "policy_version": self.policy_version,
            "stop_requested": self.stop_requested,
            "pause_requested": self.pause_requested,
            "checkpoint": self.checkpoint.to_dict() if self.checkpoint is not None else None,
            "policies": [p.to_dict() for p in self.policies],
            "spec": self.spec.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Run:
        return cls(
            run_id=data["run_id"],
            spec=parse_run_spec(data["spec"]),
            state=RunState.parse(data["state"]),
            created_at=float(data["created_at"]),
            updated_at=float(data["updated_at"]),
            reason=data.get("reason", ""),
            started_at=data.get("started_at"),
            finished_at=data.get("finished_at"),
            current_step=int(data.get("current_step", 0)),
            policy_version=int(data.get("policy_version", 0)),
            stop_requested=bool(data.get("stop_requested", False)),
            pause_requested=bool(data.get("pause_requested", False)),
            checkpoint=CheckpointRef.from_dict(data["checkpoint"]) if data.get("checkpoint") else None,
            policies=tuple(PolicyRef.from_dict(p) for p in data.get("policies", ())),
        )
