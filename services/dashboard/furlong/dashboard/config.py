"""The dashboard's configuration, parsed once in `__main__`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DashboardConfig:
    host: str
    port: int
    watch_pids: tuple[int, ...] = ()   # empty = every process running a Furlong service

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must be non-empty")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port!r}")
        for pid in self.watch_pids:
            if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
                raise ValueError(f"watch pid must be a positive integer, got {pid!r}")
