"""A service's command line: its own argparse parser, with the flags every Furlong service process
shares added and validated here, once.

Shared flags: `--host`, `--port`, `--metrics-port` (only services with a metrics endpoint of their
own; the HTTP services serve `/metrics` on `--port`), `--log-level` and `--shutdown-grace-s`. A bad
value ends the process like any argparse error: the usage line, one line naming the flag, status 2.
The same goes for a `ValueError` raised while the service builds its config from the parsed
arguments (`ServiceCommand.parse`, `ServiceCommand.check`).

The gRPC credential flags are added by `furlong.rpc.service_main` (this package knows nothing
about gRPC: the dashboard uses it too).
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn, TypeVar

from furlong.service_main.ports import check_port

C = TypeVar("C")
T = TypeVar("T")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_SHUTDOWN_GRACE_S = 10.0  # well inside Kubernetes' default terminationGracePeriodSeconds (30)
MAX_SHUTDOWN_GRACE_S = 3600.0


@dataclass(frozen=True)
class ServiceFlags:
    """The shared flags of one service process, validated (ValueError naming the flag)."""

    host: str = DEFAULT_HOST
    port: int = 0  # 0 = any free port (the service logs the one it got)
    metrics_port: int | None = None  # None: no metrics endpoint of its own; 0 = any free port
    log_level: str = "INFO"
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S

    @property
    def served_metrics_port(self) -> int:
        """metrics_port of a service that has one (ValueError for a service without)."""
        if self.metrics_port is None:
            raise ValueError("this service has no --metrics-port")
        return self.metrics_port

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host or any(c.isspace() for c in self.host):
            raise ValueError(f"--host must be a host name or address, got {self.host!r}")
        check_port("--port", self.port)
        if self.metrics_port is not None:
            check_port("--metrics-port", self.metrics_port)
            if self.metrics_port != 0 and self.metrics_port == self.port:
                raise ValueError(f"--metrics-port must differ from --port, both are {self.port}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        grace = self.shutdown_grace_s
        if (
            isinstance(grace, bool)
            or not isinstance(grace, (int, float))
            or not math.isfinite(grace)
            or not 0 < grace <= MAX_SHUTDOWN_GRACE_S
        ):
            raise ValueError(
                f"--shutdown-grace-s must be a number of seconds in (0, {MAX_SHUTDOWN_GRACE_S:g}], "
                f"got {grace!r}"
            )


@dataclass(frozen=True)
class PortOption:
    """How a service declares `--port` or `--metrics-port`: required (default None) or with a
    default (0 = any free port)."""

    default: int | None = None
    help: str = ""


REQUIRED = PortOption()


class ServiceCommand:
    """The command line of one service. `parser` is the service's argparse parser: the service adds
    its own flags to it, then calls `parse`."""

    def __init__(
        self,
        prog: str,
        description: str | None,
        port: PortOption = REQUIRED,
        metrics_port: PortOption | None = None,
        formatter_class: type[argparse.HelpFormatter] = argparse.HelpFormatter,
    ) -> None:
        self.parser = argparse.ArgumentParser(
            prog=prog, description=description, formatter_class=formatter_class
        )
        self._has_metrics_port = metrics_port is not None
        shared = self.parser.add_argument_group("service process (shared by every Furlong service)")
        shared.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (default %(default)s)")
        _add_port(shared, "--port", port, "port to serve on")
        if metrics_port is not None:
            _add_port(shared, "--metrics-port", metrics_port, "port of the Prometheus /metrics endpoint")
        shared.add_argument(
            "--log-level",
            default="INFO",
            type=str.upper,
            choices=LOG_LEVELS,
            help="logging level (default %(default)s)",
        )
        shared.add_argument(
            "--shutdown-grace-s",
            type=float,
            default=DEFAULT_SHUTDOWN_GRACE_S,
            help="on SIGTERM/SIGINT: seconds in-flight work may take to drain before the process "
            "exits anyway (default %(default)s)",
        )

    def parse(
        self, argv: Sequence[str] | None, build: Callable[[argparse.Namespace, ServiceFlags], C]
    ) -> tuple[C, ServiceFlags]:
        """Parse argv, validate the shared flags, and build the service's config with
        `build(args, flags)`; any bad value exits with status 2 (see the module doc)."""
        args = self.parser.parse_args(argv)
        flags = self.check(lambda: self.flags(args))
        return self.check(lambda: build(args, flags)), flags

    def flags(self, args: argparse.Namespace) -> ServiceFlags:
        """The shared flags of parsed arguments; ValueError naming the flag."""
        return ServiceFlags(
            host=args.host,
            port=args.port,
            metrics_port=args.metrics_port if self._has_metrics_port else None,
            log_level=args.log_level,
            shutdown_grace_s=args.shutdown_grace_s,
        )

    def check(self, make: Callable[[], T]) -> T:
        """make(), or exit like argparse (status 2) with the message of the ValueError it raised."""
        try:
            return make()
        except ValueError as exc:
            self.error(str(exc))

    def error(self, message: str) -> NoReturn:
        self.parser.error(message)


def _add_port(group: argparse._ArgumentGroup, flag: str, option: PortOption, what: str) -> None:
    required = option.default is None
    default = "" if required else f" (default {option.default}; 0 = any free port)"
    group.add_argument(
        flag,
        type=int,
        required=required,
        default=option.default,
        help=option.help or f"{what}{default}",
    )


def configure_logging(level: str) -> None:
    """Log records of every logger to stderr in the services' one format, at `level` (one of
    LOG_LEVELS). Called once, by the scaffold, before anything is logged."""
    logging.basicConfig(level=level, format=LOG_FORMAT, force=True)
