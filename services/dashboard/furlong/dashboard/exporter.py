"""Prometheus exposition of host and GPU telemetry: a collector that reads fresh values per scrape.

Owns no global state: `register_telemetry` adds the collector to a given registry (the process's,
from the start-up scaffold) and `build_registry` returns a fresh one holding only it. GPU series
come twice: `furlong_gpu_*` in base units with a `vendor` label, and dcgm-exporter's `DCGM_FI_*`
names, units and labels. A value a backend could not read is a missing series, never 0. Per-process
GPU memory is labelled with the Furlong service owning the pid (`service_of_pid`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from furlong.dashboard import metrics as names
from furlong.dashboard.core.gpu_telemetry import MIB, GpuSample
from furlong.dashboard.core.host_telemetry import HostSnapshot


class TelemetryProvider(Protocol):
    def snapshot(self) -> HostSnapshot:
        """A current reading; thread-safe (scrapes may overlap)."""


class GpuSource(Protocol):
    @property
    def vendor(self) -> str: ...

    def sample(self) -> list[GpuSample]:
        """Every readable device now; thread-safe."""


def _gauge(name: str, doc: str, labels: tuple[str, ...] | list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


class HostCollector(Collector):
    def __init__(
        self,
        provider: TelemetryProvider,
        gpu: GpuSource | None = None,
        hostname: str = "",
        service_of_pid: Callable[[int], str] | None = None,
    ) -> None:
        self._provider = provider
        self._gpu = gpu
        self._hostname = hostname
        self._service_of_pid = service_of_pid or (lambda pid: "unknown")

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from self._host(self._provider.snapshot())
        samples = self._gpu.sample() if self._gpu is not None else []
        devices = _gauge(names.GPU_DEVICES, "GPUs reporting telemetry this scrape", ["vendor"])
        devices.add_metric([self._gpu.vendor if self._gpu is not None else "none"], len(samples))
        yield devices
        if samples:
            yield from self._gpus(samples)

    def _host(self, snap: HostSnapshot) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            names.HOST_CPU_UTILIZATION_RATIO,
            "Fraction of CPU time spent busy since the previous scrape",
            value=snap.cpu_utilization_ratio,
        )
        yield GaugeMetricFamily(
            names.HOST_MEMORY_USED_BYTES,
            "Memory in use (total minus available)",
            value=snap.memory_used_bytes,
        )
        yield GaugeMetricFamily(
            names.HOST_MEMORY_TOTAL_BYTES, "Physical memory", value=snap.memory_total_bytes
        )
        rss = _gauge(names.HOST_PROCESS_RSS_BYTES, "Resident memory of a watched process", ["pid", "service"])
        for proc in snap.processes:
            rss.add_metric([str(proc.pid), proc.service], proc.rss_bytes)
        yield rss

    def _gpus(self, samples: list[GpuSample]) -> Iterator[GaugeMetricFamily]:
        ours = {
            "util": _gauge(names.GPU_UTILIZATION_RATIO, "GPU busy fraction", names.GPU_LABELS),
            "used": _gauge(names.GPU_MEMORY_USED_BYTES, "GPU memory in use", names.GPU_LABELS),
            "total": _gauge(names.GPU_MEMORY_TOTAL_BYTES, "GPU memory", names.GPU_LABELS),
            "power": _gauge(names.GPU_POWER_WATTS, "GPU board/socket power", names.GPU_LABELS),
            "temp": _gauge(names.GPU_TEMPERATURE_CELSIUS, "GPU temperature", names.GPU_LABELS),
        }
        dcgm = {
            "util": _gauge(names.DCGM_GPU_UTIL, "GPU utilization (in %).", names.DCGM_LABELS),
            "used": _gauge(names.DCGM_FB_USED, "Framebuffer memory used (in MiB).", names.DCGM_LABELS),
            "free": _gauge(names.DCGM_FB_FREE, "Framebuffer memory free (in MiB).", names.DCGM_LABELS),
            "total": _gauge(names.DCGM_FB_TOTAL, "Framebuffer memory total (in MiB).", names.DCGM_LABELS),
            "power": _gauge(names.DCGM_POWER_USAGE, "Power draw (in W).", names.DCGM_LABELS),
            "temp": _gauge(names.DCGM_GPU_TEMP, "GPU temperature (in C).", names.DCGM_LABELS),
        }
        procs = _gauge(
            names.GPU_PROCESS_MEMORY_BYTES,
            "GPU memory held by a process",
            [*names.GPU_LABELS, "pid", "service"],
        )
        for s in samples:
            d, r = s.device, s.reading
            ours_labels = [str(d.index), d.uuid, d.model_name, d.vendor, self._hostname]
            dcgm_labels = [str(d.index), d.uuid, d.model_name, self._hostname]
            ours["util"].add_metric(ours_labels, r.utilization_ratio)
            ours["used"].add_metric(ours_labels, r.memory_used_bytes)
            ours["total"].add_metric(ours_labels, r.memory_total_bytes)
            dcgm["util"].add_metric(dcgm_labels, round(r.utilization_ratio * 100.0, 3))
            dcgm["used"].add_metric(dcgm_labels, r.memory_used_bytes / MIB)
            dcgm["free"].add_metric(dcgm_labels, (r.memory_total_bytes - r.memory_used_bytes) / MIB)
            dcgm["total"].add_metric(dcgm_labels, r.memory_total_bytes / MIB)
            if r.power_watts is not None:
                ours["power"].add_metric(ours_labels, r.power_watts)
                dcgm["power"].add_metric(dcgm_labels, r.power_watts)
            if r.temperature_celsius is not None:
                ours["temp"].add_metric(ours_labels, r.temperature_celsius)
                dcgm["temp"].add_metric(dcgm_labels, r.temperature_celsius)
            for p in s.processes:
                procs.add_metric([*ours_labels, str(p.pid), self._service_of_pid(p.pid)], p.memory_bytes)
        yield from ours.values()
        yield procs
        yield from dcgm.values()

    def describe(self) -> list[Metric]:
        return []  # collected lazily; describing would take a snapshot at registration


def register_telemetry(
    registry: CollectorRegistry,
    provider: TelemetryProvider,
    gpu: GpuSource | None = None,
    hostname: str = "",
    service_of_pid: Callable[[int], str] | None = None,
) -> CollectorRegistry:
    """Add the host and GPU telemetry collector to registry; returns registry."""
    registry.register(HostCollector(provider, gpu, hostname, service_of_pid))
    return registry


def build_registry(
    provider: TelemetryProvider,
    gpu: GpuSource | None = None,
    hostname: str = "",
    service_of_pid: Callable[[int], str] | None = None,
) -> CollectorRegistry:
    """A fresh registry holding only the telemetry collector."""
    return register_telemetry(CollectorRegistry(auto_describe=False), provider, gpu, hostname, service_of_pid)


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
