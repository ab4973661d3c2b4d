"""Configuration of the weight broker service, parsed once at the edge (`__main__`) and validated
here. The transfer endpoints' settings (TransferConfig) live in furlong.transfer.config."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass

from furlong.core.weight_versions import LANE_NAMES
from furlong.rpc.service_main import add_credential_flags, credential_fields
from furlong.rpc.tls import TlsFiles
from furlong.service_main import REQUIRED, ServiceCommand, ServiceFlags
from furlong.service_main.ports import check_port
from furlong.transfer.config import check_lanes


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
    auth_token_file: str = ""  # "" = gRPC unauthenticated; else the shared service token's file
    tls: TlsFiles = TlsFiles()  # no files = plaintext gRPC; else mutual TLS (furlong.rpc.tls)
    # Test-only fault injection (furlong.weight_broker.fault_hooks): off unless --enable-fault-hooks;
    # only then does __main__ read the hooks' environment variables.
    fault_hooks: bool = False

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
        check_port("port", self.port)
        check_port("metrics_port", self.metrics_port)
        if self.max_workers < 2:
            raise ValueError(f"max_workers {self.max_workers} < 2")
        if self.max_ack_attempts < 1:
            raise ValueError(f"max_ack_attempts {self.max_ack_attempts} < 1")

    @classmethod
    def command(cls) -> ServiceCommand:
        """The broker's command line: the shared flags and its own."""
        cmd = ServiceCommand(
            "python -m furlong.weight_broker",
            "Furlong weight broker (gRPC)",
            port=REQUIRED,
            metrics_port=REQUIRED,
        )
        parser = cmd.parser
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
            "(default cuda_ipc,nixl,shm,grpc; without shm its bucket gets huge pages)",
        )
        add_credential_flags(parser)
        parser.add_argument(
            "--enable-fault-hooks",
            action="store_true",
            dest="fault_hooks",
            help="TESTS ONLY: install the fault-injection hooks configured by FURLONG_FAULT_* "
            "environment variables (furlong.weight_broker.fault_hooks); off by default, and the "
            "variables are ignored without this flag",
        )
        return cmd

    @classmethod
    def from_namespace(cls, args: argparse.Namespace, flags: ServiceFlags) -> BrokerConfig:
        return cls(
            host=flags.host,
            port=flags.port,
            metrics_port=flags.served_metrics_port,
            max_workers=args.max_workers,
            max_ack_attempts=args.max_ack_attempts,
            ack_timeout_s=args.ack_timeout_s,
            relay_runs=tuple(args.relay_runs),
            relay_lanes=tuple(lane.strip() for lane in args.relay_lanes.split(",")),
            fault_hooks=args.fault_hooks,
            **credential_fields(args),
        )

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> BrokerConfig:
        """The config of a command line (exits with status 2 on a bad value)."""
        return cls.command().parse(argv, cls.from_namespace)[0]
