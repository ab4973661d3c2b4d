"""Host telemetry read from the operating system with psutil (Linux /proc, macOS, ...).

The fallback provider for machines without GPU telemetry: CPU utilisation between two readings,
memory in use, and the resident memory of watched processes (the pids given, those a pids file lists
at each reading, or every process running a Furlong service). Thread-safe: a lock guards the
previous CPU reading.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path

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
    their executable name); pids_file: a JSON file whose `processes` list gives each process's
    `pid`, read again at every snapshot (the local stack's `stack.json`, rewritten by its supervisor
    when it restarts a service, so a restarted service is reported under its new pid); neither =
    discover every process running `python -m furlong.<service>` or the `furlong` CLI. The
    provider's own process is always reported."""

    def __init__(self, watch_pids: Iterable[int] = (), pids_file: Path | None = None) -> None:
        self.watch_pids = tuple(dict.fromkeys(int(p) for p in watch_pids))
        for pid in self.watch_pids:
            if pid <= 0:
                raise ValueError(f"watch pid must be > 0, got {pid}")
        self.pids_file = pids_file
        self._file_pids: tuple[int, ...] = ()  # the last list read from pids_file
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

    def _read_pids_file(self) -> tuple[int, ...]:
        """The pids pids_file lists now; the last good list when it cannot be read or parsed."""
        assert self.pids_file is not None
        try:
            data = json.loads(self.pids_file.read_text())
            pids = tuple(int(p["pid"]) for p in data["processes"] if int(p["pid"]) > 0)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.debug("pids file %s not read (%s); keeping %s", self.pids_file, exc, self._file_pids)
            return self._file_pids
        self._file_pids = pids
        return pids

    def _processes(self) -> list[ProcessSample]:
        watched = [*self.watch_pids, *(self._read_pids_file() if self.pids_file is not None else ())]
        if watched or self.pids_file is not None:
            candidates = [*watched, os.getpid()]
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
