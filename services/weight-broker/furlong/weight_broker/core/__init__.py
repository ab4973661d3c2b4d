"""The broker's pure core: version records, per-engine event subscriptions and the state machine
that decides when a version commits or fails. No gRPC, no NIXL, no sockets. The value types it hands
out (WeightSourceInfo, VersionEventInfo, VersionStatusInfo, EventKind) are furlong.core.weight_versions,
shared with the transfer library."""

from furlong.weight_broker.core.broker import UPSTREAM_SUFFIX, BrokerCore, BrokerObserver
from furlong.weight_broker.core.subscription import EventSubscription

__all__ = ["BrokerCore", "BrokerObserver", "EventSubscription", "UPSTREAM_SUFFIX"]
