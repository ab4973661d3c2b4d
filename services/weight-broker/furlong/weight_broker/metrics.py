"""Prometheus metrics of the weight broker: metric names (the only place they are spelled) and an
observer of the broker core that keeps them up to date.

Transfer figures come from the engines' acknowledgements, so they count bytes engines really pulled.
Every transfer on the fast path goes over NIXL, hence the single lane label value today.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TRANSFER_BYTES_TOTAL = "furlong_broker_transfer_bytes_total"
TRANSFER_SECONDS_TOTAL = "furlong_broker_transfer_seconds_total"
ACKS_TOTAL = "furlong_broker_acks_total"
VERSIONS_COMMITTED_TOTAL = "furlong_broker_versions_committed_total"
VERSIONS_FAILED_TOTAL = "furlong_broker_versions_failed_total"
COMMITTED_VERSION = "furlong_broker_committed_version"
REGISTERED_ENGINES = "furlong_broker_registered_engines"
COMMIT_LATENCY_SECONDS = "furlong_broker_commit_latency_seconds"

LANE_NIXL = "nixl"
ACK_OK = "ok"
ACK_ERROR = "error"

_COMMIT_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class BrokerMetrics:
    """Implements furlong.weight_broker.core.BrokerObserver on a given registry (the process-wide
    default in the service, a private one in tests)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.transfer_bytes = Counter(TRANSFER_BYTES_TOTAL, "Bytes engines pulled, from their "
                                      "acknowledgements", ["lane"], registry=registry)
        self.transfer_seconds = Counter(TRANSFER_SECONDS_TOTAL, "Seconds engines spent pulling, from "
                                        "their acknowledgements", ["lane"], registry=registry)
        self.acks = Counter(ACKS_TOTAL, "Version acknowledgements by result", ["result"],
                            registry=registry)
        self.versions_committed = Counter(VERSIONS_COMMITTED_TOTAL, "Versions committed",
                                          ["run_id"], registry=registry)
        self.versions_failed = Counter(VERSIONS_FAILED_TOTAL, "Versions that failed", ["run_id"],
                                       registry=registry)
        self.committed_version = Gauge(COMMITTED_VERSION, "Latest committed policy version",
                                       ["run_id"], registry=registry)
        self.registered_engines = Gauge(REGISTERED_ENGINES, "Engines registered for a run",
                                        ["run_id"], registry=registry)
        self.commit_latency = Histogram(COMMIT_LATENCY_SECONDS, "Seconds from BeginVersion to "
                                        "commit", buckets=_COMMIT_BUCKETS_S, registry=registry)

    def engines_changed(self, run_id: str, num_engines: int) -> None:
        self.registered_engines.labels(run_id=run_id).set(num_engines)

    def ack_received(self, run_id: str, engine_id: str, version: int, ok: bool,
                     transfer_seconds: float, transfer_bytes: int) -> None:
        self.acks.labels(result=ACK_OK if ok else ACK_ERROR).inc()
        self.transfer_bytes.labels(lane=LANE_NIXL).inc(transfer_bytes)
        self.transfer_seconds.labels(lane=LANE_NIXL).inc(transfer_seconds)

    def version_committed(self, run_id: str, version: int, commit_seconds: float) -> None:
        self.versions_committed.labels(run_id=run_id).inc()
        self.committed_version.labels(run_id=run_id).set(version)
        self.commit_latency.observe(commit_seconds)

    def version_failed(self, run_id: str, version: int, reason: str) -> None:
        self.versions_failed.labels(run_id=run_id).inc()

    def run_ended(self, run_id: str) -> None:
        for metric in (self.versions_committed, self.versions_failed, self.committed_version,
                       self.registered_engines):
            try:
                metric.remove(run_id)
            except KeyError:
                pass  # the run never produced this series
