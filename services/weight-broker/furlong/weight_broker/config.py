"""Configuration of the weight broker service and of the NIXL transfer endpoints, parsed once at the
edge (`__main__`, or the process that builds a publisher/receiver) and validated here."""

from __future__ import annotations

import argparse
import logging
import math
from dataclasses import dataclass
from typing import Sequence

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _check_port(name: str, port: int) -> None:
    if not 0 <= port <= 65535:
        raise ValueError(f"{name} {port} is not a TCP port (0-65535)")


@dataclass(frozen=True)
class BrokerConfig:
    host: str = "127.0.0.1"
    port: int = 0                 # 0 picks a free port
    metrics_port: int = 0         # Prometheus /metrics; 0 picks a free port
    max_workers: int = 64         # each watch stream and WaitCommitted call holds one while open
    max_ack_attempts: int = 3     # a version fails after this many ok=False acks from one engine
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("empty host")
        _check_port("port", self.port)
        _check_port("metrics_port", self.metrics_port)
        if self.max_workers < 2:
            raise ValueError(f"max_workers {self.max_workers} < 2")
        if self.max_ack_attempts < 1:
            raise ValueError(f"max_ack_attempts {self.max_ack_attempts} < 1")
        if self.log_level not in _LOG_LEVELS:
            raise ValueError(f"log_level {self.log_level!r} not one of {_LOG_LEVELS}")

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> "BrokerConfig":
        parser = argparse.ArgumentParser(prog="python -m furlong.weight_broker",
                                         description="Furlong weight broker (gRPC)")
        parser.add_argument("--host", default=cls.host)
        parser.add_argument("--port", type=int, required=True)
        parser.add_argument("--metrics-port", type=int, required=True)
        parser.add_argument("--max-workers", type=int, default=cls.max_workers)
        parser.add_argument("--max-ack-attempts", type=int, default=cls.max_ack_attempts)
        parser.add_argument("--log-level", default=cls.log_level, type=str.upper)
        args = parser.parse_args(argv)
        try:
            return cls(host=args.host, port=args.port, metrics_port=args.metrics_port,
                       max_workers=args.max_workers, max_ack_attempts=args.max_ack_attempts,
                       log_level=args.log_level)
        except ValueError as exc:
            parser.error(str(exc))   # exits with status 2 and the message

    @property
    def logging_level(self) -> int:
        return logging.getLevelName(self.log_level)


@dataclass(frozen=True)
class TransferConfig:
    """How a publisher or receiver drives NIXL."""

    backends: tuple[str, ...] = ("UCX",)
    transfer_timeout_s: float = 60.0   # one READ of a whole version
    rpc_retry_s: float = 1.0           # pause before re-registering after the broker went away

    def __post_init__(self) -> None:
        if not self.backends or any(not b for b in self.backends):
            raise ValueError(f"backends {self.backends!r} must name at least one NIXL backend")
        for name in ("transfer_timeout_s", "rpc_retry_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} {value} is not a finite number > 0")
