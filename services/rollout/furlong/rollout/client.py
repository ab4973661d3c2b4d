"""Clients of the rollout service: `GrpcRolloutClient` over gRPC and its in-process twin
`InProcessRolloutClient` over a RolloutService, both implementing `api.RolloutClient` with the same
behaviour and exceptions, and `make_client` choosing between them, so a whole RL loop can run in one
process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from furlong.rollout import convert
from furlong.rollout.api import (
    SERVICE_NAME,
    EngineStatus,
    EvaluateRequest,
    EvaluateResult,
    GenerateRequest,
    GenerateResult,
    RolloutClient,
    RolloutRunConfig,
    RunInfo,
    RunStatus,
)
from furlong.rpc import call, channel
from furlong.v1 import rollout_pb2 as pb
from furlong.v1 import rollout_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from furlong.rollout.core.service import RolloutService

__all__ = [
    "SERVICE_NAME",
    "GrpcRolloutClient",
    "InProcessRolloutClient",
    "RolloutClient",
    "RolloutDeadlines",
    "make_client",
]


@dataclass(frozen=True)
class RolloutDeadlines:
    """gRPC deadlines in seconds: `call_s` for status, drain and end_run, `configure_s` for
    configure_run (it loads a checkpoint), and a request's own timeout_s plus `generate_margin_s`
    for generate and evaluate (the wait for the policy version, then the generation)."""

    call_s: float = 10.0
    configure_s: float = 300.0
    generate_margin_s: float = 600.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"RolloutDeadlines.{f.name} must be a finite number, got {value!r}")
            if value <= 0:
                raise ValueError(f"RolloutDeadlines.{f.name} must be > 0, got {value!r}")


class GrpcRolloutClient:
    def __init__(self, address: str, deadlines: RolloutDeadlines = RolloutDeadlines()) -> None:
        self.address = address
        self._deadlines = deadlines
        self._channel = channel(address)
        self._stub = pb_grpc.RolloutStub(self._channel)  # type: ignore[no-untyped-call]  # generated gRPC code is unannotated

    def configure_run(self, config: RolloutRunConfig) -> RunInfo:
        response = call(
            self._stub.ConfigureRun, convert.run_config_to_proto(config), self._deadlines.configure_s
        )
        return convert.run_info_from_proto(response)

    def generate(self, request: GenerateRequest) -> GenerateResult:
        deadline_s = max(float(request.timeout_s), 0.0) + self._deadlines.generate_margin_s
        return convert.result_from_proto(
            call(self._stub.Generate, convert.request_to_proto(request), deadline_s)
        )

    def evaluate(self, request: EvaluateRequest) -> EvaluateResult:
        deadline_s = max(float(request.timeout_s), 0.0) + self._deadlines.generate_margin_s
        return convert.evaluate_result_from_proto(
            call(self._stub.Evaluate, convert.evaluate_request_to_proto(request), deadline_s)
        )

    def status(self, run_id: str) -> RunStatus:
        response = call(
            self._stub.GetStatus, pb.GetRolloutStatusRequest(run_id=run_id), self._deadlines.call_s
        )
        return convert.status_from_proto(response)

    def drain_engine(self, run_id: str, engine_id: str) -> EngineStatus:
        request = pb.DrainEngineRequest(run_id=run_id, engine_id=engine_id)
        return convert.engine_status_from_proto(call(self._stub.DrainEngine, request, self._deadlines.call_s))

    def end_run(self, run_id: str) -> None:
        call(self._stub.EndRun, pb.EndRolloutRequest(run_id=run_id), self._deadlines.call_s)

    def close(self) -> None:
        self._channel.close()


class InProcessRolloutClient:
    """RolloutClient calling a RolloutService in this process. close() leaves the service running."""

    def __init__(self, service: RolloutService) -> None:
        self._service = service

    def configure_run(self, config: RolloutRunConfig) -> RunInfo:
        return self._service.configure_run(config)

    def generate(self, request: GenerateRequest) -> GenerateResult:
        return self._service.generate(request)

    def evaluate(self, request: EvaluateRequest) -> EvaluateResult:
        return self._service.evaluate(request)

    def status(self, run_id: str) -> RunStatus:
        return self._service.status(run_id)

    def drain_engine(self, run_id: str, engine_id: str) -> EngineStatus:
        return self._service.drain_engine(run_id, engine_id)

    def end_run(self, run_id: str) -> None:
        self._service.end_run(run_id)

    def close(self) -> None:
        pass


def make_client(
    target: str | RolloutService, deadlines: RolloutDeadlines = RolloutDeadlines()
) -> RolloutClient:
    """The gRPC client for a "host:port" address, the in-process twin for a RolloutService."""
    if isinstance(target, str):
        return GrpcRolloutClient(target, deadlines)
    return InProcessRolloutClient(target)
