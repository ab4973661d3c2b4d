"""Prometheus exposition of host telemetry: a collector that reads a fresh snapshot per scrape.

Owns no global state: `build_registry` returns a registry holding only this collector.
"""

from __future__ import annotations

from typing import Iterator, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from furlong.dashboard.core.host_telemetry import HostSnapshot
from furlong.dashboard.metrics import (HOST_CPU_UTILIZATION_RATIO, HOST_MEMORY_TOTAL_BYTES,
                                       HOST_MEMORY_USED_BYTES, HOST_PROCESS_RSS_BYTES)


class TelemetryProvider(Protocol):
    def snapshot(self) -> HostSnapshot:
        """A current reading; thread-safe (scrapes may overlap)."""


class HostCollector(Collector):
    def __init__(self, provider: TelemetryProvider) -> None:
        self._provider = provider

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self._provider.snapshot()
        yield GaugeMetricFamily(HOST_CPU_UTILIZATION_RATIO,
                                "Fraction of CPU time spent busy since the previous scrape",
                                value=snap.cpu_utilization_ratio)
        yield GaugeMetricFamily(HOST_MEMORY_USED_BYTES, "Memory in use (total minus available)",
                                value=snap.memory_used_bytes)
        yield GaugeMetricFamily(HOST_MEMORY_TOTAL_BYTES, "Physical memory",
                                value=snap.memory_total_bytes)
        rss = GaugeMetricFamily(HOST_PROCESS_RSS_BYTES, "Resident memory of a watched process",
                                labels=["pid", "service"])
        for proc in snap.processes:
            rss.add_metric([str(proc.pid), proc.service], proc.rss_bytes)
        yield rss

    def describe(self) -> list:
        return []  # collected lazily; describing would take a snapshot at registration


def build_registry(provider: TelemetryProvider) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(HostCollector(provider))
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
