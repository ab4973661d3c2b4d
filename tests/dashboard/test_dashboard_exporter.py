"""The exporter's GPU series (dcgm-exporter-compatible and furlong_gpu_*) from fake vendor modules."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from fake_smi import AmdGpu, NvGpu, amd_proc, make_amdsmi, make_pynvml
from prometheus_client.parser import text_string_to_metric_families

from furlong.dashboard.core.host_telemetry import HostSnapshot
from furlong.dashboard.exporter import build_registry, exposition
from furlong.dashboard.gpu_providers import open_gpu_telemetry
from furlong.dashboard.scrape_targets import scrape_targets

GIB, MIB = 1 << 30, 1 << 20


def parse_series(text: str) -> dict[str, float]:
    """'name{labels}' -> value, labels in the order written below (gpu first), not the wire order."""
    order = [
        "gpu",
        "UUID",
        "uuid",
        "modelName",
        "model_name",
        "vendor",
        "Hostname",
        "hostname",
        "pid",
        "service",
    ]
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{s.labels[k]}"' for k in sorted(s.labels, key=order.index))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


class IdleHost:
    def snapshot(self) -> HostSnapshot:
        return HostSnapshot(cpu_utilization_ratio=0.5, memory_total_bytes=100, memory_used_bytes=40)


def scrape(monkeypatch, module_name: str, module, choice: str) -> dict[str, float]:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    monkeypatch.setitem(sys.modules, module_name, module)
    gpu = open_gpu_telemetry(choice)
    try:
        registry = build_registry(IdleHost(), gpu, "node-a", {4242: "trainer"}.get)
        return parse_series(exposition(registry).decode())
    finally:
        gpu.close()


@pytest.mark.unit
def test_nvidia_series_in_dcgm_and_furlong_units(monkeypatch):
    gpus = [
        NvGpu(
            uuid="GPU-a",
            name="NVIDIA H100",
            util_percent=37,
            mem_used_bytes=10 * GIB,
            mem_total_bytes=80 * GIB,
            power_mw=312_500,
            temp_c=61,
            procs=[(4242, 3 * GIB)],
        ),
        NvGpu(
            uuid="GPU-b",
            name="NVIDIA H100",
            util_percent=0,
            mem_used_bytes=0,
            mem_total_bytes=80 * GIB,
            power_mw=None,
            temp_c=30,
        ),
    ]
    values = scrape(monkeypatch, "pynvml", make_pynvml(gpus), "nvml")
    dcgm = 'gpu="0",UUID="GPU-a",modelName="NVIDIA H100",Hostname="node-a"'
    ours = 'gpu="0",uuid="GPU-a",model_name="NVIDIA H100",vendor="nvidia",hostname="node-a"'
    assert values[f"DCGM_FI_DEV_GPU_UTIL{{{dcgm}}}"] == 37.0
    assert values[f"DCGM_FI_DEV_FB_USED{{{dcgm}}}"] == 10 * 1024
    assert values[f"DCGM_FI_DEV_FB_FREE{{{dcgm}}}"] == 70 * 1024
    assert values[f"DCGM_FI_DEV_POWER_USAGE{{{dcgm}}}"] == 312.5
    assert values[f"DCGM_FI_DEV_GPU_TEMP{{{dcgm}}}"] == 61.0
    assert values[f"furlong_gpu_utilization_ratio{{{ours}}}"] == 0.37
    assert values[f"furlong_gpu_memory_used_bytes{{{ours}}}"] == 10 * GIB
    assert values[f"furlong_gpu_power_watts{{{ours}}}"] == 312.5
    assert values[f'furlong_gpu_process_memory_bytes{{{ours},pid="4242",service="trainer"}}'] == 3 * GIB
    assert values['furlong_gpu_devices{vendor="nvidia"}'] == 2.0
    # GPU 1 has no power reading: its power series is missing, not 0
    assert not [k for k in values if "POWER" in k and 'gpu="1"' in k]
    assert not [k for k in values if "power_watts" in k and 'gpu="1"' in k]
    assert (
        values['DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-b",modelName="NVIDIA H100",Hostname="node-a"}'] == 0.0
    )


@pytest.mark.unit
def test_amd_series_share_the_names_with_vendor_label(monkeypatch):
    gpus = [
        AmdGpu(
            bdf="0000:c1:00.0",
            uuid="amd-1",
            market_name=b"AMD Instinct MI300X",
            gfx_activity=55,
            vram_used_mib=2048,
            vram_total_mib=196_592,
            power_info={"current_socket_power": "N/A", "average_socket_power": 250},
            procs=[amd_proc(4242, 512 * MIB), amd_proc(99, 0)],
        )
    ]
    values = scrape(monkeypatch, "amdsmi", make_amdsmi(gpus), "auto")
    dcgm = 'gpu="0",UUID="amd-1",modelName="AMD Instinct MI300X",Hostname="node-a"'
    ours = 'gpu="0",uuid="amd-1",model_name="AMD Instinct MI300X",vendor="amd",hostname="node-a"'
    assert values[f"DCGM_FI_DEV_FB_USED{{{dcgm}}}"] == 2048.0
    assert values[f"DCGM_FI_DEV_FB_TOTAL{{{dcgm}}}"] == 196_592.0
    assert values[f"DCGM_FI_DEV_POWER_USAGE{{{dcgm}}}"] == 250.0
    assert values[f"DCGM_FI_DEV_GPU_UTIL{{{dcgm}}}"] == 55.0
    assert values[f"furlong_gpu_memory_total_bytes{{{ours}}}"] == 196_592 * MIB
    procs = {k: v for k, v in values.items() if k.startswith("furlong_gpu_process_memory_bytes")}
    assert procs == {f'furlong_gpu_process_memory_bytes{{{ours},pid="4242",service="trainer"}}': 512 * MIB}


@pytest.mark.integration
def test_explicit_backend_that_cannot_start_exits_with_a_clear_error():
    if importlib.util.find_spec("amdsmi") is not None:
        pytest.skip("amdsmi is installed here: the backend might start")
    proc = subprocess.run(
        [sys.executable, "-m", "furlong.dashboard", "--port", "0", "--gpu-backend", "amdsmi"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "gpu backend 'amdsmi' unavailable" in proc.stderr


@pytest.mark.unit
def test_scrape_targets_from_a_local_stack_description():
    stack = {
        "processes": [
            {"name": "redis", "pid": 1, "port": 6379, "metrics_port": None},
            {"name": "weight_broker", "pid": 2, "port": 5001, "metrics_port": 9001},
            {"name": "trainer", "pid": 3, "port": 5002, "metrics_port": 9002},
            {"name": "controller", "pid": 4, "port": 8080, "metrics_port": None},
            {"name": "dashboard", "pid": 5, "port": 8081, "metrics_port": None},
        ]
    }
    assert scrape_targets(stack) == [
        {
            "targets": ["127.0.0.1:9001"],
            "labels": {"job": "furlong-weight-broker", "service": "weight_broker"},
        },
        {"targets": ["127.0.0.1:9002"], "labels": {"job": "furlong-trainer", "service": "trainer"}},
        {"targets": ["127.0.0.1:8080"], "labels": {"job": "furlong-controller", "service": "controller"}},
        {"targets": ["127.0.0.1:8081"], "labels": {"job": "furlong-dashboard", "service": "dashboard"}},
    ]
    stack["processes"][2]["metrics_port"] = None
    with pytest.raises(ValueError, match="'trainer' .pid 3. has no metrics_port"):
        scrape_targets(stack)
