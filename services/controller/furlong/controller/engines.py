"""Engines serving a run, as the rollout service reports them (`furlong.v1.Rollout/GetStatus`).

`EngineStatusSource` is the seam: the REST API asks it for a run's engines; `GrpcEngineStatus`
asks the rollout service. Draining an engine is not offered: rollout has no RPC for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from furlong import rpc
from furlong.v1 import rollout_pb2, rollout_pb2_grpc


@dataclass(frozen=True)
class EngineInfo:
    engine_id: str
    policy_version: int          # the version the engine serves now
    healthy: bool

    def to_dict(self) -> dict:
        return {"engine_id": self.engine_id, "policy_version": self.policy_version,
                "healthy": self.healthy}


class EngineStatusSource(Protocol):
    def engines(self, run_id: str, timeout_s: float) -> list[EngineInfo]:
        """The run's engines; NotFoundError when rollout does not know the run. Thread-safe."""


class GrpcEngineStatus:
    def __init__(self, address: str) -> None:
        self._channel = rpc.channel(address)
        self._stub = rollout_pb2_grpc.RolloutStub(self._channel)

    def engines(self, run_id: str, timeout_s: float) -> list[EngineInfo]:
        status = rpc.call(self._stub.GetStatus, rollout_pb2.GetRolloutStatusRequest(run_id=run_id),
                          timeout_s)
        return [EngineInfo(engine_id=e.engine_id, policy_version=e.policy_version,
                           healthy=e.healthy) for e in status.engines]

    def close(self) -> None:
        self._channel.close()
