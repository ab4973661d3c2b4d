"""`python -m furlong.dashboard`: host and GPU telemetry for Prometheus on /metrics, /healthz, and
the web UI on / (runs from the controller's REST API when --controller-url is given).

    python -m furlong.dashboard --host 127.0.0.1 --port P [--watch-pid PID ...] [--watch-pids-from FILE]
        [--gpu-backend auto|nvml|amdsmi|none] [--hostname NAME]
        [--controller-url URL --controller-token-file PATH] [--sample-interval-s 2]
        [--log-level INFO] [--shutdown-grace-s 10]

On SIGTERM or SIGINT it stops accepting connections, lets the requests in flight finish within
--shutdown-grace-s, stops sampling and exits (`furlong.service_main`).
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from furlong.dashboard.app import create_app
from furlong.dashboard.config import GPU_BACKEND_CHOICES, DashboardConfig
from furlong.dashboard.exporter import register_telemetry
from furlong.dashboard.gpu_providers import GpuTelemetryUnavailable, open_gpu_telemetry
from furlong.dashboard.host_provider import HostTelemetryProvider, service_of_pid
from furlong.dashboard.run_source import ControllerRuns
from furlong.dashboard.telemetry_history import TelemetryHistory
from furlong.service_main import REQUIRED, ServiceCommand, ServiceFlags, start
from furlong.service_main.http_server import HttpServer

log = logging.getLogger("furlong.dashboard")


def command() -> ServiceCommand:
    """The dashboard's command line: the shared flags (no --metrics-port: /metrics is on --port)
    and its own."""
    cmd = ServiceCommand(
        "python -m furlong.dashboard",
        __doc__,
        port=REQUIRED,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p = cmd.parser
    p.add_argument(
        "--watch-pid",
        type=int,
        action="append",
        default=[],
        metavar="PID",
        help="report this process's memory (repeatable; default: every Furlong process)",
    )
    p.add_argument(
        "--watch-pids-from",
        type=Path,
        default=None,
        metavar="FILE",
        help="also report the processes a JSON file lists (`processes: [{pid}]`, e.g. a local "
        "stack's stack.json), read again at every sample so restarted services keep being reported",
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
    return cmd


def _config(args: argparse.Namespace, flags: ServiceFlags) -> DashboardConfig:
    token = ""
    if args.controller_token_file is not None:
        try:
            token = args.controller_token_file.read_text().strip()
        except OSError as exc:
            raise ValueError(f"--controller-token-file {args.controller_token_file}: {exc}") from exc
    return DashboardConfig(
        host=flags.host,
        port=flags.port,
        watch_pids=tuple(args.watch_pid),
        watch_pids_file=args.watch_pids_from,
        gpu_backend=args.gpu_backend,
        hostname=args.hostname or socket.gethostname(),
        controller_url=args.controller_url,
        controller_token=token,
        sample_interval_s=args.sample_interval_s,
    )


def parse_config(argv: Sequence[str] | None = None) -> DashboardConfig:
    """The dashboard's config from a command line (exits with status 2 on a bad value)."""
    return command().parse(argv, _config)[0]


def main(argv: Sequence[str] | None = None) -> int:
    cmd = command()
    config, flags = cmd.parse(argv, _config)
    runtime = start("dashboard", flags)
    try:
        gpu = open_gpu_telemetry(config.gpu_backend)
    except GpuTelemetryUnavailable as exc:
        log.error("%s", exc)
        return 2
    runs = ControllerRuns(config.controller_url, config.controller_token) if config.controller_url else None
    history = TelemetryHistory(gpu, config.sample_interval_s)
    register_telemetry(
        runtime.registry,
        HostTelemetryProvider(config.watch_pids, config.watch_pids_file),
        gpu,
        config.hostname,
        service_of_pid,
    )
    http = HttpServer(create_app(runtime.registry, runs, history.lanes), config.host, config.port)
    runtime.shutdown.add("HTTP server", http.stop)
    runtime.shutdown.probe("HTTP requests in flight", http.still_running)
    runtime.shutdown.add("telemetry history", lambda _left_s: history.stop())
    if runs is not None:
        runtime.shutdown.add_close("controller client", runs)
    if gpu is not None:
        runtime.shutdown.add_close("GPU telemetry", gpu)
    history.tick()
    history.start()
    http.start()
    log.info(
        "serving telemetry on %s/metrics and the web UI on / (watching %s, %d GPU(s), runs from %s)",
        http.url,
        (
            f"{list(config.watch_pids)} and the pids in {config.watch_pids_file}"
            if config.watch_pids_file
            else list(config.watch_pids) or "every Furlong process"
        ),
        len(gpu.devices) if gpu else 0,
        config.controller_url or "nowhere",
    )
    return runtime.serve_until_stopped()


if __name__ == "__main__":
    sys.exit(main())
