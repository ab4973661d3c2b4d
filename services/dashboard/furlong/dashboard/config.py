"""The dashboard's configuration, parsed once in `__main__`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from furlong.dashboard.gpu_providers import GPU_BACKEND_CHOICES as GPU_BACKEND_CHOICES
from furlong.service_main.ports import check_port


@dataclass(frozen=True)
class DashboardConfig:
    host: str
    port: int
    watch_pids: tuple[int, ...] = ()  # empty (and no pids file) = every Furlong service's process
    watch_pids_file: Path | None = None  # JSON with `processes: [{pid}]`, read at every sample
    gpu_backend: str = "auto"  # auto = NVML, then AMD SMI, then host only
    hostname: str = ""  # the `Hostname` label of GPU series
    controller_url: str = ""  # REST API the web UI reads runs from; empty = no runs list
    controller_token: str = ""  # bearer token for controller_url
    sample_interval_s: float = 2.0  # telemetry history tick of the web UI

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must be non-empty")
        check_port("port", self.port)
        for pid in self.watch_pids:
            if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
                raise ValueError(f"watch pid must be a positive integer, got {pid!r}")
        if self.gpu_backend not in GPU_BACKEND_CHOICES:
            raise ValueError(f"gpu_backend {self.gpu_backend!r} not one of {list(GPU_BACKEND_CHOICES)}")
        if self.controller_url and not self.controller_url.startswith(("http://", "https://")):
            raise ValueError(f"controller_url must be an http(s) URL, got {self.controller_url!r}")
        if self.controller_url and not self.controller_token:
            raise ValueError("controller_url needs a controller token (--controller-token-file)")
        if not 0.1 <= self.sample_interval_s <= 3600:
            raise ValueError(f"sample_interval_s must be in [0.1, 3600], got {self.sample_interval_s}")
