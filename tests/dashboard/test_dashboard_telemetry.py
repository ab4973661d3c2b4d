"""Host telemetry: pure arithmetic, the Prometheus collector, and the dashboard process over HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from furlong.dashboard.core.host_telemetry import (
    CpuTimes,
    HostSnapshot,
    ProcessSample,
    cpu_utilization,
    service_from_cmdline,
)
from furlong.dashboard.exporter import build_registry, exposition
from furlong.dashboard.host_provider import HostTelemetryProvider
from furlong.rpc.ports import free_port


def parse_metrics(text: str) -> dict[str, float]:
    """'name{labels}' -> value for every sample line."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def times(**seconds) -> CpuTimes:
    return CpuTimes(seconds={"user": 0.0, "system": 0.0, "idle": 0.0, "iowait": 0.0, "guest": 0.0, **seconds})


@pytest.mark.unit
@pytest.mark.parametrize(
    "before, after, expected",
    [
        (times(user=10, idle=10), times(user=13, idle=11), 0.75),
        (times(user=10, idle=10), times(user=10, idle=14), 0.0),
        (times(user=1, system=1, idle=1), times(user=3, system=3, idle=1), 1.0),
        (times(user=10, idle=10, iowait=0), times(user=11, idle=11, iowait=2), 0.25),  # iowait is idle
        (times(user=10, idle=10, guest=0), times(user=12, idle=12, guest=2), 0.5),  # guest not twice
        (times(user=10, idle=10), times(user=10, idle=10), None),
        (times(user=10, idle=10), times(user=9, idle=9), None),
    ],
)
def test_cpu_utilization(before, after, expected):
    assert cpu_utilization(before, after) == (None if expected is None else pytest.approx(expected))


@pytest.mark.unit
@pytest.mark.parametrize(
    "cmdline, service",
    [
        (["/v/bin/python", "-m", "furlong.trainer", "--port", "1"], "trainer"),
        (["python3", "-u", "-m", "furlong.weight_broker"], "weight_broker"),
        (["python", "-m", "furlong.dashboard.extra"], "dashboard"),
        (["/v/bin/python", "/v/bin/furlong", "run", "x.yaml"], "cli"),
        (["/v/bin/furlong", "up"], "cli"),
        (["redis-server", "127.0.0.1:6379"], None),
        (["python", "-m", "pytest"], None),
        (["python", "-m"], None),
        ([], None),
    ],
)
def test_service_from_cmdline(cmdline, service):
    assert service_from_cmdline(cmdline) == service


@pytest.mark.unit
def test_snapshot_rejects_impossible_values():
    with pytest.raises(ValueError, match="cpu_utilization_ratio 1.5"):
        HostSnapshot(cpu_utilization_ratio=1.5, memory_total_bytes=10, memory_used_bytes=1)
    with pytest.raises(ValueError, match="memory_used_bytes 11"):
        HostSnapshot(cpu_utilization_ratio=0.5, memory_total_bytes=10, memory_used_bytes=11)


class FixedProvider:
    def snapshot(self) -> HostSnapshot:
        return HostSnapshot(
            cpu_utilization_ratio=0.25,
            memory_total_bytes=8_000,
            memory_used_bytes=3_000,
            processes=(ProcessSample(11, "trainer", 1_000), ProcessSample(12, "redis-server", 2_000)),
        )


@pytest.mark.unit
def test_collector_exports_every_value_under_its_name():
    values = parse_metrics(exposition(build_registry(FixedProvider())).decode())
    assert values == {
        "furlong_host_cpu_utilization_ratio": 0.25,
        "furlong_host_memory_used_bytes": 3000.0,
        "furlong_host_memory_total_bytes": 8000.0,
        'furlong_host_process_rss_bytes{pid="11",service="trainer"}': 1000.0,
        'furlong_host_process_rss_bytes{pid="12",service="redis-server"}': 2000.0,
        'furlong_gpu_devices{vendor="none"}': 0.0,
    }


def spawn(code: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *extra], stdout=subprocess.PIPE, text=True)


HOLD_64MIB = (
    "b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); print('ready', flush=True); "
    "import time; time.sleep(60)"
)


@pytest.mark.integration
def test_provider_discovers_furlong_processes_and_watches_given_pids():
    child = spawn(HOLD_64MIB, "-m", "furlong.trainer")  # argv looks like a trainer's
    try:
        assert child.stdout.readline().strip() == "ready"
        found = {p.pid: p for p in HostTelemetryProvider().snapshot().processes}
        assert found[child.pid].service == "trainer"
        assert found[child.pid].rss_bytes >= 64 << 20
        watched = HostTelemetryProvider([child.pid]).snapshot()
        assert {p.pid for p in watched.processes} == {child.pid, os.getpid()}
        snap = watched
        assert snap.memory_total_bytes == psutil.virtual_memory().total
        assert 0 < snap.memory_used_bytes < snap.memory_total_bytes
        assert 0.0 <= snap.cpu_utilization_ratio <= 1.0
    finally:
        child.kill()
        child.wait()


@pytest.mark.integration
def test_provider_follows_a_pids_file_rewritten_after_a_restart(tmp_path):
    """The local stack's dashboard reads stack.json at every sample: a service restarted under a
    new pid is reported under it, the old pid no longer."""
    pids_file = tmp_path / "stack.json"
    first = spawn(HOLD_64MIB, "-m", "furlong.trainer")
    second = spawn(HOLD_64MIB, "-m", "furlong.trainer")
    try:
        assert first.stdout.readline().strip() == "ready" and second.stdout.readline().strip() == "ready"
        pids_file.write_text(json.dumps({"processes": [{"name": "trainer", "pid": first.pid}]}))
        provider = HostTelemetryProvider(pids_file=pids_file)
        assert {p.pid for p in provider.snapshot().processes} == {first.pid, os.getpid()}
        first.kill()
        first.wait()
        pids_file.write_text(json.dumps({"processes": [{"name": "trainer", "pid": second.pid}]}))
        found = {p.pid: p for p in provider.snapshot().processes}
        assert set(found) == {second.pid, os.getpid()}
        assert found[second.pid].service == "trainer" and found[second.pid].rss_bytes >= 64 << 20
        pids_file.write_text("{not json")  # caught mid-write: the last list read is kept
        assert {p.pid for p in provider.snapshot().processes} == {second.pid, os.getpid()}
    finally:
        for child in (first, second):
            child.kill()
            child.wait()


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 30.0) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"dashboard exited with {proc.returncode}"
        try:
            return httpx.get(url, timeout=2.0)
        except httpx.TransportError:
            time.sleep(0.05)
    raise AssertionError(f"{url} not up after {timeout_s}s")


@pytest.mark.integration
def test_dashboard_process_serves_metrics_over_http():
    child = spawn(HOLD_64MIB)
    port = free_port()
    dash = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "furlong.dashboard",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--watch-pid",
            str(child.pid),
        ]
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        health = wait_http(f"http://127.0.0.1:{port}/healthz", dash)
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        resp = httpx.get(f"http://127.0.0.1:{port}/metrics", follow_redirects=False)
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
        values = parse_metrics(resp.text)
        total = psutil.virtual_memory().total
        assert values["furlong_host_memory_total_bytes"] == total
        assert 0 < values["furlong_host_memory_used_bytes"] < total
        assert 0.0 <= values["furlong_host_cpu_utilization_ratio"] <= 1.0
        name = psutil.Process(child.pid).name()  # not a Furlong service: labelled by executable
        child_rss = values[f'furlong_host_process_rss_bytes{{pid="{child.pid}",service="{name}"}}']
        assert 64 << 20 <= child_rss <= psutil.Process(child.pid).memory_info().rss * 1.5
        assert f'furlong_host_process_rss_bytes{{pid="{dash.pid}",service="dashboard"}}' in values
    finally:
        for proc in (dash, child):
            proc.terminate()
            proc.wait(10)
