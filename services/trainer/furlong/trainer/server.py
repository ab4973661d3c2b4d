"""gRPC transport of the trainer: converts furlong.v1 messages to `TrainerService` calls and back
(`convert`, written once for server and client). Errors are mapped to status codes by
`furlong.rpc.rpc_errors`, nowhere else."""

from __future__ import annotations

from typing import Any

from furlong.rpc import rpc_errors
from furlong.trainer import convert
from furlong.trainer.api import SERVICE_NAME
from furlong.trainer.service import TrainerService
from furlong.v1 import trainer_pb2, trainer_pb2_grpc

__all__ = ["SERVICE_NAME", "TrainerServicer", "register"]


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, service: TrainerService):
        self._service = service

    @rpc_errors
    def ConfigureRun(self, request, context):
        return convert.run_to_proto(self._service.configure_run(convert.config_from_proto(request)))

    @rpc_errors
    def TrainStep(self, request, context):
        return convert.step_result_to_proto(
            self._service.train_step(convert.step_request_from_proto(request))
        )

    @rpc_errors
    def PublishWeights(self, request, context):
        return convert.published_to_proto(self._service.publish_weights(request.run_id, request.version))

    @rpc_errors
    def EndRun(self, request, context):
        self._service.end_run(request.run_id)
        return trainer_pb2.EndRunResponse(run_id=request.run_id)

    @rpc_errors
    def Offload(self, request, context):
        return convert.offloaded_to_proto(self._service.offload(request.run_id))

    @rpc_errors
    def Restore(self, request, context):
        version = self._service.restore(request.run_id)
        return trainer_pb2.RestoreResponse(run_id=request.run_id, policy_version=version)

    @rpc_errors
    def Checkpoint(self, request, context):
        return convert.checkpoint_to_proto(self._service.checkpoint(request.run_id, request.directory))


def register(service: TrainerService) -> Any:
    """A `furlong.rpc.start_server` registration callback."""
    return lambda server: trainer_pb2_grpc.add_TrainerServicer_to_server(TrainerServicer(service), server)
