"""Domain records of weight versions that the broker hands out and the transfer library reads: where a
version's bytes are, what happened to a version, and where a run stands. Plain frozen dataclasses,
the twins of the furlong.v1 messages of the same role (converted in furlong.transfer.wire); they
know nothing about the wire or the broker's rules.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from furlong.core.weights import Manifest

MEMORY_KINDS = ("DRAM", "VRAM")
NO_VERSION = -1


@dataclass(frozen=True)
class WeightSourceInfo:
    """Where a version's staging bucket can be read (WeightSource): a NIXL agent and the memory
    region it registered, and optionally the same bucket as a POSIX shared-memory object and behind a
    WeightStream gRPC server. agent_metadata empty means "no NIXL lane". holds_all_rounds: the region
    holds the whole layout at logical offsets (a relay), not one round at offset 0."""

    agent_name: str
    agent_metadata: bytes
    base_address: int
    size_bytes: int
    memory_kind: str = "DRAM"
    device_id: int = 0
    shm_name: str = ""
    stream_address: str = ""
    holds_all_rounds: bool = False

    def __post_init__(self) -> None:
        if not self.agent_name:
            raise ValueError("weight source with an empty agent_name")
        if not (self.agent_metadata or self.shm_name or self.stream_address):
            raise ValueError(
                f"weight source {self.agent_name!r}: no lane (NIXL metadata, shared memory or stream address)"
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
