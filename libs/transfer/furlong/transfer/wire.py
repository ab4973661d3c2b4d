"""The broker's wire: proto <-> domain conversions of furlong.v1 weight messages (manifests, shard
layouts, weight sources, version events and statuses, round and version acknowledgements), written
once for the broker's server and its gRPC client. Pure functions; a message that names an unknown
enum value or checksum algorithm is a ValueError naming it. Knows nothing about channels, servers
or the broker's rules.
"""

from __future__ import annotations

from furlong.core.block_checksum import CHECKSUM_ALGORITHM
from furlong.core.cuda_ipc_share import CudaIpcShare
from furlong.core.weight_shards import ShardLayout, ShardPiece, ShardTensor
from furlong.core.weight_versions import (
    EventKind,
    RoundAck,
    VersionAck,
    VersionEventInfo,
    VersionStatusInfo,
    WeightSourceInfo,
)
from furlong.core.weights import (
    BucketPlan,
    BucketRound,
    Manifest,
    TensorSlot,
    WeightLayout,
    dtype_from_name,
    dtype_name,
)
from furlong.v1 import common_pb2
from furlong.v1 import weight_broker_pb2 as pb

_KIND_TO_PROTO = {
    EventKind.PUBLISHED: pb.VersionEvent.PUBLISHED,
    EventKind.COMMITTED: pb.VersionEvent.COMMITTED,
    EventKind.ROUND_READY: pb.VersionEvent.ROUND_READY,
    EventKind.FENCED: pb.VersionEvent.FENCED,
}
_KIND_FROM_PROTO = {v: k for k, v in _KIND_TO_PROTO.items()}


def manifest_to_proto(manifest: Manifest) -> common_pb2.WeightManifest:
    return common_pb2.WeightManifest(
        version=manifest.version,
        tensors=[
            common_pb2.TensorEntry(
                name=s.name,
                dtype=dtype_name(s.dtype),
                shape=list(s.shape),
                offset_bytes=s.offset_bytes,
                size_bytes=s.size_bytes,
            )
            for s in manifest.layout.slots
        ],
        total_bytes=manifest.total_bytes,
        checksum_algorithm=CHECKSUM_ALGORITHM,
        checksum=manifest.checksum,
        bucket_size_bytes=manifest.bucket_plan.bucket_size_bytes,
        rounds=[
            common_pb2.BucketRound(
                index=r.index,
                offset_bytes=r.offset_bytes,
                size_bytes=r.size_bytes,
                names=list(r.names),
                checksum=r.checksum,
                bucket_offset_bytes=r.bucket_offset_bytes,
            )
            for r in manifest.rounds
        ],
        destinations=[
            common_pb2.DestinationChecksums(layout_id=layout_id, round_checksums=list(digests))
            for layout_id, digests in manifest.destinations
        ],
    )


def manifest_from_proto(msg: common_pb2.WeightManifest) -> Manifest:
    if msg.checksum_algorithm != CHECKSUM_ALGORITHM:
        raise ValueError(
            f"manifest of version {msg.version}: checksum_algorithm "
            f"{msg.checksum_algorithm!r} is not {CHECKSUM_ALGORITHM!r}"
        )
    slots = tuple(
        TensorSlot(
            name=t.name,
            dtype=dtype_from_name(t.dtype),
            shape=tuple(t.shape),
            offset_bytes=t.offset_bytes,
            size_bytes=t.size_bytes,
        )
        for t in msg.tensors
    )
    layout = WeightLayout(slots=slots, total_bytes=msg.total_bytes)
    plan = None
    if msg.rounds:
        plan = BucketPlan(
            msg.bucket_size_bytes,
            tuple(
                BucketRound(
                    index=r.index,
                    offset_bytes=r.offset_bytes,
                    size_bytes=r.size_bytes,
                    names=tuple(r.names),
                    checksum=r.checksum,
                    bucket_offset_bytes=r.bucket_offset_bytes,
                )
                for r in msg.rounds
            ),
        )
    destinations = tuple((d.layout_id, tuple(d.round_checksums)) for d in msg.destinations)
    return Manifest(
        version=msg.version, layout=layout, checksum=msg.checksum, plan=plan, destinations=destinations
    )


def shard_layout_to_proto(layout: ShardLayout) -> pb.ShardLayout:
    return pb.ShardLayout(
        tensors=[
            pb.ShardTensor(
                name=t.name,
                pieces=[
                    pb.ShardPiece(
                        source=p.source, whole=p.dim is None, dim=p.dim or 0, start=p.start, stop=p.stop
                    )
                    for p in t.pieces
                ],
            )
            for t in layout.tensors
        ]
    )


def shard_layout_from_proto(msg: pb.ShardLayout) -> ShardLayout:
    return ShardLayout(
        tuple(
            ShardTensor(
                t.name,
                tuple(
                    ShardPiece(p.source) if p.whole else ShardPiece(p.source, p.dim, p.start, p.stop)
                    for p in t.pieces
                ),
            )
            for t in msg.tensors
        )
    )


def cuda_ipc_share_to_proto(share: CudaIpcShare) -> common_pb2.CudaIpcShare:
    return common_pb2.CudaIpcShare(
        host_id=share.host_id,
        device_uuid=share.device_uuid,
        handle=share.handle,
        storage_size_bytes=share.storage_size_bytes,
        storage_offset_bytes=share.storage_offset_bytes,
        offset_bytes=share.offset_bytes,
        ref_counter_handle=share.ref_counter_handle,
        ref_counter_offset=share.ref_counter_offset,
        event_handle=share.event_handle,
        event_sync_required=share.event_sync_required,
    )


def cuda_ipc_share_from_proto(msg: common_pb2.CudaIpcShare) -> CudaIpcShare:
    return CudaIpcShare(
        host_id=msg.host_id,
        device_uuid=msg.device_uuid,
        handle=msg.handle,
        storage_size_bytes=msg.storage_size_bytes,
        storage_offset_bytes=msg.storage_offset_bytes,
        offset_bytes=msg.offset_bytes,
        ref_counter_handle=msg.ref_counter_handle,
        ref_counter_offset=msg.ref_counter_offset,
        event_handle=msg.event_handle,
        event_sync_required=msg.event_sync_required,
    )


def source_to_proto(source: WeightSourceInfo) -> common_pb2.WeightSource:
    return common_pb2.WeightSource(
        agent_name=source.agent_name,
        agent_metadata=source.agent_metadata,
        base_address=source.base_address,
        size_bytes=source.size_bytes,
        memory_kind=source.memory_kind,
        device_id=source.device_id,
        shm_name=source.shm_name,
        stream_address=source.stream_address,
        holds_all_rounds=source.holds_all_rounds,
        cuda_ipc=None if source.cuda_ipc is None else cuda_ipc_share_to_proto(source.cuda_ipc),
    )


def source_from_proto(msg: common_pb2.WeightSource) -> WeightSourceInfo:
    return WeightSourceInfo(
        agent_name=msg.agent_name,
        agent_metadata=msg.agent_metadata,
        base_address=msg.base_address,
        size_bytes=msg.size_bytes,
        memory_kind=msg.memory_kind,
        device_id=msg.device_id,
        shm_name=msg.shm_name,
        stream_address=msg.stream_address,
        holds_all_rounds=msg.holds_all_rounds,
        cuda_ipc=cuda_ipc_share_from_proto(msg.cuda_ipc) if msg.HasField("cuda_ipc") else None,
    )


def event_to_proto(event: VersionEventInfo) -> pb.VersionEvent:
    msg = pb.VersionEvent(
        run_id=event.run_id,
        kind=_KIND_TO_PROTO[event.kind],
        version=event.version,
        round=event.round,
        reason=event.reason,
    )
    if event.manifest is not None:
        msg.manifest.CopyFrom(manifest_to_proto(event.manifest))
    if event.source is not None:
        msg.source.CopyFrom(source_to_proto(event.source))
    return msg


def event_from_proto(msg: pb.VersionEvent) -> VersionEventInfo:
    kind = _KIND_FROM_PROTO.get(msg.kind)
    if kind is None:
        raise ValueError(f"run {msg.run_id}: version event {msg.version} has unknown kind {msg.kind}")
    return VersionEventInfo(
        run_id=msg.run_id,
        kind=kind,
        version=msg.version,
        manifest=manifest_from_proto(msg.manifest) if msg.HasField("manifest") else None,
        source=source_from_proto(msg.source) if msg.HasField("source") else None,
        round=msg.round,
        reason=msg.reason,
    )


def status_to_proto(status: VersionStatusInfo) -> pb.VersionStatus:
    return pb.VersionStatus(
        run_id=status.run_id,
        latest_version=status.latest_version,
        committed_version=status.committed_version,
        engine_ids=list(status.engine_ids),
        pending_engine_ids=list(status.pending_engine_ids),
        fenced_engine_ids=list(status.fenced_engine_ids),
    )


def status_from_proto(msg: pb.VersionStatus) -> VersionStatusInfo:
    return VersionStatusInfo(
        run_id=msg.run_id,
        latest_version=msg.latest_version,
        committed_version=msg.committed_version,
        engine_ids=tuple(msg.engine_ids),
        pending_engine_ids=tuple(msg.pending_engine_ids),
        fenced_engine_ids=tuple(msg.fenced_engine_ids),
    )


def round_ack_to_proto(ack: RoundAck) -> pb.AckRoundRequest:
    return pb.AckRoundRequest(
        run_id=ack.run_id,
        engine_id=ack.engine_id,
        version=ack.version,
        round=ack.index,
        ok=ack.ok,
        error=ack.error,
        transfer_seconds=ack.transfer_seconds,
        transfer_bytes=ack.transfer_bytes,
        lane=ack.lane,
    )


def round_ack_from_proto(msg: pb.AckRoundRequest) -> RoundAck:
    return RoundAck(
        run_id=msg.run_id,
        engine_id=msg.engine_id,
        version=msg.version,
        index=msg.round,
        ok=msg.ok,
        error=msg.error,
        transfer_seconds=msg.transfer_seconds,
        transfer_bytes=msg.transfer_bytes,
        lane=msg.lane,
    )


def version_ack_to_proto(ack: VersionAck) -> pb.AckVersionRequest:
    return pb.AckVersionRequest(
        run_id=ack.run_id,
        engine_id=ack.engine_id,
        version=ack.version,
        ok=ack.ok,
        error=ack.error,
        transfer_seconds=ack.transfer_seconds,
        transfer_bytes=ack.transfer_bytes,
        lane=ack.lane,
    )


def version_ack_from_proto(msg: pb.AckVersionRequest) -> VersionAck:
    return VersionAck(
        run_id=msg.run_id,
        engine_id=msg.engine_id,
        version=msg.version,
        ok=msg.ok,
        error=msg.error,
        transfer_seconds=msg.transfer_seconds,
        transfer_bytes=msg.transfer_bytes,
        lane=msg.lane,
    )
