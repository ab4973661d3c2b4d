"""Clients of the trainer: `GrpcTrainerClient` over gRPC and `InProcessTrainerClient` over a
`TrainerService` in this process, both implementing `api.TrainerClient` with the same behaviour and
exceptions, and `make_client` choosing between them (so a whole RL loop can run in one process).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from furlong.core.settings.checkpoint import DEFAULT_EXPORT_SHARD_BYTES
from furlong.rpc import call, channel
from furlong.trainer import convert
from furlong.trainer.api import (
    SERVICE_NAME,
    CheckpointResult,
    Offloaded,
    PolicyExport,
    Published,
    TrainerClient,
    TrainerRun,
    TrainerRunConfig,
    TrainStepRequest,
    TrainStepResult,
)
from furlong.v1 import trainer_pb2 as pb
from furlong.v1 import trainer_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from furlong.trainer.service import TrainerService

__all__ = ["SERVICE_NAME", "GrpcTrainerClient", "InProcessTrainerClient", "TrainerDeadlines", "make_client"]


@dataclass(frozen=True)
class TrainerDeadlines:
    """gRPC deadlines in seconds. `configure_s` covers loading a checkpoint, `checkpoint_s` the wait
    for a step in progress and writing a checkpoint or an exported policy; a train step's deadline
    is its own timeout_s plus `wait_margin_s`, so the trainer's own wait answers first."""

    call_s: float = 30.0
    configure_s: float = 300.0
    publish_s: float = 120.0
    checkpoint_s: float = 300.0
    wait_margin_s: float = 10.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"TrainerDeadlines.{f.name} must be a finite number, got {value!r}")
            if value <= 0:
                raise ValueError(f"TrainerDeadlines.{f.name} must be > 0, got {value!r}")


class GrpcTrainerClient:
    def __init__(self, address: str, deadlines: TrainerDeadlines = TrainerDeadlines()) -> None:
        self.address = address
        self._deadlines = deadlines
        self._channel = channel(address)
        self._stub = pb_grpc.TrainerStub(self._channel)  # type: ignore[no-untyped-call]  # generated gRPC code is unannotated

    def configure_run(self, config: TrainerRunConfig) -> TrainerRun:
        response = call(self._stub.ConfigureRun, convert.config_to_proto(config), self._deadlines.configure_s)
        return convert.run_from_proto(response)

    def train_step(self, request: TrainStepRequest) -> TrainStepResult:
        deadline_s = max(float(request.timeout_s), 0.0) + self._deadlines.wait_margin_s
        response = call(self._stub.TrainStep, convert.step_request_to_proto(request), deadline_s)
        return convert.step_result_from_proto(response)

    def publish_weights(self, run_id: str, version: int) -> Published:
        request = pb.PublishWeightsRequest(run_id=run_id, version=version)
        return convert.published_from_proto(
            call(self._stub.PublishWeights, request, self._deadlines.publish_s)
        )

    def checkpoint(self, run_id: str, directory: str = "") -> CheckpointResult:
        request = pb.CheckpointRequest(run_id=run_id, directory=directory)
        response = call(self._stub.Checkpoint, request, self._deadlines.checkpoint_s)
        return convert.checkpoint_from_proto(response)

    def export_policy(
        self, run_id: str, directory: str = "", max_shard_bytes: int = DEFAULT_EXPORT_SHARD_BYTES
    ) -> PolicyExport:
        request = pb.ExportPolicyRequest(run_id=run_id, directory=directory, max_shard_bytes=max_shard_bytes)
        response = call(self._stub.ExportPolicy, request, self._deadlines.checkpoint_s)
        return convert.export_from_proto(response)

    def offload(self, run_id: str) -> Offloaded:
        response = call(self._stub.Offload, pb.OffloadRequest(run_id=run_id), self._deadlines.call_s)
        return convert.offloaded_from_proto(response)

    def restore(self, run_id: str) -> int:
        response = call(self._stub.Restore, pb.RestoreRequest(run_id=run_id), self._deadlines.call_s)
        return int(response.policy_version)

    def end_run(self, run_id: str) -> None:
        call(self._stub.EndRun, pb.EndRunRequest(run_id=run_id), self._deadlines.call_s)

    def delete_checkpoints(self, run_id: str) -> int:
        request = pb.DeleteCheckpointsRequest(run_id=run_id)
        return int(call(self._stub.DeleteCheckpoints, request, self._deadlines.call_s).num_removed)

    def close(self) -> None:
        self._channel.close()


class InProcessTrainerClient:
    """TrainerClient calling a TrainerService in this process; close() leaves the service running."""

    def __init__(self, service: TrainerService) -> None:
        self._service = service

    def configure_run(self, config: TrainerRunConfig) -> TrainerRun:
        return self._service.configure_run(config)

    def train_step(self, request: TrainStepRequest) -> TrainStepResult:
        return self._service.train_step(request)

    def publish_weights(self, run_id: str, version: int) -> Published:
        return self._service.publish_weights(run_id, version)

    def checkpoint(self, run_id: str, directory: str = "") -> CheckpointResult:
        return self._service.checkpoint(run_id, directory)

    def export_policy(
        self, run_id: str, directory: str = "", max_shard_bytes: int = DEFAULT_EXPORT_SHARD_BYTES
    ) -> PolicyExport:
        return self._service.export_policy(run_id, directory, max_shard_bytes)

    def offload(self, run_id: str) -> Offloaded:
        return self._service.offload(run_id)

    def restore(self, run_id: str) -> int:
        return self._service.restore(run_id)

    def end_run(self, run_id: str) -> None:
        self._service.end_run(run_id)

    def delete_checkpoints(self, run_id: str) -> int:
        return self._service.delete_checkpoints(run_id)

    def close(self) -> None:
        pass


def make_client(
    target: str | TrainerService, deadlines: TrainerDeadlines = TrainerDeadlines()
) -> TrainerClient:
    """The gRPC client for a "host:port" address, the in-process twin for a TrainerService."""
    if isinstance(target, str):
        return GrpcTrainerClient(target, deadlines)
    return InProcessTrainerClient(target)
