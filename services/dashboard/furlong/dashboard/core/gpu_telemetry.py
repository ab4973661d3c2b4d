"""GPU telemetry as values, in base units, and the vendor-unit arithmetic that produces them.

Every backend (NVML, AMD SMI) converts at its boundary into these types: bytes, watts, ratios in
[0, 1], degrees Celsius. A value the vendor library cannot give is None (a missing series), never 0.
No I/O: the backends in `gpu_backends.py` call the vendor libraries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

MIB = 1 << 20
VENDOR_NVIDIA = "nvidia"
VENDOR_AMD = "amd"
# amdsmi's "value not available" markers across ROCm generations.
AMD_UNAVAILABLE_UINT16 = 0xFFFF
AMD_UNAVAILABLE_TEXT = "N/A"
# ROCm 6.3+ reports `socket_power`; 6.0-6.2 `current_socket_power` (MI300) and
# `average_socket_power` (older ASICs). First available wins.
AMD_POWER_KEYS = ("socket_power", "current_socket_power", "average_socket_power")


@dataclass(frozen=True)
class GpuDevice:
    """One physical GPU, `index` in the vendor SMI's order (nvidia-smi / amd-smi)."""

    index: int
    uuid: str
    model_name: str
    vendor: str


@dataclass(frozen=True)
class GpuReading:
    utilization_ratio: float
    memory_used_bytes: int
    memory_total_bytes: int
    power_watts: float | None = None
    temperature_celsius: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.utilization_ratio <= 1.0:
            raise ValueError(f"utilization_ratio {self.utilization_ratio} not in [0, 1]")
        if not 0 <= self.memory_used_bytes <= self.memory_total_bytes:
            raise ValueError(
                f"memory_used_bytes {self.memory_used_bytes} not in [0, {self.memory_total_bytes}]"
            )
        if self.power_watts is not None and self.power_watts < 0:
            raise ValueError(f"power_watts {self.power_watts} is negative")


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    memory_bytes: int


@dataclass(frozen=True)
class GpuSample:
    """One device's reading and processes at one tick."""

    device: GpuDevice
    reading: GpuReading
    processes: tuple[GpuProcess, ...] = ()


class GpuBackend(Protocol):
    """A vendor library behind three calls. Not thread-safe: one sampler owns it.

    `init` imports the vendor module lazily and raises on a missing/broken library or driver;
    `read` and `processes` raise for a device that cannot be read this time; `shutdown` is
    idempotent."""

    name: str

    def init(self) -> list[GpuDevice]: ...

    def read(self, device: GpuDevice) -> GpuReading: ...

    def processes(self, device: GpuDevice) -> list[GpuProcess]: ...

    def shutdown(self) -> None: ...


def decode_text(value: str | bytes) -> str:
    """Older pynvml/amdsmi builds return C strings as bytes."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace").rstrip("\x00")
    return str(value)


def amd_value(value: Any) -> float | None:
    """An amdsmi number, or None for its "N/A" / 0xFFFF markers (and anything non-numeric)."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (str, bytes)):
        text = decode_text(value).strip()
        if text.upper() == AMD_UNAVAILABLE_TEXT:
            return None
        try:
            value = float(text)
        except ValueError:
            return None
    if not isinstance(value, (int, float)):
        return None
    if value == AMD_UNAVAILABLE_UINT16:
        return None
    return float(value)


def amd_power_watts(power_info: Mapping[str, Any]) -> float | None:
    """Socket power in watts from `amdsmi_get_power_info`, read across ROCm generations."""
    for key in AMD_POWER_KEYS:
        watts = amd_value(power_info.get(key))
        if watts is not None:
            return watts
    return None


def percent_to_ratio(percent: float) -> float:
    """SMI utilisation percent -> ratio; raises on values outside [0, 100] rather than clamping."""
    if not 0 <= percent <= 100:
        raise ValueError(f"utilisation {percent}% not in [0, 100]")
    return percent / 100.0


def mib_to_bytes(mib: float) -> int:
    return int(round(mib * MIB))


def milliwatts_to_watts(milliwatts: float) -> float:
    return milliwatts / 1000.0


def order_by_bus_id(devices: Sequence[tuple[str, Any]]) -> list[Any]:
    """Handles sorted by PCI bus id ("0000:03:00.0"), the order amd-smi lists devices in."""
    return [handle for _, handle in sorted(devices, key=lambda pair: pair[0].lower())]
