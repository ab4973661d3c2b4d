"""Prometheus metrics of the weight broker: metric names (the only place they are spelled) and an
observer of the broker core that keeps them up to date.

Transfer figures come from the engines' acknowledgements, so they count bytes engines really pulled,
labelled with the lane that carried them (cuda_ipc, nixl, shm, grpc): a silent fall to a slow lane shows.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from furlong.core.weight_versions import LANE_NIXL

TRANSFER_BYTES_TOTAL = "furlong_broker_transfer_bytes_total"
TRANSFER_SECONDS_TOTAL = "furlong_broker_transfer_seconds_total"
ACKS_TOTAL = "furlong_broker_acks_total"
VERSIONS_COMMITTED_TOTAL = "furlong_broker_versions_committed_total"
VERSIONS_FAILED_TOTAL = "furlong_broker_versions_failed_total"
COMMITTED_VERSION = "furlong_broker_committed_version"
REGISTERED_ENGINES = "furlong_broker_registered_engines"
COMMIT_LATENCY_SECONDS = "furlong_broker_commit_latency_seconds"
ENGINES_FENCED_TOTAL = "furlong_broker_engines_fenced_total"
WEIGHT_SYNC_SECONDS = "furlong_broker_weight_sync_seconds"
TRANSFER_GBPS = "furlong_broker_transfer_gbps"
ENGINE_VERSION_LAG = "furlong_broker_engine_version_lag"

LANE_NONE = "none"  # an acknowledgement without a transfer (failure, nothing pulled)
ACK_OK = "ok"
ACK_ERROR = "error"

_SYNC_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_COMMIT_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class BrokerMetrics:
    """Implements furlong.weight_broker.core.BrokerObserver on a given registry (the process-wide
    default in the service, a private one in tests)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.transfer_bytes = Counter(
            TRANSFER_BYTES_TOTAL,
            "Bytes engines pulled, from their acknowledgements",
            ["lane"],
            registry=registry,
        )
        self.transfer_seconds = Counter(
            TRANSFER_SECONDS_TOTAL,
            "Seconds engines spent pulling, from their acknowledgements",
            ["lane"],
            registry=registry,
        )
        self.acks = Counter(ACKS_TOTAL, "Version acknowledgements by result", ["result"], registry=registry)
        self.versions_committed = Counter(
            VERSIONS_COMMITTED_TOTAL, "Versions committed", ["run_id"], registry=registry
        )
        self.versions_failed = Counter(
            VERSIONS_FAILED_TOTAL, "Versions that failed", ["run_id"], registry=registry
        )
        self.committed_version = Gauge(
            COMMITTED_VERSION, "Latest committed policy version", ["run_id"], registry=registry
        )
        self.registered_engines = Gauge(
            REGISTERED_ENGINES, "Engines registered for a run", ["run_id"], registry=registry
        )
        self.engines_fenced = Counter(
            ENGINES_FENCED_TOTAL, "Engines fenced out of a version", ["run_id"], registry=registry
        )
        self.commit_latency = Histogram(
            COMMIT_LATENCY_SECONDS,
            "Seconds from BeginVersion to commit",
            buckets=_COMMIT_BUCKETS_S,
            registry=registry,
        )
        self.weight_sync_seconds = Histogram(
            WEIGHT_SYNC_SECONDS,
            "Seconds one engine spent pulling one version, from its acknowledgement",
            ["lane"],
            buckets=_SYNC_BUCKETS_S,
            registry=registry,
        )
        self.transfer_gbps = Gauge(
            TRANSFER_GBPS,
            "Pull rate of the latest acknowledged transfer (1e9 bytes/s)",
            ["lane"],
            registry=registry,
        )
        self.engine_version_lag = Gauge(
            ENGINE_VERSION_LAG,
            "Committed version minus the latest version the engine acknowledged",
            ["run_id", "engine"],
            registry=registry,
        )
        self._lock = threading.Lock()
        self._committed: dict[str, int] = {}
        self._acked: dict[str, dict[str, int]] = {}  # run -> engine -> latest acknowledged version

    def engines_changed(self, run_id: str, num_engines: int) -> None:
        self.registered_engines.labels(run_id=run_id).set(num_engines)

    def ack_received(
        self,
        run_id: str,
        engine_id: str,
        version: int,
        ok: bool,
        transfer_seconds: float,
        transfer_bytes: int,
        lane: str = LANE_NIXL,
    ) -> None:
        lane = lane or LANE_NONE
        self.acks.labels(result=ACK_OK if ok else ACK_ERROR).inc()
        self.transfer_bytes.labels(lane=lane).inc(transfer_bytes)
        self.transfer_seconds.labels(lane=lane).inc(transfer_seconds)
        if not ok:
            return
        self.weight_sync_seconds.labels(lane=lane).observe(transfer_seconds)
        if transfer_seconds > 0:
            self.transfer_gbps.labels(lane=lane).set(transfer_bytes / transfer_seconds / 1e9)
        with self._lock:
            engines = self._acked.setdefault(run_id, {})
            engines[engine_id] = max(version, engines.get(engine_id, 0))
            self._update_lag(run_id)

    def _update_lag(self, run_id: str) -> None:
        """An engine that acknowledged a version not yet committed is not behind: lag 0."""
        committed = self._committed.get(run_id, 0)
        for engine_id, acked in self._acked.get(run_id, {}).items():
            self.engine_version_lag.labels(run_id=run_id, engine=engine_id).set(max(0, committed - acked))

    def version_committed(self, run_id: str, version: int, commit_seconds: float) -> None:
        self.versions_committed.labels(run_id=run_id).inc()
        for counter in (self.versions_failed, self.engines_fenced):
            counter.labels(run_id=run_id)  # the series exists (at 0) before any failure or fence
        self.committed_version.labels(run_id=run_id).set(version)
        self.commit_latency.observe(commit_seconds)
        with self._lock:
            self._committed[run_id] = max(version, self._committed.get(run_id, 0))
            self._update_lag(run_id)

    def engine_fenced(self, run_id: str, engine_id: str, version: int, reason: str) -> None:
        self.engines_fenced.labels(run_id=run_id).inc()

    def version_failed(self, run_id: str, version: int, reason: str) -> None:
        self.versions_failed.labels(run_id=run_id).inc()

    def run_ended(self, run_id: str) -> None:
        with self._lock:
            self._committed.pop(run_id, None)
            for engine_id in self._acked.pop(run_id, {}):
                try:
                    self.engine_version_lag.remove(run_id, engine_id)
                except KeyError:
                    pass
        for metric in (
            self.versions_committed,
            self.versions_failed,
            self.committed_version,
            self.registered_engines,
            self.engines_fenced,
        ):
            try:
                metric.remove(run_id)
            except KeyError:
                pass  # the run never produced this series
