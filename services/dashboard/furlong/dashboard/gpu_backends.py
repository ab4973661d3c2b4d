"""The vendor GPU backends: NVML (`nvidia-ml-py`, module `pynvml`) and AMD SMI (`amdsmi`).

Each imports its vendor module inside `init`, so a missing or broken library (amdsmi raises at
import without ROCm) is a failed backend, not a failed process. Units are converted here, at the
boundary: NVML memory is bytes and power milliwatts; amdsmi VRAM is MiB, power watts, process
memory bytes, with "N/A" / 0xFFFF for unavailable values. Utilisation and memory are required
(a read that cannot give them raises); power and temperature are optional (None = missing series).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from furlong.dashboard.core.gpu_telemetry import (
    VENDOR_AMD,
    VENDOR_NVIDIA,
    GpuDevice,
    GpuProcess,
    GpuReading,
    amd_power_watts,
    amd_value,
    decode_text,
    mib_to_bytes,
    milliwatts_to_watts,
    order_by_bus_id,
    percent_to_ratio,
)

log = logging.getLogger(__name__)


def _optional(
    read: Callable[[], float | None], errors: type[BaseException] | tuple[type[BaseException], ...]
) -> float | None:
    try:
        return read()
    except errors as exc:  # "not supported" on this device: the series is missing, not zero
        log.debug("optional GPU field unavailable: %s", exc)
        return None


class NvmlBackend:
    """NVIDIA GPUs through NVML. Devices in NVML index order, which is nvidia-smi's (PCI bus) order,
    not CUDA's default fastest-first order."""

    name = "nvml"

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: dict[str, Any] = {}

    def init(self) -> list[GpuDevice]:
        import pynvml  # lazily: the module may be absent on AMD/CPU images

        pynvml.nvmlInit()
        self._nvml = pynvml
        try:
            devices = []
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                device = GpuDevice(
                    index=index,
                    uuid=decode_text(pynvml.nvmlDeviceGetUUID(handle)),
                    model_name=decode_text(pynvml.nvmlDeviceGetName(handle)),
                    vendor=VENDOR_NVIDIA,
                )
                self._handles[device.uuid] = handle
                devices.append(device)
        except Exception:
            self.shutdown()
            raise
        return devices

    def read(self, device: GpuDevice) -> GpuReading:
        nv, handle = self._nvml, self._handles[device.uuid]
        utilization = nv.nvmlDeviceGetUtilizationRates(handle)
        memory = nv.nvmlDeviceGetMemoryInfo(handle)
        power = _optional(lambda: milliwatts_to_watts(nv.nvmlDeviceGetPowerUsage(handle)), nv.NVMLError)
        temperature = _optional(
            lambda: float(nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU)), nv.NVMLError
        )
        return GpuReading(
            utilization_ratio=percent_to_ratio(utilization.gpu),
            memory_used_bytes=int(memory.used),
            memory_total_bytes=int(memory.total),
            power_watts=power,
            temperature_celsius=temperature,
        )

    def processes(self, device: GpuDevice) -> list[GpuProcess]:
        nv, handle = self._nvml, self._handles[device.uuid]
        by_pid: dict[int, int] = {}
        for info in nv.nvmlDeviceGetComputeRunningProcesses(handle):
            used = info.usedGpuMemory  # None when NVML cannot attribute memory (e.g. MIG, WDDM)
            if used:
                by_pid[int(info.pid)] = by_pid.get(int(info.pid), 0) + int(used)
        return [GpuProcess(pid=pid, memory_bytes=used) for pid, used in sorted(by_pid.items())]

    def shutdown(self) -> None:
        if self._nvml is not None:
            nvml, self._nvml = self._nvml, None
            self._handles.clear()
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError as exc:
                log.warning("nvmlShutdown failed: %s", exc)


class AmdSmiBackend:
    """AMD GPUs through amdsmi. Devices sorted by PCI bus id, amd-smi's listing order."""

    name = "amdsmi"

    def __init__(self) -> None:
        self._smi: Any = None
        self._handles: dict[str, Any] = {}

    def init(self) -> list[GpuDevice]:
        import amdsmi  # lazily: raises at import without ROCm's libamd_smi.so

        amdsmi.amdsmi_init()
        self._smi = amdsmi
        try:
            handles = amdsmi.amdsmi_get_processor_handles()
            ordered = order_by_bus_id(
                [(decode_text(amdsmi.amdsmi_get_gpu_device_bdf(h)), h) for h in handles]
            )
            devices = []
            for index, handle in enumerate(ordered):
                asic = amdsmi.amdsmi_get_gpu_asic_info(handle)
                device = GpuDevice(
                    index=index,
                    uuid=decode_text(amdsmi.amdsmi_get_gpu_device_uuid(handle)),
                    model_name=decode_text(asic.get("market_name") or "AMD GPU"),
                    vendor=VENDOR_AMD,
                )
                self._handles[device.uuid] = handle
                devices.append(device)
        except Exception:
            self.shutdown()
            raise
        return devices

    def read(self, device: GpuDevice) -> GpuReading:
        smi, handle = self._smi, self._handles[device.uuid]
        busy_percent = amd_value(smi.amdsmi_get_gpu_activity(handle).get("gfx_activity"))
        vram = smi.amdsmi_get_gpu_vram_usage(handle)
        used_mib, total_mib = amd_value(vram.get("vram_used")), amd_value(vram.get("vram_total"))
        if busy_percent is None or used_mib is None or total_mib is None:
            raise ValueError(
                f"amdsmi gave no utilisation/VRAM for GPU {device.index} "
                f"(gfx_activity={busy_percent}, vram={dict(vram)})"
            )
        power = _optional(lambda: amd_power_watts(smi.amdsmi_get_power_info(handle)), smi.AmdSmiException)
        return GpuReading(
            utilization_ratio=percent_to_ratio(busy_percent),
            memory_used_bytes=mib_to_bytes(used_mib),
            memory_total_bytes=mib_to_bytes(total_mib),
            power_watts=power,
            temperature_celsius=self._temperature(handle),
        )

    def _temperature(self, handle: Any) -> float | None:
        smi = self._smi
        # MI200/MI300 report no edge sensor; the hotspot (junction) one exists on every generation.
        for sensor in ("HOTSPOT", "EDGE"):

            def read(sensor: str = sensor) -> float | None:
                return amd_value(
                    smi.amdsmi_get_temp_metric(
                        handle,
                        getattr(smi.AmdSmiTemperatureType, sensor),
                        smi.AmdSmiTemperatureMetric.CURRENT,
                    )
                )

            value = _optional(read, smi.AmdSmiException)
            if value is not None:
                return value
        return None

    def processes(self, device: GpuDevice) -> list[GpuProcess]:
        smi, handle = self._smi, self._handles[device.uuid]
        by_pid: dict[int, int] = {}
        for entry in smi.amdsmi_get_gpu_process_list(handle):
            # ROCm 6.x returns info dicts; 5.x returned process handles to look up.
            info = entry if isinstance(entry, dict) else smi.amdsmi_get_gpu_process_info(handle, entry)
            vram = amd_value((info.get("memory_usage") or {}).get("vram_mem"))
            if not vram:  # no VRAM held (or unknown): not a GPU process in NVML's sense
                continue
            pid = int(info["pid"])
            by_pid[pid] = by_pid.get(pid, 0) + int(vram)
        return [GpuProcess(pid=pid, memory_bytes=used) for pid, used in sorted(by_pid.items())]

    def shutdown(self) -> None:
        if self._smi is not None:
            smi, self._smi = self._smi, None
            self._handles.clear()
            try:
                smi.amdsmi_shut_down()
            except smi.AmdSmiException as exc:
                log.warning("amdsmi_shut_down failed: %s", exc)
