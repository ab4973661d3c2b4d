"""Samples utilisation lanes for the web UI on a background thread: host CPU plus every GPU.

Owns a daemon thread started by `start()` and stopped by `stop()` (idempotent). Reads CPU counters
itself (it does not share the exporter's previous reading, so scrapes and ticks do not disturb each
other) and GPU utilisation through the same `GpuTelemetry` the exporter uses.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from furlong.dashboard.core.host_telemetry import cpu_utilization
from furlong.dashboard.core.lanes import UtilizationLanes
from furlong.dashboard.exporter import GpuSource
from furlong.dashboard.host_provider import read_cpu_times

log = logging.getLogger(__name__)


class TelemetryHistory:
    def __init__(
        self,
        gpu: GpuSource | None,
        interval_s: float,
        max_points: int = 600,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.lanes = UtilizationLanes(max_points)
        self._gpu = gpu
        self._interval_s = interval_s
        self._clock = clock
        self._last_cpu = read_cpu_times()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> None:
        """Take one sample of every lane now."""
        ratios: dict[str, float] = {}
        now_cpu = read_cpu_times()
        cpu = cpu_utilization(self._last_cpu, now_cpu)
        if cpu is not None:
            self._last_cpu = now_cpu
            ratios["cpu"] = cpu
        for sample in self._gpu.sample() if self._gpu is not None else []:
            d = sample.device
            ratios[f"gpu{d.index} {d.model_name}"] = sample.reading.utilization_ratio
        if ratios:
            self.lanes.add(self._clock(), ratios)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="telemetry-history", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.tick()
            except Exception:  # keep sampling; the exporter reports the same failures
                log.exception("telemetry history tick failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
