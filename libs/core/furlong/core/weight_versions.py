"""Domain records of weight versions that the broker hands out and the transfer library reads: where a
version's bytes are, what happened to a version, where a run stands, and an engine's verdict on a
round or a version it pulled. Plain frozen dataclasses, the twins of the furlong.v1 messages of the
same role (converted in furlong.transfer.wire); they know nothing about the wire or the broker's
rules.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from furlong.core.cuda_ipc_share import CudaIpcShare
from furlong.core.weights import Manifest

MEMORY_DRAM = "DRAM"  # host memory
MEMORY_VRAM = "VRAM"  # the memory of a GPU
MEMORY_KINDS = (MEMORY_DRAM, MEMORY_VRAM)
NO_VERSION = -1

# The transports an engine pulls a version over (furlong.transfer.lanes); declared here because an
# acknowledgement names the lane that carried its bytes.
LANE_NIXL = "nixl"
LANE_SHM = "shm"
LANE_GRPC = "grpc"
LANE_CUDA_IPC = "cuda_ipc"
# every lane, in the default order of preference: a CUDA IPC share first (same host, GPU to GPU,
# offered only by a CUDA bucket), then NIXL, shared memory (same host, host memory), the gRPC stream
LANE_NAMES = (LANE_CUDA_IPC, LANE_NIXL, LANE_SHM, LANE_GRPC)


@dataclass(frozen=True)
class WeightSourceInfo:
    """Where a version's staging bucket can be read (WeightSource): a NIXL agent and the memory
    region it registered (memory_kind "DRAM": host memory, device_id 0; "VRAM": the memory of GPU
    device_id), and optionally the same bucket as a POSIX shared-memory object, behind a
    WeightStream gRPC server, or as a CUDA IPC share (a VRAM bucket, for engines on its host).
    agent_metadata empty means "no NIXL lane". holds_all_rounds: the region holds the whole layout
    at logical offsets (a relay), not one round at offset 0."""

    agent_name: str
    agent_metadata: bytes
    base_address: int
    size_bytes: int
    memory_kind: str = "DRAM"
    device_id: int = 0
    shm_name: str = ""
    stream_address: str = ""
    holds_all_rounds: bool = False
    cuda_ipc: CudaIpcShare | None = None

    def __post_init__(self) -> None:
        if not self.agent_name:
            raise ValueError("weight source with an empty agent_name")
        if not (self.agent_metadata or self.shm_name or self.stream_address or self.cuda_ipc):
            raise ValueError(
                f"weight source {self.agent_name!r}: no lane (NIXL metadata, shared memory, "
                f"stream address or CUDA IPC share)"
            )
        if self.agent_metadata and self.base_address <= 0:
            raise ValueError(
                f"weight source {self.agent_name!r}: base_address {self.base_address} is not a valid address"
            )
        if self.size_bytes <= 0:
            raise ValueError(f"weight source {self.agent_name!r}: size_bytes {self.size_bytes} <= 0")
        if self.memory_kind not in MEMORY_KINDS:
            raise ValueError(
                f"weight source {self.agent_name!r}: memory_kind "
                f"{self.memory_kind!r} not one of {MEMORY_KINDS}"
            )
        if self.device_id < 0:
            raise ValueError(f"weight source {self.agent_name!r}: device_id {self.device_id} < 0")
        if self.cuda_ipc is not None:
            if self.memory_kind != MEMORY_VRAM:
                raise ValueError(
                    f"weight source {self.agent_name!r}: a CUDA IPC share of a "
                    f"{self.memory_kind!r} bucket (only a VRAM bucket can be shared over CUDA IPC)"
                )
            try:
                self.cuda_ipc.check_holds(self.size_bytes)
            except ValueError as exc:
                raise ValueError(f"weight source {self.agent_name!r}: {exc}") from None


class EventKind(enum.Enum):
    PUBLISHED = "published"  # a new version: get ready to pull its rounds
    ROUND_READY = "round_ready"  # round `round` of the version is staged: pull, verify, ack it
    COMMITTED = "committed"  # every registered engine serves this version
    FENCED = "fenced"  # this engine was fenced out of the version; the stream ends


@dataclass(frozen=True)
class VersionEventInfo:
    """One event of an engine's watch stream. manifest and source are set exactly for PUBLISHED."""

    run_id: str
    kind: EventKind
    version: int
    manifest: Manifest | None = None
    source: WeightSourceInfo | None = None
    round: int = 0
    reason: str = ""

    def __post_init__(self) -> None:
        has_payload = self.manifest is not None and self.source is not None
        if self.kind is EventKind.PUBLISHED and not has_payload:
            raise ValueError(
                f"run {self.run_id}: PUBLISHED event for version {self.version} without manifest and source"
            )
        if self.kind is not EventKind.PUBLISHED and (self.manifest is not None or self.source is not None):
            raise ValueError(
                f"run {self.run_id}: {self.kind.name} event for version "
                f"{self.version} carries a manifest or source"
            )
        if self.round < 0:
            raise ValueError(f"run {self.run_id}: event round {self.round} < 0")
        if self.manifest is not None and self.manifest.version != self.version:
            raise ValueError(
                f"run {self.run_id}: event version {self.version} != manifest version {self.manifest.version}"
            )


@dataclass(frozen=True)
class VersionStatusInfo:
    """Where a run stands (VersionStatus). Versions are NO_VERSION (-1) until the first one."""

    run_id: str
    latest_version: int
    committed_version: int
    engine_ids: tuple[str, ...]
    pending_engine_ids: tuple[str, ...]  # registered engines that have not acknowledged latest
    fenced_engine_ids: tuple[str, ...] = ()  # engines fenced out of latest


@dataclass(frozen=True)
class RoundAck:
    """An engine's verdict on one round of a version it pulled (AckRoundRequest). ok: the round's
    bytes verified; error says why not. The transfer figures are informative (the version's
    acknowledgement carries the totals); lane is "" when nothing was pulled."""

    run_id: str
    engine_id: str
    version: int
    index: int
    ok: bool
    error: str = ""
    transfer_seconds: float = 0.0
    transfer_bytes: int = 0
    lane: str = ""

    def __post_init__(self) -> None:
        _check_ack(
            "round acknowledgement",
            self.run_id,
            self.engine_id,
            self.version,
            self.transfer_seconds,
            self.transfer_bytes,
            self.lane,
        )
        if self.index < 0:
            raise ValueError(
                f"round acknowledgement of run {self.run_id!r} from engine "
                f"{self.engine_id!r}: index {self.index} < 0"
            )


@dataclass(frozen=True)
class VersionAck:
    """An engine's verdict on a whole version (AckVersionRequest). ok: every round verified and the
    version applied; error says why not. The transfer figures are the version's totals over lane
    ("" when nothing was pulled)."""

    run_id: str
    engine_id: str
    version: int
    ok: bool
    error: str = ""
    transfer_seconds: float = 0.0
    transfer_bytes: int = 0
    lane: str = ""

    def __post_init__(self) -> None:
        _check_ack(
            "version acknowledgement",
            self.run_id,
            self.engine_id,
            self.version,
            self.transfer_seconds,
            self.transfer_bytes,
            self.lane,
        )


def _check_ack(
    what: str,
    run_id: str,
    engine_id: str,
    version: int,
    transfer_seconds: float,
    transfer_bytes: int,
    lane: str,
) -> None:
    """The fields both acknowledgements share; ValueError naming the bad one."""
    if not run_id:
        raise ValueError(f"{what} with an empty run_id")
    if not engine_id:
        raise ValueError(f"{what} of run {run_id!r} with an empty engine_id")
    who = f"{what} of run {run_id!r} from engine {engine_id!r}"
    if version < 0:
        raise ValueError(f"{who}: version {version} < 0")
    if not (math.isfinite(transfer_seconds) and transfer_seconds >= 0):
        raise ValueError(f"{who}: transfer_seconds {transfer_seconds} is not a finite number >= 0")
    if transfer_bytes < 0:
        raise ValueError(f"{who}: transfer_bytes {transfer_bytes} < 0")
    if lane and lane not in LANE_NAMES:
        raise ValueError(f"{who}: lane {lane!r} is not one of {LANE_NAMES} or empty")
