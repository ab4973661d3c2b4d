"""Each of the five services as a real process, with the arguments the local stack gives it: it
serves (health, and /metrics from the scaffold's registry), and on SIGTERM (SIGINT for one) it logs
its shutdown and exits 0 within --shutdown-grace-s. The weight broker started with a fault
variable but without --enable-fault-hooks runs without the hook."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from polling import wait_until

from furlong import rpc
from furlong.service_main.ports import free_port
from furlong.weight_broker.fault_hooks import DROP_BUCKET_ENV

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GRACE_S = 5.0
EXIT_MARGIN_S = 3.0  # the interpreter's own exit after the last stop step
GRPC_NAMES = {
    "trainer": "furlong.v1.Trainer",
    "rollout": "furlong.v1.Rollout",
    "weight_broker": "furlong.v1.WeightBroker",
}
LOG_NAMES = {"weight_broker": "weight-broker"}  # the name a service logs under
SERVICE_METRIC = {  # one metric each service's /metrics must hold from the start
    "trainer": "furlong_trainer_step_seconds",
    "rollout": "furlong_rollout_generate_seconds",
    "weight_broker": "furlong_broker_commit_latency_seconds",
    "controller": "furlong_controller_active_runs",
    "dashboard": "furlong_host_cpu_utilization_ratio",
}


def argv_of(service: str, port: int, metrics_port: int, redis_url: str, tmp_path: Path) -> list[str]:
    """The service's command line, as `furlong.controller.local_stack` builds it (peers that are
    not running are fine: nobody calls them during this test)."""
    peer = f"127.0.0.1:{free_port()}"
    common = ["--host", "127.0.0.1", "--port", str(port), "--shutdown-grace-s", str(GRACE_S)]
    if service in GRPC_NAMES:
        common += ["--metrics-port", str(metrics_port)]
    if service in ("trainer", "rollout"):
        common += ["--redis-url", redis_url, "--broker", peer, "--num-threads", "1"]
    if service == "trainer":
        common += ["--checkpoint-dir", str(tmp_path / "checkpoints")]
    if service == "controller":
        token = tmp_path / "token"
        token.write_text("admin-token-0123456789abcdef\n")
        common += ["--redis-url", redis_url, "--trainer", peer, "--rollout", peer, "--broker", peer]
        common += ["--token-file", str(token)]
    if service == "dashboard":
        common += ["--gpu-backend", "none"]
    return [sys.executable, "-m", f"furlong.{service}", *common]


def metrics_text(service: str, port: int, metrics_port: int) -> str:
    where = metrics_port if service in GRPC_NAMES else port
    return httpx.get(f"http://127.0.0.1:{where}/metrics", timeout=5).text


def healthy(service: str, port: int) -> bool:
    if service in GRPC_NAMES:
        return rpc.check_health(f"127.0.0.1:{port}", GRPC_NAMES[service], timeout_s=1.0)
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def start(service: str, tmp_path: Path, redis_url: str, env: dict[str, str] | None = None):
    port, metrics_port = free_port(), free_port()
    log_path = tmp_path / f"{service}.log"
    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            argv_of(service, port, metrics_port, redis_url, tmp_path),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )

    def serving() -> bool:
        assert proc.poll() is None, f"{service} exited with {proc.returncode}:\n{log_path.read_text()}"
        return healthy(service, port)

    try:
        wait_until(serving, timeout_s=120, what=f"{service} healthy", interval_s=0.1)
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    return proc, port, metrics_port, log_path


def stop(proc: subprocess.Popen, signum: int) -> float:
    """Send signum; the seconds the process took to exit."""
    sent = time.monotonic()
    proc.send_signal(signum)
    try:
        proc.wait(timeout=GRACE_S + EXIT_MARGIN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise AssertionError(f"still running {GRACE_S + EXIT_MARGIN_S}s after the signal") from None
    return time.monotonic() - sent


@pytest.mark.parametrize(
    "service,signum",
    [
        ("trainer", signal.SIGTERM),
        ("rollout", signal.SIGTERM),
        ("weight_broker", signal.SIGTERM),
        ("weight_broker", signal.SIGINT),
        ("controller", signal.SIGTERM),
        ("dashboard", signal.SIGTERM),
    ],
)
def test_service_serves_and_stops_cleanly_on_a_signal(service, signum, tmp_path, redis_url):
    proc, port, metrics_port, log_path = start(service, tmp_path, redis_url)
    try:
        text = metrics_text(service, port, metrics_port)
        assert f"# TYPE {SERVICE_METRIC[service]} " in text, text[:2000]
        assert "process_resident_memory_bytes" in text  # the scaffold's registry, served as a whole
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    took_s = stop(proc, signum)
    log = log_path.read_text()
    assert proc.returncode == 0, log
    assert took_s < GRACE_S + EXIT_MARGIN_S
    name = LOG_NAMES.get(service, service)
    assert f"{name} shutting down ({signal.Signals(signum).name})" in log, log
    assert f"{name} stopped cleanly" in log, log
    assert "Traceback" not in log, log


def test_broker_without_the_flag_ignores_its_fault_variable(tmp_path, redis_url):
    proc, port, metrics_port, log_path = start(
        "weight_broker", tmp_path, redis_url, env={DROP_BUCKET_ENV: "2:0"}
    )
    stop(proc, signal.SIGTERM)
    log = log_path.read_text()
    assert proc.returncode == 0, log
    assert f"fault hooks are off (no --enable-fault-hooks): ignoring {DROP_BUCKET_ENV}" in log
    assert "fault injection enabled" not in log and "fault hooks enabled" not in log
