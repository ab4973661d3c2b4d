"""What a service's composition root (`__main__`) holds for the life of its process.

`start(name, flags)` configures logging, creates the process's Prometheus `CollectorRegistry` (the
one every metrics object of the service registers on, and the one its `/metrics` serves, with the
process_* and python_* series; nothing registers on prometheus_client's global registry) and
installs the SIGTERM/SIGINT handlers, before the service builds anything, so a signal during
start-up is not lost. The service then registers its
stop steps on `runtime.shutdown` and ends with `return runtime.serve_until_stopped()`.
"""

from __future__ import annotations

import logging
import threading

from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry

from furlong.service_main.command import ServiceFlags, configure_logging
from furlong.service_main.metrics_endpoint import MetricsEndpoint
from furlong.service_main.shutdown import GracefulShutdown, exit_now

log = logging.getLogger(__name__)

_MIN_EXIT_WINDOW_S = 1.0  # after a clean stop, the interpreter gets at least this long to exit


class ServiceRuntime:
    """The process-wide objects of one service process: flags, registry, shutdown."""

    def __init__(
        self, name: str, flags: ServiceFlags, registry: CollectorRegistry, shutdown: GracefulShutdown
    ) -> None:
        self.name = name
        self.flags = flags
        self.registry = registry
        self.shutdown = shutdown
        self._metrics: MetricsEndpoint | None = None

    def serve_metrics(self) -> MetricsEndpoint:
        """Serve `registry` on --host:--metrics-port until the process stops (closed after every
        stop step, so scrapes still work while the service drains)."""
        if self.flags.metrics_port is None:
            raise RuntimeError(f"{self.name} has no --metrics-port; its app serves /metrics")
        if self._metrics is None:
            self._metrics = MetricsEndpoint(self.registry, self.flags.host, self.flags.metrics_port)
        return self._metrics

    def serve_until_stopped(self) -> int:
        """Block until SIGTERM/SIGINT, run the stop steps within --shutdown-grace-s, and return
        the exit status. Past the deadline the process exits at once, from here; after a clean
        stop a watchdog ends it should the interpreter not exit within what is left (threads a
        library left running)."""
        self.shutdown.wait()
        if self._metrics is not None:
            self.shutdown.add_close("metrics endpoint", self._metrics)
        stopped = self.shutdown.run()
        if not stopped.in_time:
            exit_now(stopped.exit_code)
        window_s = max(_MIN_EXIT_WINDOW_S, stopped.seconds_left)
        watchdog = threading.Timer(window_s, _exit_late, (self.name, window_s, stopped.exit_code))
        watchdog.daemon = True
        watchdog.start()
        return stopped.exit_code


def _exit_late(name: str, window_s: float, code: int) -> None:
    alive = [t.name for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
    log.error(
        "%s: the interpreter did not exit within %.1fs (threads %s); exiting now", name, window_s, alive
    )
    exit_now(code)


def start(name: str, flags: ServiceFlags) -> ServiceRuntime:
    """The runtime of service `name`: logging configured, a fresh registry, signals handled (see
    the module doc). Call once, from the main thread."""
    configure_logging(flags.log_level)
    shutdown = GracefulShutdown(name, flags.shutdown_grace_s).install()
    return ServiceRuntime(name, flags, process_registry(), shutdown)


def process_registry() -> CollectorRegistry:
    """A fresh registry holding the process, platform and GC collectors (process_*, python_*)."""
    registry = CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    return registry
