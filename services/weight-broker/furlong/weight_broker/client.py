"""The broker's in-process client: `InProcessBrokerClient`, the twin of furlong.transfer's
GrpcBrokerClient over a BrokerCore in this process (same BrokerClient seam, same behaviour, same
exceptions), so a whole RL loop can run in one process, and `make_client`, which picks one of the
two for a target.
"""

from __future__ import annotations

import threading

from furlong.core.weight_shards import ShardLayout
from furlong.core.weight_versions import (
    RoundAck,
    VersionAck,
    VersionEventInfo,
    VersionStatusInfo,
    WeightSourceInfo,
)
from furlong.core.weights import Manifest
from furlong.transfer.broker_client import BrokerClient, GrpcBrokerClient, VersionWatch
from furlong.weight_broker.core import BrokerCore, EventSubscription

# BrokerClient is the seam, re-exported for the controller (which reaches the broker through here).
__all__ = ["BrokerClient", "InProcessBrokerClient", "make_client"]


def make_client(target: BrokerCore | str, timeout_s: float = 10.0) -> BrokerClient:
    """The in-process twin for a BrokerCore, the gRPC client (unary deadline timeout_s) for a
    "host:port" address. The caller owns what it gets (close() it). Anything else is a TypeError
    naming it."""
    if isinstance(target, BrokerCore):
        return InProcessBrokerClient(target)
    if isinstance(target, str):
        return GrpcBrokerClient(target, timeout_s)
    raise TypeError(f"make_client target {target!r} is neither a BrokerCore nor a 'host:port' string")


class _SubscriptionWatch(VersionWatch):
    def __init__(self, sub: EventSubscription, poll_s: float = 0.5) -> None:
        self._sub = sub
        self._poll_s = poll_s

    def __next__(self) -> VersionEventInfo:
        while True:
            event = self._sub.get(self._poll_s)
            if event is not None:
                return event
            if self._sub.ended:
                raise StopIteration

    @property
    def ended(self) -> bool:
        return self._sub.ended

    def close(self) -> None:
        self._sub.close()


class InProcessBrokerClient:
    """BrokerClient calling a BrokerCore in this process. close() ends this client's watches (and
    so, like a closed gRPC stream, removes their engines); the core itself stays usable."""

    def __init__(self, core: BrokerCore) -> None:
        self._core = core
        self._lock = threading.Lock()
        self._watches: list[_SubscriptionWatch] = []

    def register_engine(self, run_id: str, engine_id: str, shard_layout: ShardLayout | None = None) -> int:
        return self._core.register_engine(run_id, engine_id, shard_layout)

    def destinations(self, run_id: str) -> list[ShardLayout]:
        return self._core.destinations(run_id)

    def unregister_engine(self, run_id: str, engine_id: str) -> None:
        self._core.unregister_engine(run_id, engine_id)

    def begin_version(self, run_id: str, manifest: Manifest, source: WeightSourceInfo) -> list[str]:
        return self._core.begin_version(run_id, manifest, source)

    def stage_round(self, run_id: str, version: int, index: int) -> list[str]:
        return self._core.stage_round(run_id, version, index)

    def wait_round(self, run_id: str, version: int, index: int, timeout_s: float) -> list[str]:
        return self._core.wait_round(run_id, version, index, timeout_s)

    def ack_round(self, ack: RoundAck) -> None:
        self._core.ack_round(ack)

    def watch_versions(self, run_id: str, engine_id: str) -> VersionWatch:
        watch = _SubscriptionWatch(self._core.subscribe(run_id, engine_id))
        with self._lock:
            self._watches = [w for w in self._watches if not w.ended] + [watch]
        return watch

    def ack_version(self, ack: VersionAck) -> int:
        return self._core.ack_version(ack)

    def wait_committed(self, run_id: str, version: int, timeout_s: float) -> VersionStatusInfo:
        return self._core.wait_committed(run_id, version, timeout_s)

    def get_version(self, run_id: str) -> VersionStatusInfo:
        return self._core.get_version(run_id)

    def end_run(self, run_id: str) -> None:
        self._core.end_run(run_id)

    def close(self) -> None:
        with self._lock:
            watches, self._watches = self._watches, []
        for watch in watches:
            watch.close()
