"""The broker's pure core: version records, per-engine event subscriptions and the state machine
that decides when a version commits or fails. No gRPC, no NIXL, no sockets."""

from furlong.weight_broker.core.broker import UPSTREAM_SUFFIX, BrokerCore, BrokerObserver
from furlong.weight_broker.core.events import (
    MEMORY_KINDS,
    NO_VERSION,
    EventKind,
    VersionEventInfo,
    VersionStatusInfo,
    WeightSourceInfo,
)
from furlong.weight_broker.core.subscription import EventSubscription

__all__ = [
    "BrokerCore",
    "BrokerObserver",
    "EventKind",
    "EventSubscription",
    "MEMORY_KINDS",
    "NO_VERSION",
    "UPSTREAM_SUFFIX",
    "VersionEventInfo",
    "VersionStatusInfo",
    "WeightSourceInfo",
]
