"""The start-up scaffold every Furlong service's `__main__` uses (trainer, rollout, weight broker,
dashboard, controller), so that their processes parse, log, export metrics and stop the same way.

    command = ServiceCommand(prog, description, port=..., metrics_port=...)   # shared flags added
    ...the service adds its own flags to command.parser...
    config, flags = command.parse(argv, build)     # bad value: usage + one line naming it, exit 2
    runtime = start("trainer", flags)              # logging, CollectorRegistry, SIGTERM/SIGINT
    ...build the service with runtime.registry, start serving...
    runtime.serve_metrics()                        # services with --metrics-port
    runtime.shutdown.add("gRPC server", lambda left_s: server.stop(grace_s=left_s))
    runtime.shutdown.add_close("Redis client", redis_client)
    return runtime.serve_until_stopped()           # drain within --shutdown-grace-s, exit status

Modules: `command` (ServiceCommand, ServiceFlags, configure_logging), `runtime` (start,
ServiceRuntime), `shutdown` (GracefulShutdown), `metrics_endpoint` (MetricsEndpoint), `ports`
(check_port, free_port) and `http_server` (HttpServer: uvicorn on a background thread; imported on
its own so that services without HTTP never import uvicorn). gRPC's shared flags (token, mutual
TLS) are added by `furlong.rpc.service_main`; this package knows nothing about gRPC.
"""

from furlong.service_main.command import (
    DEFAULT_SHUTDOWN_GRACE_S,
    LOG_LEVELS,
    REQUIRED,
    PortOption,
    ServiceCommand,
    ServiceFlags,
    configure_logging,
)
from furlong.service_main.metrics_endpoint import MetricsEndpoint
from furlong.service_main.ports import check_port, free_port
from furlong.service_main.runtime import ServiceRuntime, start
from furlong.service_main.shutdown import GracefulShutdown, Stopped

__all__ = [
    "DEFAULT_SHUTDOWN_GRACE_S",
    "LOG_LEVELS",
    "REQUIRED",
    "GracefulShutdown",
    "MetricsEndpoint",
    "PortOption",
    "ServiceCommand",
    "ServiceFlags",
    "ServiceRuntime",
    "Stopped",
    "check_port",
    "configure_logging",
    "free_port",
    "start",
]
