"""The weight broker as trainers and engines see it: the `BrokerClient` seam, the `VersionWatch`
iterator of an engine's version events, and `GrpcBrokerClient`, the seam over gRPC. The broker
service (services/weight-broker) has the in-process twin over its BrokerCore (same behaviour, same
exceptions), so a whole RL loop can run in one process. Knows nothing about the broker's rules.
"""

from __future__ import annotations

import abc
import collections.abc
import logging
import threading
from collections.abc import Callable
from typing import Protocol

import grpc

from furlong.core.weight_shards import ShardLayout
from furlong.core.weight_versions import (
    RoundAck,
    VersionAck,
    VersionEventInfo,
    VersionStatusInfo,
    WeightSourceInfo,
)
from furlong.core.weights import Manifest
from furlong.rpc import call, channel, error_from_rpc
from furlong.transfer.wire import (
    event_from_proto,
    manifest_to_proto,
    round_ack_to_proto,
    shard_layout_from_proto,
    shard_layout_to_proto,
    source_to_proto,
    status_from_proto,
    version_ack_to_proto,
)
from furlong.v1 import weight_broker_pb2 as pb
from furlong.v1 import weight_broker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_WAIT_MARGIN_S = 5.0  # the WaitCommitted deadline exceeds the server-side wait by this much


class BrokerClient(Protocol):
    """What trainers and engines need from the broker. Implementations are thread-safe. Register,
    unregister and end_run are idempotent. Errors are furlong.core.errors domain exceptions
    (ConflictError for stale versions and failed versions, NotFoundError for unknown runs/engines,
    TimeoutError, UnavailableError when the broker cannot be reached)."""

    def register_engine(
        self, run_id: str, engine_id: str, shard_layout: ShardLayout | None = None
    ) -> int: ...
    def unregister_engine(self, run_id: str, engine_id: str) -> None: ...
    def destinations(self, run_id: str) -> list[ShardLayout]: ...
    def begin_version(self, run_id: str, manifest: Manifest, source: WeightSourceInfo) -> list[str]: ...
    def stage_round(self, run_id: str, version: int, index: int) -> list[str]: ...
    def wait_round(self, run_id: str, version: int, index: int, timeout_s: float) -> list[str]: ...
    def ack_round(self, ack: RoundAck) -> None: ...
    def watch_versions(self, run_id: str, engine_id: str) -> VersionWatch: ...
    def ack_version(self, ack: VersionAck) -> int: ...
    def wait_committed(self, run_id: str, version: int, timeout_s: float) -> VersionStatusInfo: ...
    def get_version(self, run_id: str) -> VersionStatusInfo: ...
    def end_run(self, run_id: str) -> None: ...
    def close(self) -> None: ...


class VersionWatch(collections.abc.Iterator[VersionEventInfo]):
    """A blocking iterator of an engine's version events (VersionEventInfo). It stops when the
    broker ends the stream (engine unregistered, run ended) or when close() is called from any
    thread. Errors (unknown engine, broker unreachable) are raised from the call that opened it or
    from the first next()."""

    @abc.abstractmethod
    def close(self) -> None:
        """Idempotent; a thread blocked in next() returns promptly with StopIteration."""


class _EventStream(Protocol):
    """The response iterator of a WatchVersions call (a grpc Call)."""

    def __next__(self) -> pb.VersionEvent: ...

    def cancel(self) -> bool: ...


class _GrpcVersionWatch(VersionWatch):
    def __init__(self, rendezvous: _EventStream, forget: Callable[[_GrpcVersionWatch], None]) -> None:
        self._call = rendezvous
        self._forget = forget
        self._closed = threading.Event()

    def __next__(self) -> VersionEventInfo:
        try:
            msg = next(self._call)
        except StopIteration:
            self._forget(self)
            raise
        except grpc.RpcError as err:
            self._forget(self)
            if self._closed.is_set() or err.code() == grpc.StatusCode.CANCELLED:
                raise StopIteration from None
            raise error_from_rpc(err) from None
        return event_from_proto(msg)

    def close(self) -> None:
        self._closed.set()
        self._call.cancel()
        self._forget(self)


class GrpcBrokerClient:
    """BrokerClient over gRPC. Unary calls use a deadline of timeout_s (WaitCommitted: its own
    timeout plus a margin); watch streams have none and are cancelled by close()."""

    def __init__(self, address: str, timeout_s: float = 10.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s {timeout_s} <= 0")
        self.address = address
        self._timeout_s = timeout_s
        self._channel = channel(address)
        self._stub = pb_grpc.WeightBrokerStub(self._channel)  # type: ignore[no-untyped-call]  # generated gRPC code is unannotated
        self._lock = threading.Lock()
        self._watches: set[_GrpcVersionWatch] = set()

    def register_engine(self, run_id: str, engine_id: str, shard_layout: ShardLayout | None = None) -> int:
        req = pb.RegisterEngineRequest(run_id=run_id, engine_id=engine_id)
        if shard_layout is not None:
            req.shard_layout.CopyFrom(shard_layout_to_proto(shard_layout))
        resp: pb.RegisterEngineResponse = call(self._stub.RegisterEngine, req, self._timeout_s)
        return resp.committed_version

    def destinations(self, run_id: str) -> list[ShardLayout]:
        resp = call(self._stub.GetDestinations, pb.GetDestinationsRequest(run_id=run_id), self._timeout_s)
        return [shard_layout_from_proto(layout) for layout in resp.layouts]

    def unregister_engine(self, run_id: str, engine_id: str) -> None:
        call(
            self._stub.UnregisterEngine,
            pb.UnregisterEngineRequest(run_id=run_id, engine_id=engine_id),
            self._timeout_s,
        )

    def begin_version(self, run_id: str, manifest: Manifest, source: WeightSourceInfo) -> list[str]:
        req = pb.BeginVersionRequest(
            run_id=run_id, manifest=manifest_to_proto(manifest), source=source_to_proto(source)
        )
        return list(call(self._stub.BeginVersion, req, self._timeout_s).engine_ids)

    def stage_round(self, run_id: str, version: int, index: int) -> list[str]:
        req = pb.StageRoundRequest(run_id=run_id, version=version, round=index)
        return list(call(self._stub.StageRound, req, self._timeout_s).engine_ids)

    def wait_round(self, run_id: str, version: int, index: int, timeout_s: float) -> list[str]:
        req = pb.WaitRoundRequest(run_id=run_id, version=version, round=index, timeout_s=timeout_s)
        return list(call(self._stub.WaitRound, req, timeout_s + _WAIT_MARGIN_S).fenced_engine_ids)

    def ack_round(self, ack: RoundAck) -> None:
        call(self._stub.AckRound, round_ack_to_proto(ack), self._timeout_s)

    def watch_versions(self, run_id: str, engine_id: str) -> VersionWatch:
        rendezvous = self._stub.WatchVersions(pb.WatchVersionsRequest(run_id=run_id, engine_id=engine_id))
        watch = _GrpcVersionWatch(rendezvous, self._forget)
        with self._lock:
            self._watches.add(watch)
        return watch

    def _forget(self, watch: _GrpcVersionWatch) -> None:
        with self._lock:
            self._watches.discard(watch)

    def ack_version(self, ack: VersionAck) -> int:
        resp: pb.AckVersionResponse = call(self._stub.AckVersion, version_ack_to_proto(ack), self._timeout_s)
        return resp.committed_version

    def wait_committed(self, run_id: str, version: int, timeout_s: float) -> VersionStatusInfo:
        req = pb.WaitCommittedRequest(run_id=run_id, version=version, timeout_s=timeout_s)
        return status_from_proto(call(self._stub.WaitCommitted, req, timeout_s + _WAIT_MARGIN_S))

    def get_version(self, run_id: str) -> VersionStatusInfo:
        return status_from_proto(
            call(self._stub.GetVersion, pb.GetVersionRequest(run_id=run_id), self._timeout_s)
        )

    def end_run(self, run_id: str) -> None:
        call(self._stub.EndRun, pb.EndRunBrokerRequest(run_id=run_id), self._timeout_s)

    def close(self) -> None:
        with self._lock:
            watches = list(self._watches)
        for watch in watches:
            watch.close()
        self._channel.close()
