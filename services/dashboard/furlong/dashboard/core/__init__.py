"""The dashboard's pure logic: telemetry values and the arithmetic on them. No I/O."""

from furlong.dashboard.core.host_telemetry import (
    CpuTimes,
    HostSnapshot,
    ProcessSample,
    cpu_utilization,
    service_from_cmdline,
)

__all__ = ["CpuTimes", "HostSnapshot", "ProcessSample", "cpu_utilization", "service_from_cmdline"]
