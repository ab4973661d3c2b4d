from furlong.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterEngineRequest(_message.Message):
    __slots__ = ("run_id", "engine_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    engine_id: str
    def __init__(self, run_id: _Optional[str] = ..., engine_id: _Optional[str] = ...) -> None: ...

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

class WatchVersionsRequest(_message.Message):
    __slots__ = ("run_id", "engine_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    engine_id: str
    def __init__(self, run_id: _Optional[str] = ..., engine_id: _Optional[str] = ...) -> None: ...

class VersionEvent(_message.Message):
    __slots__ = ("run_id", "kind", "version", "manifest", "source")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[VersionEvent.Kind]
        PUBLISHED: _ClassVar[VersionEvent.Kind]
        COMMITTED: _ClassVar[VersionEvent.Kind]
    KIND_UNSPECIFIED: VersionEvent.Kind
    PUBLISHED: VersionEvent.Kind
    COMMITTED: VersionEvent.Kind
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    kind: VersionEvent.Kind
    version: int
    manifest: _common_pb2.WeightManifest
    source: _common_pb2.WeightSource
    def __init__(self, run_id: _Optional[str] = ..., kind: _Optional[_Union[VersionEvent.Kind, str]] = ..., version: _Optional[int] = ..., manifest: _Optional[_Union[_common_pb2.WeightManifest, _Mapping]] = ..., source: _Optional[_Union[_common_pb2.WeightSource, _Mapping]] = ...) -> None: ...

class AckVersionRequest(_message.Message):
    __slots__ = ("run_id", "engine_id", "version", "ok", "error", "transfer_seconds", "transfer_bytes")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    engine_id: str
    version: int
    ok: bool
    error: str
    transfer_seconds: float
    transfer_bytes: int
    def __init__(self, run_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., version: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., transfer_seconds: _Optional[float] = ..., transfer_bytes: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("run_id", "latest_version", "committed_version", "engine_ids", "pending_engine_ids")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    PENDING_ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    latest_version: int
    committed_version: int
    engine_ids: _containers.RepeatedScalarFieldContainer[str]
    pending_engine_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., latest_version: _Optional[int] = ..., committed_version: _Optional[int] = ..., engine_ids: _Optional[_Iterable[str]] = ..., pending_engine_ids: _Optional[_Iterable[str]] = ...) -> None: ...

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
