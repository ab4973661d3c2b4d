"""Engines serving a run, as the rollout service reports them (`furlong.v1.Rollout/GetStatus`),
and draining one (`furlong.v1.Rollout/DrainEngine`).

`EngineStatusSource` is the seam: the REST API asks it for a run's engines and to drain one;
`GrpcEngineStatus` asks the rollout service.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from furlong import rpc
from furlong.v1 import rollout_pb2, rollout_pb2_grpc

SERVING, DRAINING, DRAINED = "serving", "draining", "drained"
ENGINE_STATES = (SERVING, DRAINING, DRAINED)
_STATE_FROM_PROTO = {
    rollout_pb2.ENGINE_STATE_SERVING: SERVING,
    rollout_pb2.ENGINE_STATE_DRAINING: DRAINING,
    rollout_pb2.ENGINE_STATE_DRAINED: DRAINED,
}


@dataclass(frozen=True)
class EngineInfo:
    engine_id: str
    policy_version: int  # the version the engine serves now
    healthy: bool
    state: str = SERVING  # one of ENGINE_STATES

    def __post_init__(self) -> None:
        if self.state not in ENGINE_STATES:
            raise ValueError(
                f"engine {self.engine_id}: state must be one of {ENGINE_STATES}, got {self.state!r}"
            )

    def to_dict(self) -> dict:
        return {
            "engine_id": self.engine_id,
            "policy_version": self.policy_version,
            "healthy": self.healthy,
            "state": self.state,
        }


def _engine_from_proto(e: rollout_pb2.EngineStatus) -> EngineInfo:
    if e.state not in _STATE_FROM_PROTO:
        raise ValueError(f"rollout reported engine {e.engine_id} in unknown state {e.state}")
    return EngineInfo(
        engine_id=e.engine_id,
        policy_version=e.policy_version,
        healthy=e.healthy,
        state=_STATE_FROM_PROTO[e.state],
    )


class EngineStatusSource(Protocol):
    def engines(self, run_id: str, timeout_s: float) -> list[EngineInfo]:
        """The run's engines; NotFoundError when rollout does not know the run. Thread-safe."""

    def drain(self, run_id: str, engine_id: str, timeout_s: float) -> EngineInfo:
        """Drain the engine (it takes no new work, finishes what it has); idempotent.
        NotFoundError for an unknown run or engine. Thread-safe."""


class GrpcEngineStatus:
    def __init__(self, address: str) -> None:
        self._channel = rpc.channel(address)
        self._stub = rollout_pb2_grpc.RolloutStub(self._channel)

    def engines(self, run_id: str, timeout_s: float) -> list[EngineInfo]:
        status = rpc.call(self._stub.GetStatus, rollout_pb2.GetRolloutStatusRequest(run_id=run_id), timeout_s)
        return [_engine_from_proto(e) for e in status.engines]

    def drain(self, run_id: str, engine_id: str, timeout_s: float) -> EngineInfo:
        return _engine_from_proto(
            rpc.call(
                self._stub.DrainEngine,
                rollout_pb2.DrainEngineRequest(run_id=run_id, engine_id=engine_id),
                timeout_s,
            )
        )

    def close(self) -> None:
        self._channel.close()
