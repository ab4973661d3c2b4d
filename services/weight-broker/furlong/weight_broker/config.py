"""Configuration of the weight broker service, parsed once at the edge (`__main__`) and validated
here. The transfer endpoints' settings (TransferConfig) live in furlong.transfer.config."""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from furlong.rpc import add_tls_arguments
from furlong.rpc.tls import TlsFiles
from furlong.transfer.config import LANE_NAMES, check_lanes

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _check_port(name: str, port: int) -> None:
    if not 0 <= port <= 65535:
        raise ValueError(f"{name} {port} is not a TCP port (0-65535)")


@dataclass(frozen=True)
class BrokerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0 picks a free port
    metrics_port: int = 0  # Prometheus /metrics; 0 picks a free port
    max_workers: int = 64  # each watch stream and WaitCommitted call holds one while open
    max_ack_attempts: int = 3  # an engine is fenced after this many ok=False acks of a version
    ack_timeout_s: float = 60.0  # an engine that has not acknowledged the current stage is fenced
    relay_runs: tuple[str, ...] = ()  # runs this process relays (trainers publish to <run>~upstream)
    relay_lanes: tuple[str, ...] = LANE_NAMES  # the relays' lanes, in order
    log_level: str = "INFO"
    auth_token_file: str = ""  # "" = gRPC unauthenticated; else the shared service token's file
    tls: TlsFiles = TlsFiles()  # no files = plaintext gRPC; else mutual TLS (furlong.rpc.tls)

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("empty host")
        if not (math.isfinite(self.ack_timeout_s) and self.ack_timeout_s > 0):
            raise ValueError(f"ack_timeout_s {self.ack_timeout_s} is not a finite number > 0")
        if any(not run or run.endswith("~upstream") for run in self.relay_runs) or len(
            set(self.relay_runs)
        ) != len(self.relay_runs):
            raise ValueError(
                f"relay_runs {self.relay_runs!r} must be distinct run ids not ending in '~upstream'"
            )
        check_lanes("relay_lanes", self.relay_lanes)
        _check_port("port", self.port)
        _check_port("metrics_port", self.metrics_port)
        if self.max_workers < 2:
            raise ValueError(f"max_workers {self.max_workers} < 2")
        if self.max_ack_attempts < 1:
            raise ValueError(f"max_ack_attempts {self.max_ack_attempts} < 1")
        if self.log_level not in _LOG_LEVELS:
            raise ValueError(f"log_level {self.log_level!r} not one of {_LOG_LEVELS}")

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> BrokerConfig:
        parser = argparse.ArgumentParser(
            prog="python -m furlong.weight_broker", description="Furlong weight broker (gRPC)"
        )
        parser.add_argument("--host", default=cls.host)
        parser.add_argument("--port", type=int, required=True)
        parser.add_argument("--metrics-port", type=int, required=True)
        parser.add_argument("--max-workers", type=int, default=cls.max_workers)
        parser.add_argument("--max-ack-attempts", type=int, default=cls.max_ack_attempts)
        parser.add_argument("--ack-timeout-s", type=float, default=cls.ack_timeout_s)
        parser.add_argument(
            "--relay-run",
            action="append",
            default=[],
            dest="relay_runs",
            help="hold run RUN's latest version here (repeatable); its trainer publishes to RUN~upstream",
        )
        parser.add_argument(
            "--relay-lanes",
            default=",".join(cls.relay_lanes),
            help="comma-separated lanes a relay pulls over and serves on, in order "
            "(default nixl,shm,grpc; without shm its bucket gets huge pages)",
        )
        parser.add_argument("--log-level", default=cls.log_level, type=str.upper)
        parser.add_argument(
            "--auth-token-file", default="", help="file with the shared token every gRPC call must carry"
        )
        add_tls_arguments(parser)
        args = parser.parse_args(argv)
        try:
            return cls(
                host=args.host,
                port=args.port,
                metrics_port=args.metrics_port,
                max_workers=args.max_workers,
                max_ack_attempts=args.max_ack_attempts,
                ack_timeout_s=args.ack_timeout_s,
                relay_runs=tuple(args.relay_runs),
                relay_lanes=tuple(lane.strip() for lane in args.relay_lanes.split(",")),
                log_level=args.log_level,
                auth_token_file=args.auth_token_file,
                tls=TlsFiles(args.tls_ca_file, args.tls_cert_file, args.tls_key_file, args.tls_server_name),
            )
        except ValueError as exc:
            parser.error(str(exc))  # exits with status 2 and the message

    @property
    def logging_level(self) -> int:
        return int(logging.getLevelName(self.log_level))
