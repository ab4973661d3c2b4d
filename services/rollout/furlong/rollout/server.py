"""gRPC transport of the rollout service (`furlong.v1.Rollout`): converts proto messages to and from
the service's plain values (`convert`, written once for server and client); domain errors become
status codes through `furlong.rpc.rpc_errors`.
"""

from __future__ import annotations

import grpc

from furlong.rollout import convert
from furlong.rollout.client import SERVICE_NAME
from furlong.rollout.core.service import RolloutService
from furlong.rpc import rpc_errors
from furlong.v1 import rollout_pb2 as pb
from furlong.v1 import rollout_pb2_grpc as pb_grpc

__all__ = ["SERVICE_NAME", "RolloutServicer"]


class RolloutServicer(pb_grpc.RolloutServicer):
    """Thin transport over RolloutService; every method blocks one server thread while it runs."""

    def __init__(self, service: RolloutService) -> None:
        self._service = service

    def add_to_server(self, server: grpc.Server) -> None:
        pb_grpc.add_RolloutServicer_to_server(self, server)  # type: ignore[no-untyped-call]  # generated gRPC code is unannotated

    @rpc_errors
    def ConfigureRun(
        self, request: pb.ConfigureRolloutRequest, context: grpc.ServicerContext
    ) -> pb.ConfigureRolloutResponse:
        return convert.run_info_to_proto(self._service.configure_run(convert.run_config_from_proto(request)))

    @rpc_errors
    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.GenerateResponse:
        return convert.result_to_proto(self._service.generate(convert.request_from_proto(request)))

    @rpc_errors
    def Evaluate(self, request: pb.EvaluateRequest, context: grpc.ServicerContext) -> pb.EvaluateResponse:
        return convert.evaluate_result_to_proto(
            self._service.evaluate(convert.evaluate_request_from_proto(request))
        )

    @rpc_errors
    def GetStatus(
        self, request: pb.GetRolloutStatusRequest, context: grpc.ServicerContext
    ) -> pb.RolloutStatus:
        return convert.status_to_proto(self._service.status(request.run_id))

    @rpc_errors
    def DrainEngine(self, request: pb.DrainEngineRequest, context: grpc.ServicerContext) -> pb.EngineStatus:
        return convert.engine_status_to_proto(self._service.drain_engine(request.run_id, request.engine_id))

    @rpc_errors
    def EndRun(self, request: pb.EndRolloutRequest, context: grpc.ServicerContext) -> pb.EndRolloutResponse:
        self._service.end_run(request.run_id)
        return pb.EndRolloutResponse(run_id=request.run_id)
