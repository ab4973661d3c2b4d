"""What a local stack is made of: which services start, their flags, timeouts and restart policy.

A frozen dataclass checked once; `to_dict` / `from_dict` carry it to the stack's supervisor
process (as `STATE_DIR/stack-config.json`). Knows nothing about processes.
"""

from __future__ import annotations

import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from furlong.controller.config import check_address
from furlong.controller.restart_policy import RestartPolicy
from furlong.controller.services import BROKER_SERVICE, ROLLOUT_SERVICE, TRAINER_SERVICE
from furlong.core.settings.trainer import MAX_WORLD_SIZE

SERVICES = ("redis", "weight_broker", "trainer", "rollout", "controller", "dashboard")
GRPC_SERVICES = {"weight_broker": BROKER_SERVICE, "trainer": TRAINER_SERVICE, "rollout": ROLLOUT_SERVICE}
MAX_ROLLOUT_REPLICAS = 16


def service_kind(name: str) -> str:
    """Which service a stack process runs: rollout replica k > 0 is named `rollout-<k>`."""
    return "rollout" if name.startswith("rollout-") else name


@dataclass(frozen=True)
class StackConfig:
    state_dir: Path
    services: tuple[str, ...] = SERVICES  # which to start here
    external: tuple[tuple[str, str], ...] = ()  # (gRPC service, host:port) used instead of starting it
    python: str = sys.executable
    ready_timeout_s: float = 180.0
    stop_timeout_s: float = 15.0
    # torch intra-op threads of trainer and rollout. The synchronous loop runs them one after the
    # other, and for small models one thread each avoids oversubscribing the cores.
    torch_threads: int = 1
    device: str = "cpu"  # torch device of the trainer and the rollout engines: cpu, cuda, cuda:N
    # the trainer's ranks: more than 1 starts it under torchrun (`--nproc-per-node`), and runs
    # then need trainer.parallel.world_size equal to it
    trainer_ranks: int = 1
    # rollout service replicas serving every run (the controller spreads each step over them):
    # more than 1 starts rollout, rollout-1, ... with --replica-id 0, 1, ...
    rollout_replicas: int = 1
    # an engine that has not acknowledged a version's current stage within this is fenced out of it
    broker_ack_timeout_s: float = 60.0
    # fault tests only: start the broker with --enable-fault-hooks (furlong.weight_broker.fault_hooks)
    # and give each service the environment in STATE_DIR/fault-env/<service>.json at every start
    broker_fault_hooks: bool = False
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    redis_binary: str = ""  # "" = the one recorded for the state dir, else found (redis_binary)
    # the supervisor ends with the process that started it (`furlong run`); else it stays (`up`)
    owned: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.services) - set(SERVICES)
        if unknown:
            raise ValueError(f"services: unknown {sorted(unknown)}; known {list(SERVICES)}")
        for required in ("redis", "controller"):
            if required not in self.services:
                raise ValueError(f"services must include {required!r}, got {list(self.services)}")
        external = dict(self.external)
        for name, address in external.items():
            if name not in GRPC_SERVICES:
                raise ValueError(f"external: {name!r} is not one of {list(GRPC_SERVICES)}")
            check_address(f"external {name}", address)
        for name in GRPC_SERVICES:
            if (name in self.services) == (name in external):
                raise ValueError(
                    f"{name} must be either started or external, not "
                    f"{'both' if name in external else 'neither'}"
                )
        if not isinstance(self.trainer_ranks, int) or not 1 <= self.trainer_ranks <= MAX_WORLD_SIZE:
            raise ValueError(
                f"trainer_ranks must be an integer in [1, {MAX_WORLD_SIZE}], got {self.trainer_ranks!r}"
            )
        replicas = self.rollout_replicas
        if not isinstance(replicas, int) or not 1 <= replicas <= MAX_ROLLOUT_REPLICAS:
            raise ValueError(
                f"rollout_replicas must be an integer in [1, {MAX_ROLLOUT_REPLICAS}], "
                f"got {self.rollout_replicas!r}"
            )
        if self.rollout_replicas > 1 and "rollout" not in self.services:
            raise ValueError("rollout_replicas > 1 needs rollout among the services the stack starts")
        if self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {self.torch_threads}")
        if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", self.device):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not self.broker_ack_timeout_s > 0:
            raise ValueError(f"broker_ack_timeout_s must be > 0, got {self.broker_ack_timeout_s}")
        if self.ready_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise ValueError(
                f"timeouts must be positive, got ready_timeout_s={self.ready_timeout_s}, "
                f"stop_timeout_s={self.stop_timeout_s}"
            )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["state_dir"] = str(self.state_dir)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StackConfig:
        return cls(
            **{
                **data,
                "state_dir": Path(data["state_dir"]),
                "services": tuple(data["services"]),
                "external": tuple((str(n), str(a)) for n, a in data["external"]),
                "restart": RestartPolicy(**data["restart"]),
            }
        )
