"""Host telemetry as values: CPU time counters, memory, per-process RSS, and the arithmetic on them.

The provider (`host_provider.py`) reads the operating system; this module only turns two readings
of CPU time into a utilisation ratio and a command line into a service name. No I/O.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

# Linux counts guest time inside user/nice as well; adding it again would count it twice.
_NOT_SUMMED = frozenset({"guest", "guest_nice"})
_IDLE = frozenset({"idle", "iowait"})


@dataclass(frozen=True)
class CpuTimes:
    """Cumulative CPU seconds since boot, summed over all CPUs, by kind (user, system, idle, ...)."""

    seconds: dict[str, float]

    @property
    def total_s(self) -> float:
        return sum(v for k, v in self.seconds.items() if k not in _NOT_SUMMED)

    @property
    def idle_s(self) -> float:
        return sum(v for k, v in self.seconds.items() if k in _IDLE)


def cpu_utilization(before: CpuTimes, after: CpuTimes) -> float | None:
    """Fraction of CPU time spent busy between two readings, in [0, 1]; None when no time passed
    (or the counters went backwards), so a caller can keep its previous value."""
    total = after.total_s - before.total_s
    idle = after.idle_s - before.idle_s
    if total <= 0:
        return None
    return min(1.0, max(0.0, (total - idle) / total))


@dataclass(frozen=True)
class ProcessSample:
    pid: int
    service: str
    rss_bytes: int


@dataclass(frozen=True)
class HostSnapshot:
    cpu_utilization_ratio: float
    memory_total_bytes: int
    memory_used_bytes: int  # total minus what is available to new work without swapping
    processes: tuple[ProcessSample, ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 <= self.cpu_utilization_ratio <= 1.0:
            raise ValueError(f"cpu_utilization_ratio {self.cpu_utilization_ratio} not in [0, 1]")
        if not 0 <= self.memory_used_bytes <= self.memory_total_bytes:
            raise ValueError(
                f"memory_used_bytes {self.memory_used_bytes} not in [0, {self.memory_total_bytes}]"
            )


def service_from_cmdline(cmdline: Sequence[str]) -> str | None:
    """The Furlong service a command line runs: `python -m furlong.trainer ...` -> "trainer", the
    `furlong` CLI -> "cli"; None for anything else."""
    args = list(cmdline)
    for i, arg in enumerate(args[:-1]):
        if arg == "-m" and args[i + 1].startswith("furlong."):
            return args[i + 1].removeprefix("furlong.").split(".")[0]
    if len(args) >= 2 and os.path.basename(args[1]) == "furlong":
        return "cli"  # `python /venv/bin/furlong ...`
    if args and os.path.basename(args[0]) == "furlong":
        return "cli"
    return None
