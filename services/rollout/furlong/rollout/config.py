"""Configuration of the rollout service process, parsed once at the edge (`__main__`) and validated
here."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from furlong.core.devices import parse_device
from furlong.rollout.weight_routes import WEIGHT_ROUTE_AUTO, WEIGHT_ROUTES
from furlong.rpc.service_main import add_credential_flags, credential_fields
from furlong.rpc.tls import TlsFiles
from furlong.service_main import REQUIRED, ServiceCommand, ServiceFlags
from furlong.service_main.ports import check_port

ENGINES_IN_PROCESS = "inprocess"  # engines inside the rollout service (the default)
ENGINES_PROCESS = "process"  # one process per engine behind the engine pool
ENGINE_MODES = (ENGINES_IN_PROCESS, ENGINES_PROCESS)
MAX_REPLICA_ID = 1023  # rollout replicas of one deployment: ids 0 .. MAX_REPLICA_ID


def _user_reward(value: str) -> tuple[str, str]:
    name, sep, reference = value.partition("=")
    if not sep:
        raise ValueError(f"--user-reward {value!r} must be NAME=package.module:function")
    return name, reference


@dataclass(frozen=True)
class RolloutServerConfig:
    redis_url: str
    broker_address: str  # HOST:PORT of the weight broker
    host: str = "127.0.0.1"
    port: int = 0  # 0 picks a free port
    metrics_port: int = 0  # Prometheus /metrics; 0 picks a free port
    num_threads: int = 2  # torch intra-op threads (trainer and rollout alternate on the cores)
    max_batch_size: int = 256  # rows per engine forward pass
    max_workers: int = 8  # concurrent gRPC calls
    max_support_size: int = 0  # largest recorded sampling support; a larger one fails (0 = off)
    user_rewards: tuple[tuple[str, str], ...] = ()  # (name, "package.module:function") pairs
    reward_timeout_s: float = 60.0  # all rewards of one request must finish within this
    reward_workers: int = 4  # threads scoring one request's samples
    auth_token_file: str = ""  # "" = gRPC unauthenticated; else the shared service token's file
    engines: str = ENGINES_IN_PROCESS  # where a run's engines run (ENGINE_MODES)
    engine_threads: int = 1  # process mode: torch threads per engine process
    engine_max_batch_size: int = 64  # process mode: rows per forward pass of an engine process
    chunk_rows: int = 8  # process mode: rows per chunk routed to one engine
    engine_work_dir: str = ""  # process mode: weights and engine logs; "" = under /dev/shm
    tls: TlsFiles = TlsFiles()  # no files = plaintext gRPC; else mutual TLS (furlong.rpc.tls)
    device: str = "cpu"  # where runs' engines run: "cpu", "cuda" or "cuda:N"
    # Where the engines' weight receivers put the versions they receive: "cpu" (host memory) or
    # "cuda" / "cuda:N" (GPU memory: NIXL reads land there, engines load from it on the device;
    # furlong.transfer.destination).
    weight_buffer_device: str = "cpu"
    gateway_port: int | None = None  # the OpenAI-compatible gateway's HTTP port; None = off, 0 = free
    sglang_command: tuple[str, ...] = ()  # starts one SGLang server; () = python -m sglang.launch_server
    sglang_args: tuple[str, ...] = ()  # extra flags for every SGLang server the service launches
    weight_route: str = WEIGHT_ROUTE_AUTO  # how engine processes get versions (weight_routes)
    weight_group_address: str = "127.0.0.1"  # distributed route: this host as engines reach it
    replica_id: int | None = None  # one of several replicas serving the same runs; None = the only one

    def __post_init__(self) -> None:
        try:
            parse_device(self.device)
        except ValueError as exc:
            raise ValueError(f"--device {self.device!r}: {exc}") from None
        try:
            parse_device(self.weight_buffer_device)
        except ValueError as exc:
            raise ValueError(f"--weight-buffer-device {self.weight_buffer_device!r}: {exc}") from None
        if not self.host:
            raise ValueError("host must not be empty")
        check_port("port", self.port)
        check_port("metrics_port", self.metrics_port)
        if self.gateway_port is not None:
            check_port("gateway_port", self.gateway_port)
            if self.gateway_port != 0 and self.gateway_port in (self.port, self.metrics_port):
                raise ValueError(f"gateway_port {self.gateway_port} must differ from port and metrics_port")
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"redis_url must be a redis://, rediss:// or unix:// URL, got {self.redis_url!r}"
            )
        host, sep, port = self.broker_address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"broker_address must be HOST:PORT, got {self.broker_address!r}")
        check_port(f"broker_address {self.broker_address!r}: the port", int(port), allow_zero=False)
        if self.engines not in ENGINE_MODES:
            raise ValueError(f"engines must be one of {ENGINE_MODES}, got {self.engines!r}")
        for name, low in (
            ("num_threads", 1),
            ("max_batch_size", 1),
            ("max_workers", 2),
            ("max_support_size", 0),
            ("engine_threads", 1),
            ("engine_max_batch_size", 1),
            ("chunk_rows", 1),
        ):
            value = getattr(self, name)
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if not self.reward_timeout_s > 0:
            raise ValueError(f"reward_timeout_s must be > 0, got {self.reward_timeout_s}")
        for name in ("sglang_command", "sglang_args"):
            value = getattr(self, name)
            if not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"{name} must hold non-empty strings, got {list(value)!r}")
        if self.weight_route not in WEIGHT_ROUTES:
            raise ValueError(f"weight_route must be one of {list(WEIGHT_ROUTES)}, got {self.weight_route!r}")
        if not self.weight_group_address:
            raise ValueError("weight_group_address must not be empty")
        if self.replica_id is not None and not 0 <= self.replica_id <= MAX_REPLICA_ID:
            raise ValueError(f"--replica-id must be in [0, {MAX_REPLICA_ID}], got {self.replica_id}")
        if self.reward_workers < 1:
            raise ValueError(f"reward_workers must be >= 1, got {self.reward_workers}")
        names = [name for name, _ in self.user_rewards]
        for name, reference in self.user_rewards:
            if not name or ":" not in reference:
                raise ValueError(f"user reward {name!r}={reference!r} must be NAME=package.module:function")
        if len(set(names)) != len(names):
            raise ValueError(f"user reward names repeat: {names}")

    @classmethod
    def command(cls) -> ServiceCommand:
        """The rollout service's command line: the shared flags and its own."""
        cmd = ServiceCommand(
            "python -m furlong.rollout",
            "Furlong rollout service (gRPC)",
            port=REQUIRED,
            metrics_port=REQUIRED,
        )
        parser = cmd.parser
        parser.add_argument("--redis-url", required=True)
        parser.add_argument("--broker", required=True, help="weight broker HOST:PORT")
        parser.add_argument("--num-threads", type=int, default=cls.num_threads)
        parser.add_argument("--max-batch-size", type=int, default=cls.max_batch_size)
        parser.add_argument("--max-workers", type=int, default=cls.max_workers)
        parser.add_argument(
            "--max-support-size",
            type=int,
            default=cls.max_support_size,
            help="fail a request whose sampling support exceeds this (0 = off)",
        )
        parser.add_argument(
            "--user-reward",
            action="append",
            default=[],
            metavar="NAME=MODULE:FN",
            help="register a reward callable fn(response_text, answer) -> float "
            "under NAME (repeatable); resolved and checked at start-up",
        )
        parser.add_argument("--reward-timeout-s", type=float, default=cls.reward_timeout_s)
        parser.add_argument("--reward-workers", type=int, default=cls.reward_workers)
        parser.add_argument(
            "--gateway-port",
            type=int,
            default=None,
            help="also serve the OpenAI-compatible gateway over the runs' engines on this HTTP port "
            "(0 = any free port; default: no gateway)",
        )
        parser.add_argument(
            "--replica-id",
            type=int,
            default=None,
            help="this service is replica K of several serving the same runs (the controller "
            "spreads each step over them): its engines are named <run>-rK-engine-<i> "
            "(default: the only replica, engines <run>-engine-<i>)",
        )
        add_credential_flags(parser)
        parser.add_argument(
            "--engines",
            default=cls.engines,
            choices=ENGINE_MODES,
            help="run engines inside this process (inprocess) or as one process "
            "per engine behind a pool that restarts them (process)",
        )
        parser.add_argument(
            "--device",
            default=cls.device,
            help="where runs' engines run: cpu, cuda or cuda:N (default cpu); a run's precision "
            "(run spec) sets their dtype",
        )
        parser.add_argument(
            "--weight-buffer-device",
            default=cls.weight_buffer_device,
            help="where the weight receivers' buffers live: cpu (default: host memory) or cuda / "
            "cuda:N (GPU memory: NIXL reads land there and engines load each version from it on "
            "the device)",
        )
        parser.add_argument(
            "--sglang-command",
            default="",
            help="runs with rollout.engine sglang: the command that starts one SGLang server, split "
            "like a shell would (default: this Python's -m sglang.launch_server); the pool appends "
            "--model-path, --host, --port, --skip-tokenizer-init, --enable-deterministic-inference "
            "and --dtype",
        )
        parser.add_argument(
            "--sglang-arg",
            action="append",
            default=[],
            metavar="ARG",
            help="one more argument for every SGLang server launched (repeatable), e.g. "
            "--sglang-arg=--mem-fraction-static --sglang-arg=0.8",
        )
        parser.add_argument(
            "--weight-route",
            default=cls.weight_route,
            choices=WEIGHT_ROUTES,
            help="how engine processes receive each policy version: auto (SGLang on a GPU: tensor "
            "for launched servers, distributed for attached ones; else disk), disk, tensor or "
            "distributed",
        )
        parser.add_argument(
            "--weight-group-address",
            default=cls.weight_group_address,
            help="distributed route: this host's address as the engines reach it (default 127.0.0.1)",
        )
        parser.add_argument("--engine-threads", type=int, default=cls.engine_threads)
        parser.add_argument("--engine-max-batch-size", type=int, default=cls.engine_max_batch_size)
        parser.add_argument("--chunk-rows", type=int, default=cls.chunk_rows)
        parser.add_argument(
            "--engine-work-dir",
            default=cls.engine_work_dir,
            help="process mode: folder for weight versions and engine logs (default: under /dev/shm)",
        )
        return cmd

    @classmethod
    def from_namespace(cls, args: argparse.Namespace, flags: ServiceFlags) -> RolloutServerConfig:
        return cls(
            redis_url=args.redis_url,
            broker_address=args.broker,
            host=flags.host,
            port=flags.port,
            metrics_port=flags.served_metrics_port,
            num_threads=args.num_threads,
            max_batch_size=args.max_batch_size,
            max_workers=args.max_workers,
            max_support_size=args.max_support_size,
            user_rewards=tuple(_user_reward(v) for v in args.user_reward),
            reward_timeout_s=args.reward_timeout_s,
            reward_workers=args.reward_workers,
            engines=args.engines,
            engine_threads=args.engine_threads,
            engine_max_batch_size=args.engine_max_batch_size,
            chunk_rows=args.chunk_rows,
            engine_work_dir=args.engine_work_dir,
            device=args.device,
            weight_buffer_device=args.weight_buffer_device,
            gateway_port=args.gateway_port,
            replica_id=args.replica_id,
            sglang_command=tuple(shlex.split(args.sglang_command)),
            sglang_args=tuple(args.sglang_arg),
            weight_route=args.weight_route,
            weight_group_address=args.weight_group_address,
            **credential_fields(args),
        )

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> RolloutServerConfig:
        """The config of a command line (exits with status 2 on a bad value)."""
        return cls.command().parse(argv, cls.from_namespace)[0]
