"""The WeightBroker gRPC service: converts furlong.v1 messages to domain objects and back (with the
conversions of furlong.transfer.wire, shared with the gRPC client), and calls the broker core.
Status codes come from furlong.rpc; nothing here decides anything about versions.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc

from furlong.rpc import rpc_errors
from furlong.transfer.wire import (
    event_to_proto,
    manifest_from_proto,
    round_ack_from_proto,
    shard_layout_from_proto,
    shard_layout_to_proto,
    source_from_proto,
    status_to_proto,
    version_ack_from_proto,
)
from furlong.v1 import weight_broker_pb2 as pb
from furlong.v1 import weight_broker_pb2_grpc as pb_grpc
from furlong.weight_broker.core import BrokerCore, EventSubscription

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["WeightBroker"].full_name  # "furlong.v1.WeightBroker"


# -- service ----------------------------------------------------------------------------------------


class WeightBrokerServicer(pb_grpc.WeightBrokerServicer):
    """Thin transport over BrokerCore. Each open WatchVersions stream holds one server thread."""

    def __init__(self, core: BrokerCore, stream_poll_s: float = 0.5) -> None:
        self._core = core
        self._stream_poll_s = stream_poll_s

    def add_to_server(self, server: grpc.Server) -> None:
        pb_grpc.add_WeightBrokerServicer_to_server(self, server)  # type: ignore[no-untyped-call]  # generated gRPC code is unannotated

    @rpc_errors
    def RegisterEngine(
        self, request: pb.RegisterEngineRequest, context: grpc.ServicerContext
    ) -> pb.RegisterEngineResponse:
        layout = shard_layout_from_proto(request.shard_layout) if request.HasField("shard_layout") else None
        committed = self._core.register_engine(request.run_id, request.engine_id, layout)
        return pb.RegisterEngineResponse(run_id=request.run_id, committed_version=committed)

    @rpc_errors
    def UnregisterEngine(
        self, request: pb.UnregisterEngineRequest, context: grpc.ServicerContext
    ) -> pb.UnregisterEngineResponse:
        self._core.unregister_engine(request.run_id, request.engine_id)
        return pb.UnregisterEngineResponse(run_id=request.run_id)

    @rpc_errors
    def BeginVersion(
        self, request: pb.BeginVersionRequest, context: grpc.ServicerContext
    ) -> pb.BeginVersionResponse:
        if not request.HasField("manifest") or not request.HasField("source"):
            raise ValueError(f"run {request.run_id}: BeginVersion needs both manifest and source")
        manifest = manifest_from_proto(request.manifest)
        engines = self._core.begin_version(request.run_id, manifest, source_from_proto(request.source))
        return pb.BeginVersionResponse(run_id=request.run_id, version=manifest.version, engine_ids=engines)

    @rpc_errors
    def StageRound(
        self, request: pb.StageRoundRequest, context: grpc.ServicerContext
    ) -> pb.StageRoundResponse:
        engines = self._core.stage_round(request.run_id, request.version, request.round)
        return pb.StageRoundResponse(run_id=request.run_id, engine_ids=engines)

    @rpc_errors
    def WaitRound(self, request: pb.WaitRoundRequest, context: grpc.ServicerContext) -> pb.WaitRoundResponse:
        fenced = self._core.wait_round(request.run_id, request.version, request.round, request.timeout_s)
        return pb.WaitRoundResponse(run_id=request.run_id, fenced_engine_ids=fenced)

    @rpc_errors
    def AckRound(self, request: pb.AckRoundRequest, context: grpc.ServicerContext) -> pb.AckRoundResponse:
        self._core.ack_round(round_ack_from_proto(request))
        return pb.AckRoundResponse(run_id=request.run_id)

    @rpc_errors
    def WatchVersions(
        self, request: pb.WatchVersionsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.VersionEvent]:
        # Subscribe before returning the stream so that an unknown engine is a status, not a hang.
        sub = self._core.subscribe(request.run_id, request.engine_id)
        # the client went away: stop waiting for its acks. False when it already had (a client
        # that cancels before this handler runs): the stream would never be iterated, so close now
        if not context.add_callback(sub.close):
            sub.close()
            return iter(())
        return self._stream(sub, context)

    def _stream(self, sub: EventSubscription, context: grpc.ServicerContext) -> Iterator[pb.VersionEvent]:
        try:
            while True:
                event = sub.get(self._stream_poll_s)
                if event is not None:
                    yield event_to_proto(event)
                elif sub.ended or not context.is_active():
                    return
        finally:
            sub.close()

    @rpc_errors
    def AckVersion(
        self, request: pb.AckVersionRequest, context: grpc.ServicerContext
    ) -> pb.AckVersionResponse:
        committed = self._core.ack_version(version_ack_from_proto(request))
        return pb.AckVersionResponse(run_id=request.run_id, committed_version=committed)

    @rpc_errors
    def WaitCommitted(
        self, request: pb.WaitCommittedRequest, context: grpc.ServicerContext
    ) -> pb.VersionStatus:
        return status_to_proto(self._core.wait_committed(request.run_id, request.version, request.timeout_s))

    @rpc_errors
    def GetVersion(self, request: pb.GetVersionRequest, context: grpc.ServicerContext) -> pb.VersionStatus:
        return status_to_proto(self._core.get_version(request.run_id))

    @rpc_errors
    def GetDestinations(
        self, request: pb.GetDestinationsRequest, context: grpc.ServicerContext
    ) -> pb.GetDestinationsResponse:
        layouts = self._core.destinations(request.run_id)
        return pb.GetDestinationsResponse(
            run_id=request.run_id, layouts=[shard_layout_to_proto(x) for x in layouts]
        )

    @rpc_errors
    def EndRun(
        self, request: pb.EndRunBrokerRequest, context: grpc.ServicerContext
    ) -> pb.EndRunBrokerResponse:
        self._core.end_run(request.run_id)
        return pb.EndRunBrokerResponse(run_id=request.run_id)
