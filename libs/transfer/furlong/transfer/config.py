"""Configuration of the weight-transfer endpoints (publishers, receivers, relays), parsed once at the
edge (the process that builds a publisher or receiver) and validated here. The broker service's own
settings live in the broker service (services/weight-broker)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from furlong.core.weight_versions import LANE_NAMES
from furlong.transfer.device_memory import check_device


def check_lanes(name: str, lanes: tuple[str, ...]) -> None:
    """ValueError naming `name` unless `lanes` are distinct names from LANE_NAMES, at least one."""
    if not lanes or any(lane not in LANE_NAMES for lane in lanes) or len(set(lanes)) != len(lanes):
        raise ValueError(f"{name} {lanes!r} must be distinct names from {LANE_NAMES}")


@dataclass(frozen=True)
class TransferConfig:
    """How a publisher stages versions and how a receiver pulls them.

    lanes: for a publisher, the lanes its bucket is offered on; for a receiver, the lanes it tries,
    in order (see furlong.transfer.lanes). bucket_size_bytes bounds the publisher's staging
    memory: a larger model goes in rounds (a larger single tensor grows the bucket to its size).
    device: where the memory lives ("cpu", "cuda" or "cuda:N"): for a publisher, its staging
    bucket (a CUDA bucket is offered over the nixl lane only, see furlong.transfer.bucket); for a
    receiver, its receive buffer (an engine that offers its parameters pulls into them, wherever
    they are)."""

    backends: tuple[str, ...] = ("UCX",)
    lanes: tuple[str, ...] = LANE_NAMES
    bucket_size_bytes: int = 256 << 20
    transfer_timeout_s: float = 60.0  # one read of one round
    round_timeout_s: float = 60.0  # publisher: engines that have not pulled a round by then are fenced
    rpc_retry_s: float = 1.0  # pause before re-registering after the broker went away
    stream_chunk_bytes: int = 1 << 20  # grpc lane chunk size
    stream_workers: int = 4  # publisher: WeightStream threads (one per engine it feeds)
    pull_lock_wait_s: float = 5.0  # receiver: wait for the host's pull lock (0: never take it)
    double_buffer: bool = False  # publisher: stage the next round in the other half of the
    # bucket while engines pull the current one (needs spare
    # cores: on 2 cores it slowed switches, see the docs)
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not self.backends or any(not b for b in self.backends):
            raise ValueError(f"backends {self.backends!r} must name at least one NIXL backend")
        check_lanes("lanes", self.lanes)
        for name in ("transfer_timeout_s", "round_timeout_s", "rpc_retry_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} {value} is not a finite number > 0")
        if self.bucket_size_bytes < 1:
            raise ValueError(f"bucket_size_bytes {self.bucket_size_bytes} < 1")
        if not 1 <= self.stream_chunk_bytes <= 4 << 20:
            raise ValueError(f"stream_chunk_bytes {self.stream_chunk_bytes} not in [1, 4 MiB]")
        if not (math.isfinite(self.pull_lock_wait_s) and self.pull_lock_wait_s >= 0):
            raise ValueError(f"pull_lock_wait_s {self.pull_lock_wait_s} is not a finite number >= 0")
        check_device("device", self.device)
        if self.stream_workers < 1:
            raise ValueError(f"stream_workers {self.stream_workers} < 1")
