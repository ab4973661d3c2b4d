from furlong.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterEngineRequest(_message.Message):
    __slots__ = ("run_id", "engine_id", "shard_layout")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    engine_id: str
    shard_layout: ShardLayout
    def __init__(self, run_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., shard_layout: _Optional[_Union[ShardLayout, _Mapping]] = ...) -> None: ...

class ShardPiece(_message.Message):
    __slots__ = ("source", "whole", "dim", "start", "stop")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    WHOLE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    source: str
    whole: bool
    dim: int
    start: int
    stop: int
    def __init__(self, source: _Optional[str] = ..., whole: _Optional[bool] = ..., dim: _Optional[int] = ..., start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class ShardTensor(_message.Message):
    __slots__ = ("name", "pieces")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    name: str
    pieces: _containers.RepeatedCompositeFieldContainer[ShardPiece]
    def __init__(self, name: _Optional[str] = ..., pieces: _Optional[_Iterable[_Union[ShardPiece, _Mapping]]] = ...) -> None: ...

class ShardLayout(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[ShardTensor]
    def __init__(self, tensors: _Optional[_Iterable[_Union[ShardTensor, _Mapping]]] = ...) -> None: ...

class GetDestinationsRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class GetDestinationsResponse(_message.Message):
    __slots__ = ("run_id", "layouts")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    layouts: _containers.RepeatedCompositeFieldContainer[ShardLayout]
    def __init__(self, run_id: _Optional[str] = ..., layouts: _Optional[_Iterable[_Union[ShardLayout, _Mapping]]] = ...) -> None: ...

class RegisterEngineResponse(_message.Message):
    __slots__ = ("run_id", "committed_version")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    committed_version: int
    def __init__(self, run_id: _Optional[str] = ..., committed_version: _Optional[int] = ...) -> None: ...

class UnregisterEngineRequest(_message.Message):
    __slots__ = ("run_id", "engine_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    engine_id: str
    def __init__(self, run_id: _Optional[str] = ..., engine_id: _Optional[str] = ...) -> None: ...

class UnregisterEngineResponse(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class BeginVersionRequest(_message.Message):
    __slots__ = ("run_id", "manifest", "source")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    manifest: _common_pb2.WeightManifest
    source: _common_pb2.WeightSource
    def __init__(self, run_id: _Optional[str] = ..., manifest: _Optional[_Union[_common_pb2.WeightManifest, _Mapping]] = ..., source: _Optional[_Union[_common_pb2.WeightSource, _Mapping]] = ...) -> None: ...

class BeginVersionResponse(_message.Message):
    __slots__ = ("run_id", "version", "engine_ids")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: int
    engine_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[int] = ..., engine_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class StageRoundRequest(_message.Message):
    __slots__ = ("run_id", "version", "round")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: int
    round: int
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[int] = ..., round: _Optional[int] = ...) -> None: ...

class StageRoundResponse(_message.Message):
    __slots__ = ("run_id", "engine_ids")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    engine_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., engine_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class WaitRoundRequest(_message.Message):
    __slots__ = ("run_id", "version", "round", "timeout_s")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: int
    round: int
    timeout_s: float
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[int] = ..., round: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class WaitRoundResponse(_message.Message):
    __slots__ = ("run_id", "fenced_engine_ids")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    FENCED_ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    fenced_engine_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., fenced_engine_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AckRoundRequest(_message.Message):
    __slots__ = ("run_id", "engine_id", "version", "round", "ok", "error", "transfer_seconds", "transfer_bytes", "lane")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    engine_id: str
    version: int
    round: int
    ok: bool
    error: str
    transfer_seconds: float
    transfer_bytes: int
    lane: str
    def __init__(self, run_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., version: _Optional[int] = ..., round: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., transfer_seconds: _Optional[float] = ..., transfer_bytes: _Optional[int] = ..., lane: _Optional[str] = ...) -> None: ...

class AckRoundResponse(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class WatchVersionsRequest(_message.Message):
    __slots__ = ("run_id", "engine_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    engine_id: str
    def __init__(self, run_id: _Optional[str] = ..., engine_id: _Optional[str] = ...) -> None: ...

class VersionEvent(_message.Message):
    __slots__ = ("run_id", "kind", "version", "manifest", "source", "round", "reason")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[VersionEvent.Kind]
        PUBLISHED: _ClassVar[VersionEvent.Kind]
        COMMITTED: _ClassVar[VersionEvent.Kind]
        ROUND_READY: _ClassVar[VersionEvent.Kind]
        FENCED: _ClassVar[VersionEvent.Kind]
    KIND_UNSPECIFIED: VersionEvent.Kind
    PUBLISHED: VersionEvent.Kind
    COMMITTED: VersionEvent.Kind
    ROUND_READY: VersionEvent.Kind
    FENCED: VersionEvent.Kind
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    kind: VersionEvent.Kind
    version: int
    manifest: _common_pb2.WeightManifest
    source: _common_pb2.WeightSource
    round: int
    reason: str
    def __init__(self, run_id: _Optional[str] = ..., kind: _Optional[_Union[VersionEvent.Kind, str]] = ..., version: _Optional[int] = ..., manifest: _Optional[_Union[_common_pb2.WeightManifest, _Mapping]] = ..., source: _Optional[_Union[_common_pb2.WeightSource, _Mapping]] = ..., round: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class AckVersionRequest(_message.Message):
    __slots__ = ("run_id", "engine_id", "version", "ok", "error", "transfer_seconds", "transfer_bytes", "lane")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    engine_id: str
    version: int
    ok: bool
    error: str
    transfer_seconds: float
    transfer_bytes: int
    lane: str
    def __init__(self, run_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., version: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., transfer_seconds: _Optional[float] = ..., transfer_bytes: _Optional[int] = ..., lane: _Optional[str] = ...) -> None: ...

class AckVersionResponse(_message.Message):
    __slots__ = ("run_id", "committed_version")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    committed_version: int
    def __init__(self, run_id: _Optional[str] = ..., committed_version: _Optional[int] = ...) -> None: ...

class WaitCommittedRequest(_message.Message):
    __slots__ = ("run_id", "version", "timeout_s")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: int
    timeout_s: float
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class GetVersionRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class VersionStatus(_message.Message):
    __slots__ = ("run_id", "latest_version", "committed_version", "engine_ids", "pending_engine_ids", "fenced_engine_ids")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    PENDING_ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    FENCED_ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    latest_version: int
    committed_version: int
    engine_ids: _containers.RepeatedScalarFieldContainer[str]
    pending_engine_ids: _containers.RepeatedScalarFieldContainer[str]
    fenced_engine_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., latest_version: _Optional[int] = ..., committed_version: _Optional[int] = ..., engine_ids: _Optional[_Iterable[str]] = ..., pending_engine_ids: _Optional[_Iterable[str]] = ..., fenced_engine_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class EndRunBrokerRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class EndRunBrokerResponse(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class ReadRangeRequest(_message.Message):
    __slots__ = ("offset_bytes", "size_bytes", "chunk_bytes")
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    offset_bytes: int
    size_bytes: int
    chunk_bytes: int
    def __init__(self, offset_bytes: _Optional[int] = ..., size_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class RangeChunk(_message.Message):
    __slots__ = ("offset_bytes", "data")
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset_bytes: int
    data: bytes
    def __init__(self, offset_bytes: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
