"""`STATE_DIR/stack.json`, the record of a local stack, and the one answer to "does a stack run here?".

The stack's supervisor writes the record as processes start (`ready` false until all are healthy)
and after every restart; it is the only writer while the stack runs. `stack_status` reads it and
checks every recorded pid (with its creation time, so a reused pid does not count) and says what
the state directory holds: nothing, a stack starting, running, restarting a service, broken (a
service is down for good, or its supervisor is gone), or stale (every process exited: a crash, a
reboot). `furlong up`, `down`, `run` and `runs` all ask it, so they agree, and each not-running
state comes with the one command that fixes it (`StackStatus.fix`).
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from furlong.controller.stack_processes import ServiceProcess, is_running

STACK_FILE = "stack.json"


@dataclass(frozen=True)
class StackInfo:
    state_dir: str
    rest_url: str
    token_file: str
    redis_url: str
    addresses: dict[str, str]  # gRPC service name -> host:port (started or external)
    processes: tuple[ServiceProcess, ...]
    started_at: float
    ready: bool = False
    dashboard_url: str = ""
    gateway_url: str = ""  # rollout's OpenAI-compatible gateway, its base URL (ends in /v1)
    viewer_token_file: str = ""
    internal_token_file: str = ""
    supervisor: ServiceProcess | None = None  # the process that started and restarts the others
    owned: bool = False  # the supervisor ends with the command that started it (`furlong run`)
    given_up: dict[str, str] = field(default_factory=dict)  # service -> why it is not restarted
    restarting: tuple[str, ...] = ()  # services that exited and are not healthy again yet
    redis_binary: str = ""

    def token(self) -> str:
        return Path(self.token_file).read_text().strip()

    def to_dict(self) -> dict[str, Any]:
        return {
            "state_dir": self.state_dir,
            "rest_url": self.rest_url,
            "token_file": self.token_file,
            "redis_url": self.redis_url,
            "addresses": self.addresses,
            "ready": self.ready,
            "dashboard_url": self.dashboard_url,
            "gateway_url": self.gateway_url,
            "started_at": self.started_at,
            "viewer_token_file": self.viewer_token_file,
            "internal_token_file": self.internal_token_file,
            "supervisor": None if self.supervisor is None else self.supervisor.to_dict(),
            "owned": self.owned,
            "given_up": dict(self.given_up),
            "restarting": list(self.restarting),
            "redis_binary": self.redis_binary,
            "processes": [p.to_dict() for p in self.processes],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StackInfo:
        supervisor = data.get("supervisor")
        return cls(
            state_dir=data["state_dir"],
            rest_url=data["rest_url"],
            token_file=data["token_file"],
            redis_url=data["redis_url"],
            addresses=dict(data["addresses"]),
            ready=bool(data.get("ready")),
            dashboard_url=data.get("dashboard_url", ""),
            gateway_url=data.get("gateway_url", ""),
            started_at=data["started_at"],
            viewer_token_file=data.get("viewer_token_file", ""),
            internal_token_file=data.get("internal_token_file", ""),
            supervisor=None if supervisor is None else ServiceProcess.from_dict(supervisor),
            owned=bool(data.get("owned")),
            given_up=dict(data.get("given_up", {})),
            restarting=tuple(data.get("restarting", ())),
            redis_binary=data.get("redis_binary", ""),
            processes=tuple(ServiceProcess.from_dict(p) for p in data["processes"]),
        )


def stack_file(state_dir: Path) -> Path:
    return Path(state_dir) / STACK_FILE


def load_stack(state_dir: Path) -> StackInfo | None:
    path = stack_file(state_dir)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return StackInfo.from_dict(json.loads(text))


def write_stack(info: StackInfo) -> None:
    path = stack_file(Path(info.state_dir))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info.to_dict(), indent=2))
    os.replace(tmp, path)


class StackState(str, enum.Enum):
    ABSENT = "absent"  # no stack.json
    STARTING = "starting"  # not ready yet, its supervisor alive
    RUNNING = "running"  # ready, every process alive
    RESTARTING = "restarting"  # ready, its supervisor is restarting a service that exited
    BROKEN = "broken"  # some processes alive, but a service is down for good or nobody restarts it
    STALE = "stale"  # recorded, but every process exited


@dataclass(frozen=True)
class StackStatus:
    state: StackState
    state_dir: Path
    info: StackInfo | None = None
    dead: tuple[ServiceProcess, ...] = ()

    def restarting(self, service: str) -> bool:
        """Whether service is down or not healthy yet, and being restarted."""
        if self.state != StackState.RESTARTING or self.info is None:
            return False
        return service in self.info.restarting or any(p.name == service for p in self.dead)

    @property
    def usable(self) -> bool:
        """Whether its REST API can be used (a restarting service comes back by itself)."""
        return self.state in (StackState.RUNNING, StackState.RESTARTING)

    def fix(self) -> str:
        """The one command that gets this state directory to a usable stack or to a clean one."""
        if self.state in (StackState.ABSENT, StackState.STALE):
            return f"furlong up --state-dir {self.state_dir}"
        return f"furlong down --state-dir {self.state_dir}"

    def _dead_words(self) -> str:
        return ", ".join(f"{p.name} (pid {p.pid})" for p in self.dead)

    def message(self) -> str:
        d, info = self.state_dir, self.info
        if self.state == StackState.ABSENT:
            return f"no stack in {d}"
        assert info is not None
        if self.state == StackState.STALE:
            return (
                f"the stack recorded in {d} is not running: every process it recorded has exited "
                f"({self._dead_words()}); `furlong up` replaces the record"
            )
        if self.state == StackState.STARTING:
            sup = info.supervisor
            return f"a stack is starting in {d} (supervisor pid {sup.pid if sup else '?'})"
        if self.state == StackState.RUNNING:
            return f"a stack is running in {d} (REST API {info.rest_url})"
        if self.state == StackState.RESTARTING:
            names = sorted({*info.restarting, *(p.name for p in self.dead)})
            return f"a stack is running in {d}; its supervisor is restarting {', '.join(names)}"
        supervisor = info.supervisor
        if supervisor is None or not is_running(supervisor):
            who = (
                f"its supervisor (pid {supervisor.pid}) has exited" if supervisor else "it has no supervisor"
            )
            if not self.dead:
                return f"the stack in {d} is broken: {who}, so nothing restarts its services"
            return f"the stack in {d} is broken: {self._dead_words()} not running and {who}"
        reasons = "; ".join(info.given_up[p.name] for p in self.dead if p.name in info.given_up)
        return f"the stack in {d} is broken: {reasons}"

    def explain(self) -> str:
        """The message and the one command that fixes it, as one sentence for an error."""
        advice = {
            StackState.ABSENT: "start one with",
            StackState.STALE: "start a new one with",
            StackState.STARTING: "wait for it, or stop it with",
            StackState.RUNNING: "stop it with",
            StackState.RESTARTING: "stop it with",
            StackState.BROKEN: "clean it up with",
        }[self.state]
        return f"{self.message()}; {advice} `{self.fix()}`"


def stack_status(state_dir: Path) -> StackStatus:
    """What state_dir holds (see the module docstring)."""
    state_dir = Path(state_dir)
    info = load_stack(state_dir)
    if info is None:
        return StackStatus(StackState.ABSENT, state_dir)
    dead = tuple(p for p in info.processes if not is_running(p))
    supervisor_alive = info.supervisor is not None and is_running(info.supervisor)
    alive = len(info.processes) - len(dead) + int(supervisor_alive)
    if alive == 0:
        return StackStatus(StackState.STALE, state_dir, info, dead)
    if not info.ready:
        state = StackState.STARTING if supervisor_alive else StackState.BROKEN
        return StackStatus(state, state_dir, info, dead)
    if not dead and not info.restarting and supervisor_alive:
        return StackStatus(StackState.RUNNING, state_dir, info)
    if supervisor_alive and not any(p.name in info.given_up for p in dead):
        return StackStatus(StackState.RESTARTING, state_dir, info, dead)
    return StackStatus(StackState.BROKEN, state_dir, info, dead)
