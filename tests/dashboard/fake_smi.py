"""Fake `pynvml` and `amdsmi` modules for `sys.modules`, mirroring the real libraries' call names,
return shapes and units (NVML: bytes, milliwatts, percent; amdsmi: VRAM in MiB, power in watts with
"N/A" / 0xFFFF for unavailable, process memory in bytes, info dicts). Each records the calls made."""

from __future__ import annotations

import enum
import types
from dataclasses import dataclass, field
from typing import Any


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


@dataclass
class NvGpu:
    uuid: str | bytes
    name: str | bytes
    util_percent: int
    mem_used_bytes: int
    mem_total_bytes: int
    power_mw: int | None = None  # None: NVML_ERROR_NOT_SUPPORTED
    temp_c: int = 40
    procs: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, usedGpuMemory bytes)
    fail: bool = False  # every read raises (e.g. GPU fell off the bus)


def make_pynvml(gpus: list[NvGpu], init_error: Exception | None = None) -> types.ModuleType:
    m = types.ModuleType("pynvml")
    m.calls = []
    m.NVMLError = NVMLError
    m.NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    m.NVML_TEMPERATURE_GPU = 0

    def record(name):
        m.calls.append(name)

    def gpu(handle) -> NvGpu:
        if handle.fail:
            raise NVMLError("GPU is lost")
        return handle

    def nvmlInit():
        record("nvmlInit")
        if init_error is not None:
            raise init_error

    m.nvmlInit = nvmlInit
    m.nvmlShutdown = lambda: record("nvmlShutdown")
    m.nvmlDeviceGetCount = lambda: len(gpus)
    m.nvmlDeviceGetHandleByIndex = lambda i: gpus[i]
    m.nvmlDeviceGetUUID = lambda h: h.uuid
    m.nvmlDeviceGetName = lambda h: h.name
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=gpu(h).util_percent, memory=0)
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        total=gpu(h).mem_total_bytes, used=h.mem_used_bytes, free=h.mem_total_bytes - h.mem_used_bytes
    )

    def power(h):
        if gpu(h).power_mw is None:
            raise NVMLError_NotSupported("Not Supported")
        return h.power_mw

    m.nvmlDeviceGetPowerUsage = power
    m.nvmlDeviceGetTemperature = lambda h, sensor: gpu(h).temp_c
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        types.SimpleNamespace(
            pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF
        )
        for pid, used in gpu(h).procs
    ]
    return m


class AmdSmiException(Exception):
    pass


class AmdSmiTemperatureType(enum.IntEnum):
    EDGE = 0
    HOTSPOT = 1
    VRAM = 2


class AmdSmiTemperatureMetric(enum.IntEnum):
    CURRENT = 0


@dataclass
class AmdGpu:
    bdf: str
    uuid: str | bytes
    market_name: str | bytes
    gfx_activity: Any  # percent, or "N/A"
    vram_used_mib: Any
    vram_total_mib: Any
    power_info: dict[str, Any] = field(default_factory=dict)
    hotspot_c: Any = 50
    procs: list[dict] = field(default_factory=list)
    fail: bool = False


def amd_proc(pid: int, vram_bytes: int, name: str = "python") -> dict:
    """amdsmi_get_gpu_process_list's ROCm 6.x entry shape."""
    return {
        "name": name,
        "pid": pid,
        "mem": vram_bytes,
        "engine_usage": {"gfx": 0, "enc": 0},
        "memory_usage": {"gtt_mem": 4096, "cpu_mem": 8192, "vram_mem": vram_bytes},
        "cu_occupancy": "N/A",
    }


def make_amdsmi(gpus: list[AmdGpu], init_error: Exception | None = None) -> types.ModuleType:
    m = types.ModuleType("amdsmi")
    m.calls = []
    m.AmdSmiException = AmdSmiException
    m.AmdSmiTemperatureType = AmdSmiTemperatureType
    m.AmdSmiTemperatureMetric = AmdSmiTemperatureMetric

    def gpu(handle) -> AmdGpu:
        if handle.fail:
            raise AmdSmiException("AMDSMI_STATUS_DRIVER_NOT_LOADED")
        return handle

    def amdsmi_init(*flags):
        m.calls.append("amdsmi_init")
        if init_error is not None:
            raise init_error

    m.amdsmi_init = amdsmi_init
    m.amdsmi_shut_down = lambda: m.calls.append("amdsmi_shut_down")
    m.amdsmi_get_processor_handles = lambda: list(gpus)
    m.amdsmi_get_gpu_device_bdf = lambda h: h.bdf
    m.amdsmi_get_gpu_device_uuid = lambda h: h.uuid
    m.amdsmi_get_gpu_asic_info = lambda h: {
        "market_name": h.market_name,
        "vendor_id": "0x1002",
        "device_id": "0x74a1",
        "asic_serial": "0x1",
    }
    m.amdsmi_get_gpu_activity = lambda h: {
        "gfx_activity": gpu(h).gfx_activity,
        "umc_activity": 0,
        "mm_activity": "N/A",
    }
    m.amdsmi_get_gpu_vram_usage = lambda h: {
        "vram_total": gpu(h).vram_total_mib,
        "vram_used": h.vram_used_mib,
    }
    m.amdsmi_get_power_info = lambda h: dict(gpu(h).power_info)

    def temp(h, sensor, metric):
        if sensor == AmdSmiTemperatureType.HOTSPOT and gpu(h).hotspot_c is not None:
            return h.hotspot_c
        raise AmdSmiException("AMDSMI_STATUS_NOT_SUPPORTED")

    m.amdsmi_get_temp_metric = temp
    m.amdsmi_get_gpu_process_list = lambda h: list(gpu(h).procs)
    return m
