"""gRPC transport of the rollout service (`furlong.v1.Rollout`): converts proto messages to and from
the service's plain values; domain errors become status codes through `furlong.rpc.rpc_errors`.
"""

from __future__ import annotations

import grpc

from furlong.rollout.convert import (
    engine_status_to_proto,
    prompt_from_proto,
    result_to_proto,
    run_info_to_proto,
    sampling_from_proto,
    status_to_proto,
)
from furlong.rollout.core.service import RolloutService
from furlong.rpc import rpc_errors
from furlong.v1 import rollout_pb2 as pb
from furlong.v1 import rollout_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Rollout"].full_name  # "furlong.v1.Rollout"


class RolloutServicer(pb_grpc.RolloutServicer):
    """Thin transport over RolloutService; every method blocks one server thread while it runs."""

    def __init__(self, service: RolloutService) -> None:
        self._service = service

    def add_to_server(self, server: grpc.Server) -> None:
        pb_grpc.add_RolloutServicer_to_server(self, server)

    @rpc_errors
    def ConfigureRun(self, request, context):
        info = self._service.configure_run(
            request.run_id, request.model_dir, request.reward, request.num_engines, request.seed
        )
        return run_info_to_proto(info)

    @rpc_errors
    def Generate(self, request, context):
        if not request.HasField("sampling"):
            raise ValueError(f"run {request.run_id}: sampling is required")
        result = self._service.generate(
            run_id=request.run_id,
            step=request.step,
            prompts=[prompt_from_proto(p) for p in request.prompts],
            samples_per_prompt=request.samples_per_prompt,
            sampling=sampling_from_proto(request.sampling, request.min_p),
            min_policy_version=request.min_policy_version,
            timeout_s=request.timeout_s,
            max_refill_rounds=request.max_refill_rounds,
            keep_groups=request.keep_groups,
        )
        return result_to_proto(result)

    @rpc_errors
    def GetStatus(self, request, context):
        return status_to_proto(self._service.status(request.run_id))

    @rpc_errors
    def DrainEngine(self, request, context):
        return engine_status_to_proto(self._service.drain_engine(request.run_id, request.engine_id))

    @rpc_errors
    def EndRun(self, request, context):
        self._service.end_run(request.run_id)
        return pb.EndRolloutResponse(run_id=request.run_id)
