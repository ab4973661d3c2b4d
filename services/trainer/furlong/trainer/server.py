"""gRPC transport of the trainer: converts furlong.v1 messages to `TrainerService` calls and back
(`convert`, written once for server and client). Errors are mapped to status codes by
`furlong.rpc.rpc_errors`, nowhere else."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from furlong.rpc import rpc_errors
from furlong.trainer import convert
from furlong.trainer.api import SERVICE_NAME
from furlong.trainer.service import TrainerService
from furlong.v1 import trainer_pb2, trainer_pb2_grpc

__all__ = ["SERVICE_NAME", "TrainerServicer", "register"]


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, service: TrainerService) -> None:
        self._service = service

    @rpc_errors
    def ConfigureRun(
        self, request: trainer_pb2.ConfigureRunRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.ConfigureRunResponse:
        return convert.run_to_proto(self._service.configure_run(convert.config_from_proto(request)))

    @rpc_errors
    def TrainStep(
        self, request: trainer_pb2.TrainStepRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.TrainStepResponse:
        return convert.step_result_to_proto(
            self._service.train_step(convert.step_request_from_proto(request))
        )

    @rpc_errors
    def PublishWeights(
        self, request: trainer_pb2.PublishWeightsRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.PublishWeightsResponse:
        return convert.published_to_proto(self._service.publish_weights(request.run_id, request.version))

    @rpc_errors
    def EndRun(
        self, request: trainer_pb2.EndRunRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.EndRunResponse:
        self._service.end_run(request.run_id)
        return trainer_pb2.EndRunResponse(run_id=request.run_id)

    @rpc_errors
    def DeleteCheckpoints(
        self, request: trainer_pb2.DeleteCheckpointsRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.DeleteCheckpointsResponse:
        removed = self._service.delete_checkpoints(request.run_id)
        return trainer_pb2.DeleteCheckpointsResponse(run_id=request.run_id, num_removed=removed)

    @rpc_errors
    def Offload(
        self, request: trainer_pb2.OffloadRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.OffloadResponse:
        return convert.offloaded_to_proto(self._service.offload(request.run_id))

    @rpc_errors
    def Restore(
        self, request: trainer_pb2.RestoreRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.RestoreResponse:
        version = self._service.restore(request.run_id)
        return trainer_pb2.RestoreResponse(run_id=request.run_id, policy_version=version)

    @rpc_errors
    def Checkpoint(
        self, request: trainer_pb2.CheckpointRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.CheckpointResponse:
        return convert.checkpoint_to_proto(self._service.checkpoint(request.run_id, request.directory))

    @rpc_errors
    def ExportPolicy(
        self, request: trainer_pb2.ExportPolicyRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.ExportPolicyResponse:
        result = self._service.export_policy(request.run_id, request.directory, request.max_shard_bytes)
        return convert.export_to_proto(result)


def register(service: TrainerService) -> Callable[[grpc.Server], None]:
    """A `furlong.rpc.start_server` registration callback."""

    def add(server: grpc.Server) -> None:
        trainer_pb2_grpc.add_TrainerServicer_to_server(TrainerServicer(service), server)  # type: ignore[no-untyped-call]  # generated gRPC code is unannotated

    return add
