"""`python -m furlong.dashboard`: host and GPU telemetry for Prometheus on /metrics, /healthz, and
the web UI on / (runs from the controller's REST API when --controller-url is given).

    python -m furlong.dashboard --host 127.0.0.1 --port P [--watch-pid PID ...]
        [--gpu-backend auto|nvml|amdsmi|none] [--hostname NAME]
        [--controller-url URL --controller-token-file PATH] [--sample-interval-s 2]
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from pathlib import Path

import uvicorn

from furlong.dashboard.app import create_app
from furlong.dashboard.config import GPU_BACKEND_CHOICES, DashboardConfig
from furlong.dashboard.exporter import build_registry
from furlong.dashboard.gpu_providers import GpuTelemetryUnavailable, open_gpu_telemetry
from furlong.dashboard.host_provider import HostTelemetryProvider, service_of_pid
from furlong.dashboard.run_source import ControllerRuns
from furlong.dashboard.telemetry_history import TelemetryHistory

log = logging.getLogger("furlong.dashboard")


def parse_config(argv: list[str] | None) -> tuple[DashboardConfig, str]:
    p = argparse.ArgumentParser(
        prog="python -m furlong.dashboard",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument(
        "--watch-pid",
        type=int,
        action="append",
        default=[],
        metavar="PID",
        help="report this process's memory (repeatable; default: every Furlong process)",
    )
    p.add_argument(
        "--gpu-backend",
        choices=GPU_BACKEND_CHOICES,
        default="auto",
        help="auto: NVML, then AMD SMI, then host only; an explicit backend must work",
    )
    p.add_argument("--hostname", default=None, help="Hostname label of GPU series (default: this host)")
    p.add_argument("--controller-url", default="", help="controller REST API for the web UI's runs")
    p.add_argument(
        "--controller-token-file", default=None, type=Path, help="file holding the controller's bearer token"
    )
    p.add_argument(
        "--sample-interval-s", type=float, default=2.0, help="utilisation history tick of the web UI"
    )
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    token = ""
    if args.controller_token_file is not None:
        try:
            token = args.controller_token_file.read_text().strip()
        except OSError as exc:
            raise ValueError(f"controller token file {args.controller_token_file}: {exc}") from exc
    config = DashboardConfig(
        host=args.host,
        port=args.port,
        watch_pids=tuple(args.watch_pid),
        gpu_backend=args.gpu_backend,
        hostname=args.hostname or socket.gethostname(),
        controller_url=args.controller_url,
        controller_token=token,
        sample_interval_s=args.sample_interval_s,
    )
    return config, args.log_level


def main(argv: list[str] | None = None) -> int:
    try:
        config, log_level = parse_config(argv)
    except ValueError as exc:
        logging.basicConfig()
        log.error("%s", exc)
        return 2
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        gpu = open_gpu_telemetry(config.gpu_backend)
    except GpuTelemetryUnavailable as exc:
        log.error("%s", exc)
        return 2
    runs = ControllerRuns(config.controller_url, config.controller_token) if config.controller_url else None
    history = TelemetryHistory(gpu, config.sample_interval_s)
    try:
        registry = build_registry(
            HostTelemetryProvider(config.watch_pids), gpu, config.hostname, service_of_pid
        )
        app = create_app(registry, runs, history.lanes)
        history.tick()
        history.start()
        log.info(
            "serving telemetry on http://%s:%d/metrics and the web UI on / (watching %s, "
            "%d GPU(s), runs from %s)",
            config.host,
            config.port,
            list(config.watch_pids) or "every Furlong process",
            len(gpu.devices) if gpu else 0,
            config.controller_url or "nowhere",
        )
        uvicorn.Server(
            uvicorn.Config(
                app, host=config.host, port=config.port, log_level="warning", access_log=False, lifespan="off"
            )
        ).run()
    finally:
        history.stop()
        if runs is not None:
            runs.close()
        if gpu is not None:
            gpu.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
