"""GPU backends against fake `pynvml` / `amdsmi` modules in sys.modules, and the real NVML on a GPU."""

from __future__ import annotations

import logging
import sys

import pytest
from fake_smi import AmdGpu, NvGpu, NVMLError_LibraryNotFound, amd_proc, make_amdsmi, make_pynvml

from furlong.dashboard.core.gpu_telemetry import GpuReading, amd_power_watts, amd_value, decode_text
from furlong.dashboard.gpu_backends import AmdSmiBackend, NvmlBackend
from furlong.dashboard.gpu_providers import GpuTelemetry, GpuTelemetryUnavailable, open_gpu_telemetry

GIB = 1 << 30
MIB = 1 << 20


def nv_gpu(i: int, **kw) -> NvGpu:
    base = dict(
        uuid=f"GPU-{i:08d}",
        name="NVIDIA H100 80GB HBM3",
        util_percent=37,
        mem_used_bytes=10 * GIB,
        mem_total_bytes=80 * GIB,
        power_mw=312_500,
        temp_c=61,
    )
    return NvGpu(**{**base, **kw})


def amd_gpu(i: int, **kw) -> AmdGpu:
    base = dict(
        bdf=f"0000:{0x10 * (i + 1):02x}:00.0",
        uuid=f"amd-{i}",
        market_name="AMD Instinct MI300X",
        gfx_activity=55,
        vram_used_mib=2048,
        vram_total_mib=196_592,
        power_info={"socket_power": 420, "gfx_voltage": "N/A", "power_limit": 750},
    )
    return AmdGpu(**{**base, **kw})


@pytest.fixture
def no_vendor_modules(monkeypatch):
    """Neither library importable unless a test installs a fake."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    return monkeypatch


@pytest.mark.unit
def test_nvml_converts_units(no_vendor_modules):
    fake = make_pynvml([nv_gpu(0, procs=[(4242, 3 * GIB), (77, None)])])
    no_vendor_modules.setitem(sys.modules, "pynvml", fake)
    backend = NvmlBackend()
    [device] = backend.init()
    assert (device.index, device.uuid, device.model_name, device.vendor) == (
        0,
        "GPU-00000000",
        "NVIDIA H100 80GB HBM3",
        "nvidia",
    )
    assert backend.read(device) == GpuReading(
        utilization_ratio=0.37,
        memory_used_bytes=10 * GIB,
        memory_total_bytes=80 * GIB,
        power_watts=312.5,
        temperature_celsius=61.0,
    )
    # usedGpuMemory None (not attributable) is not reported as 0
    assert [(p.pid, p.memory_bytes) for p in backend.processes(device)] == [(4242, 3 * GIB)]
    backend.shutdown()
    backend.shutdown()
    assert fake.calls == ["nvmlInit", "nvmlShutdown"]


@pytest.mark.unit
def test_nvml_unsupported_power_is_missing_and_bytes_strings_decode(no_vendor_modules):
    no_vendor_modules.setitem(
        sys.modules,
        "pynvml",
        make_pynvml([nv_gpu(0, uuid=b"GPU-bytes\x00", name=b"Tesla T4", power_mw=None)]),
    )
    backend = NvmlBackend()
    [device] = backend.init()
    assert (device.uuid, device.model_name) == ("GPU-bytes", "Tesla T4")
    assert backend.read(device).power_watts is None


@pytest.mark.unit
def test_amdsmi_converts_units_and_orders_by_bus_id(no_vendor_modules):
    gpus = [amd_gpu(1, procs=[amd_proc(10, 512 * MIB), amd_proc(11, 0)]), amd_gpu(0)]
    fake = make_amdsmi(gpus)
    no_vendor_modules.setitem(sys.modules, "amdsmi", fake)
    backend = AmdSmiBackend()
    devices = backend.init()
    assert [(d.index, d.uuid, d.vendor) for d in devices] == [(0, "amd-0", "amd"), (1, "amd-1", "amd")]
    assert backend.read(devices[1]) == GpuReading(
        utilization_ratio=0.55,
        memory_used_bytes=2048 * MIB,
        memory_total_bytes=196_592 * MIB,
        power_watts=420.0,
        temperature_celsius=50.0,
    )
    # process memory is bytes already; a process holding no VRAM is dropped, as NVML would
    assert [(p.pid, p.memory_bytes) for p in backend.processes(devices[1])] == [(10, 512 * MIB)]
    backend.shutdown()
    assert fake.calls == ["amdsmi_init", "amdsmi_shut_down"]


@pytest.mark.unit
@pytest.mark.parametrize(
    "power_info, watts",
    [
        ({"socket_power": 300, "current_socket_power": 200, "average_socket_power": 100}, 300.0),
        ({"socket_power": "N/A", "current_socket_power": 200, "average_socket_power": 100}, 200.0),
        ({"current_socket_power": 0xFFFF, "average_socket_power": 100}, 100.0),  # ROCm 6.0 MI250
        ({"current_socket_power": "N/A", "average_socket_power": "N/A"}, None),
        ({"average_socket_power": 0xFFFF}, None),
        ({"average_socket_power": b"95"}, 95.0),
        ({}, None),
    ],
)
def test_amd_power_precedence(power_info, watts):
    assert amd_power_watts(power_info) == watts


@pytest.mark.unit
def test_amd_unavailable_values_and_decoding():
    assert [amd_value(v) for v in ("N/A", 0xFFFF, None, "n/a", "12", 7, True)] == [
        None,
        None,
        None,
        None,
        12.0,
        7.0,
        None,
    ]
    assert decode_text(b"MI300X\x00\x00") == "MI300X" and decode_text("x") == "x"


@pytest.mark.unit
def test_amd_power_unavailable_is_missing_and_na_utilisation_skips_device(no_vendor_modules):
    gpus = [
        amd_gpu(0, power_info={"average_socket_power": "N/A"}, hotspot_c=None),
        amd_gpu(1, gfx_activity="N/A"),
    ]
    no_vendor_modules.setitem(sys.modules, "amdsmi", make_amdsmi(gpus))
    telemetry = open_gpu_telemetry("amdsmi")
    [sample] = telemetry.sample()  # the device without utilisation is skipped, never invented
    assert sample.device.index == 0
    assert sample.reading.power_watts is None and sample.reading.temperature_celsius is None
    telemetry.close()


@pytest.mark.unit
def test_failing_device_is_skipped_with_rate_limited_warning(no_vendor_modules, caplog):
    gpus = [nv_gpu(0), nv_gpu(1, fail=True), nv_gpu(2, util_percent=90)]
    no_vendor_modules.setitem(sys.modules, "pynvml", make_pynvml(gpus))
    now = [100.0]
    backend = NvmlBackend()
    telemetry = GpuTelemetry(backend, backend.init(), warn_interval_s=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="furlong.dashboard.gpu_providers"):
        for _ in range(3):
            samples = telemetry.sample()
            assert [(s.device.index, s.reading.utilization_ratio) for s in samples] == [(0, 0.37), (2, 0.9)]
        assert len(caplog.records) == 1 and "GPU 1" in caplog.records[0].getMessage()
        now[0] += 61
        telemetry.sample()
        assert len(caplog.records) == 2
    telemetry.close()
    assert telemetry.sample() == []


@pytest.mark.unit
def test_auto_falls_back_from_nvml_to_amdsmi(no_vendor_modules):
    nv = make_pynvml([], init_error=NVMLError_LibraryNotFound("NVML Shared Library Not Found"))
    amd = make_amdsmi([amd_gpu(0)])
    no_vendor_modules.setitem(sys.modules, "pynvml", nv)
    no_vendor_modules.setitem(sys.modules, "amdsmi", amd)
    telemetry = open_gpu_telemetry("auto")
    assert telemetry.backend.name == "amdsmi" and telemetry.vendor == "amd"
    assert nv.calls == ["nvmlInit"]
    telemetry.close()
    assert amd.calls == ["amdsmi_init", "amdsmi_shut_down"]


@pytest.mark.unit
def test_auto_prefers_nvml_and_never_touches_amdsmi(no_vendor_modules):
    nv, amd = make_pynvml([nv_gpu(0)]), make_amdsmi([amd_gpu(0)])
    no_vendor_modules.setitem(sys.modules, "pynvml", nv)
    no_vendor_modules.setitem(sys.modules, "amdsmi", amd)
    telemetry = open_gpu_telemetry("auto")
    assert telemetry.backend.name == "nvml" and amd.calls == []
    telemetry.close()


@pytest.mark.unit
def test_auto_with_no_library_or_zero_devices_warns_once(no_vendor_modules, caplog):
    nv = make_pynvml([])  # driver present, zero devices: shut down again, next tried
    no_vendor_modules.setitem(sys.modules, "pynvml", nv)
    with caplog.at_level(logging.WARNING, logger="furlong.dashboard.gpu_providers"):
        assert open_gpu_telemetry("auto") is None
    assert nv.calls == ["nvmlInit", "nvmlShutdown"]
    [record] = caplog.records
    assert "nvml: no devices" in record.getMessage() and "amdsmi: ModuleNotFoundError" in record.getMessage()


@pytest.mark.unit
def test_explicit_choice_never_probes_the_other(no_vendor_modules):
    nv = make_pynvml([nv_gpu(0)])
    amd = make_amdsmi([], init_error=RuntimeError("AMDSMI_STATUS_INIT_ERROR"))
    no_vendor_modules.setitem(sys.modules, "pynvml", nv)
    no_vendor_modules.setitem(sys.modules, "amdsmi", amd)
    with pytest.raises(GpuTelemetryUnavailable, match="'amdsmi' unavailable: amdsmi: RuntimeError"):
        open_gpu_telemetry("amdsmi")
    assert nv.calls == [] and amd.calls == ["amdsmi_init"]
    assert open_gpu_telemetry("none") is None and nv.calls == []
    with pytest.raises(ValueError, match="'cuda'"):
        open_gpu_telemetry("cuda")


@pytest.mark.gpu
def test_real_nvml_backend_on_a_gpu_machine():
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError as exc:
        pytest.skip(f"no NVIDIA driver: {exc}")
    if count == 0:
        pytest.skip("NVML reports no GPUs")
    telemetry = open_gpu_telemetry("nvml")
    try:
        samples = telemetry.sample()
        assert [s.device.index for s in samples] == list(range(count))
        for s in samples:
            assert s.device.uuid.startswith(("GPU-", "MIG-")) and s.device.model_name
            assert 0 < s.reading.memory_total_bytes and 0 <= s.reading.memory_used_bytes
            assert s.reading.power_watts is None or 1.0 < s.reading.power_watts < 2000.0
    finally:
        telemetry.close()
