"""Host telemetry read from the operating system with psutil (Linux /proc, macOS, ...).

The fallback provider for machines without GPU telemetry: CPU utilisation between two readings,
memory in use, and the resident memory of watched processes (the pids given, or every process
running a Furlong service). Thread-safe: a lock guards the previous CPU reading.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable

import psutil

from furlong.dashboard.core.host_telemetry import (
    CpuTimes,
    HostSnapshot,
    ProcessSample,
    cpu_utilization,
    service_from_cmdline,
)

log = logging.getLogger(__name__)


def read_cpu_times() -> CpuTimes:
    return CpuTimes(seconds=dict(psutil.cpu_times()._asdict()))


class HostTelemetryProvider:
    """watch_pids: the processes to report (labelled by the service their command line runs, else
    their executable name); empty = discover every process running `python -m furlong.<service>`
    or the `furlong` CLI. The provider's own process is always reported."""

    def __init__(self, watch_pids: Iterable[int] = ()) -> None:
        self.watch_pids = tuple(dict.fromkeys(int(p) for p in watch_pids))
        for pid in self.watch_pids:
            if pid <= 0:
                raise ValueError(f"watch pid must be > 0, got {pid}")
        self._lock = threading.Lock()
        self._last_times = read_cpu_times()
        self._last_ratio = 0.0

    def snapshot(self) -> HostSnapshot:
        times = read_cpu_times()
        with self._lock:
            ratio = cpu_utilization(self._last_times, times)
            if ratio is not None:
                self._last_ratio, self._last_times = ratio, times
            ratio = self._last_ratio
        memory = psutil.virtual_memory()
        return HostSnapshot(
            cpu_utilization_ratio=ratio,
            memory_total_bytes=memory.total,
            memory_used_bytes=max(0, memory.total - memory.available),
            processes=tuple(self._processes()),
        )

    def _processes(self) -> list[ProcessSample]:
        if self.watch_pids:
            candidates = [*self.watch_pids, os.getpid()]
            procs = []
            for pid in dict.fromkeys(candidates):
                try:
                    procs.append(psutil.Process(pid))
                except psutil.NoSuchProcess:
                    log.debug("watched pid %d is gone", pid)
            return [s for s in (self._sample(p, named_only=False) for p in procs) if s]
        samples = [self._sample(p, named_only=True) for p in psutil.process_iter()]
        return [s for s in samples if s]

    @staticmethod
    def _sample(proc: psutil.Process, named_only: bool) -> ProcessSample | None:
        try:
            with proc.oneshot():
                service = service_from_cmdline(proc.cmdline())
                if service is None:
                    if named_only and proc.pid != os.getpid():
                        return None
                    service = proc.name() or "unknown"
                return ProcessSample(pid=proc.pid, service=service, rss_bytes=proc.memory_info().rss)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return None


def service_of_pid(pid: int) -> str:
    """The Furlong service a pid runs, else its executable name; "unknown" when it cannot be read."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            return service_from_cmdline(proc.cmdline()) or proc.name() or "unknown"
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "unknown"
