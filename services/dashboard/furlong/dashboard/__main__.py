"""`python -m furlong.dashboard`: host telemetry for Prometheus on /metrics, plus /healthz."""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from furlong.dashboard.app import create_app
from furlong.dashboard.config import DashboardConfig
from furlong.dashboard.exporter import build_registry
from furlong.dashboard.host_provider import HostTelemetryProvider

log = logging.getLogger("furlong.dashboard")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m furlong.dashboard", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--watch-pid", type=int, action="append", default=[], metavar="PID",
                   help="report this process's memory (repeatable; default: every Furlong process)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = DashboardConfig(host=args.host, port=args.port, watch_pids=tuple(args.watch_pid))
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    provider = HostTelemetryProvider(config.watch_pids)
    app = create_app(build_registry(provider))
    log.info("serving host telemetry on http://%s:%d/metrics (watching %s)", config.host,
             config.port, list(config.watch_pids) or "every Furlong process")
    uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                  access_log=False, lifespan="off")).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
