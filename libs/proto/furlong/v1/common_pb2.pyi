from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "max_new_tokens", "seed", "stop", "min_p")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    max_new_tokens: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    min_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., max_new_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., min_p: _Optional[float] = ...) -> None: ...

class PrecisionConfig(_message.Message):
    __slots__ = ("dtype", "gradient_checkpointing")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_CHECKPOINTING_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    gradient_checkpointing: bool
    def __init__(self, dtype: _Optional[str] = ..., gradient_checkpointing: _Optional[bool] = ...) -> None: ...

class TensorEntry(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset_bytes", "size_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset_bytes: int
    size_bytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset_bytes: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class WeightSource(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "base_address", "size_bytes", "memory_kind", "device_id", "shm_name", "stream_address", "holds_all_rounds", "cuda_ipc")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    STREAM_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOLDS_ALL_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    base_address: int
    size_bytes: int
    memory_kind: str
    device_id: int
    shm_name: str
    stream_address: str
    holds_all_rounds: bool
    cuda_ipc: CudaIpcShare
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., base_address: _Optional[int] = ..., size_bytes: _Optional[int] = ..., memory_kind: _Optional[str] = ..., device_id: _Optional[int] = ..., shm_name: _Optional[str] = ..., stream_address: _Optional[str] = ..., holds_all_rounds: _Optional[bool] = ..., cuda_ipc: _Optional[_Union[CudaIpcShare, _Mapping]] = ...) -> None: ...

class CudaIpcShare(_message.Message):
    __slots__ = ("host_id", "device_uuid", "handle", "storage_size_bytes", "storage_offset_bytes", "offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    device_uuid: str
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, host_id: _Optional[str] = ..., device_uuid: _Optional[str] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class BucketRound(_message.Message):
    __slots__ = ("index", "offset_bytes", "size_bytes", "names", "checksum", "bucket_offset_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    BUCKET_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset_bytes: int
    size_bytes: int
    names: _containers.RepeatedScalarFieldContainer[str]
    checksum: str
    bucket_offset_bytes: int
    def __init__(self, index: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., size_bytes: _Optional[int] = ..., names: _Optional[_Iterable[str]] = ..., checksum: _Optional[str] = ..., bucket_offset_bytes: _Optional[int] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("version", "tensors", "total_bytes", "checksum_algorithm", "checksum", "bucket_size_bytes", "rounds", "destinations")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    BUCKET_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DESTINATIONS_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    total_bytes: int
    checksum_algorithm: str
    checksum: str
    bucket_size_bytes: int
    rounds: _containers.RepeatedCompositeFieldContainer[BucketRound]
    destinations: _containers.RepeatedCompositeFieldContainer[DestinationChecksums]
    def __init__(self, version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., checksum_algorithm: _Optional[str] = ..., checksum: _Optional[str] = ..., bucket_size_bytes: _Optional[int] = ..., rounds: _Optional[_Iterable[_Union[BucketRound, _Mapping]]] = ..., destinations: _Optional[_Iterable[_Union[DestinationChecksums, _Mapping]]] = ...) -> None: ...

class DestinationChecksums(_message.Message):
    __slots__ = ("layout_id", "round_checksums")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    layout_id: str
    round_checksums: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, layout_id: _Optional[str] = ..., round_checksums: _Optional[_Iterable[str]] = ...) -> None: ...
