"""The local stack: Redis and the five services as processes on 127.0.0.1, recorded in a state dir.

`start_stack` starts a private Redis (data in `STATE_DIR/redis`), then the weight broker, trainer,
rollout and controller, then the dashboard watching all of them, each on free loopback ports and
logging to `STATE_DIR/logs/<service>.log`. It waits until every one is healthy (gRPC health, HTTP
`/healthz`), polling with a deadline; if one exits or the deadline passes it stops everything it
started and raises `StackStartError` with the log tail. The stack is described by
`STATE_DIR/stack.json` (written as processes start, so `stop_stack` can clean up even after an
interrupted start). `stop_stack` stops exactly those processes, controller first and Redis last.

Redis keeps an append-only file fsynced on every write (`--appendfsync always`), so a Redis that is
killed and started again on the same port and directory has everything it acknowledged. The trainer
writes training checkpoints under `STATE_DIR/checkpoints` (resumed after a restart). A
`StackSupervisor` is the stack's restart policy: it respawns a service that died with its own
command line, port and log file (the run then resumes, see `run_recovery`); `furlong up` does not
start one (nothing stays behind to run it), `furlong run` and tests may.

Three fresh tokens per start, each in a 0600 file of the state dir: `token` (the REST admin token,
for the CLI), `viewer-token` (read-only, for the dashboard) and `internal-token` (the shared gRPC
token every service requires of its callers, passed with `--auth-token-file`).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from furlong import rpc
from furlong.controller.config import check_address
from furlong.controller.redis_server import RedisServer
from furlong.controller.services import BROKER_SERVICE, ROLLOUT_SERVICE, TRAINER_SERVICE
from furlong.controller.stack_processes import ServiceProcess, adopt, is_running, log_tail, spawn, terminate
from furlong.service_main.ports import free_port

log = logging.getLogger(__name__)

SERVICES = ("redis", "weight_broker", "trainer", "rollout", "controller", "dashboard")
GRPC_SERVICES = {"weight_broker": BROKER_SERVICE, "trainer": TRAINER_SERVICE, "rollout": ROLLOUT_SERVICE}
# Stopped in these waves: the controller first (it ends the active run on the services), Redis last.
_STOP_WAVES = (("controller", "dashboard"), ("rollout", "trainer", "weight_broker"), ("redis",))
STACK_FILE = "stack.json"


class StackRunningError(RuntimeError):
    """state_dir already holds a stack with live processes."""


class StackStartError(RuntimeError):
    """A service did not become healthy; everything started was stopped again."""

    def __init__(self, message: str, service: str, log_path: str, tail: str) -> None:
        super().__init__(message)
        self.service = service
        self.log_path = log_path
        self.tail = tail


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
    # an engine that has not acknowledged a version's current stage within this is fenced out of it
    broker_ack_timeout_s: float = 60.0
    # fault tests only: start the broker with --enable-fault-hooks (furlong.weight_broker.fault_hooks)
    broker_fault_hooks: bool = False

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
        if self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {self.torch_threads}")
        if not self.broker_ack_timeout_s > 0:
            raise ValueError(f"broker_ack_timeout_s must be > 0, got {self.broker_ack_timeout_s}")
        if self.ready_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise ValueError(
                f"timeouts must be positive, got ready_timeout_s={self.ready_timeout_s}, "
                f"stop_timeout_s={self.stop_timeout_s}"
            )


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
    viewer_token_file: str = ""
    internal_token_file: str = ""

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
            "started_at": self.started_at,
            "viewer_token_file": self.viewer_token_file,
            "internal_token_file": self.internal_token_file,
            "processes": [p.to_dict() for p in self.processes],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StackInfo:
        return cls(
            state_dir=data["state_dir"],
            rest_url=data["rest_url"],
            token_file=data["token_file"],
            redis_url=data["redis_url"],
            addresses=dict(data["addresses"]),
            ready=bool(data.get("ready")),
            dashboard_url=data.get("dashboard_url", ""),
            started_at=data["started_at"],
            viewer_token_file=data.get("viewer_token_file", ""),
            internal_token_file=data.get("internal_token_file", ""),
            processes=tuple(ServiceProcess.from_dict(p) for p in data["processes"]),
        )


def stack_file(state_dir: Path) -> Path:
    return Path(state_dir) / STACK_FILE


def load_stack(state_dir: Path) -> StackInfo | None:
    path = stack_file(state_dir)
    if not path.exists():
        return None
    return StackInfo.from_dict(json.loads(path.read_text()))


def running_stack(state_dir: Path) -> StackInfo | None:
    """The stack recorded in state_dir if it finished starting and all its processes still run."""
    info = load_stack(state_dir)
    if info is None or not info.ready or not all(is_running(p) for p in info.processes):
        return None
    return info


def _write(info: StackInfo) -> None:
    path = stack_file(Path(info.state_dir))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info.to_dict(), indent=2))
    os.replace(tmp, path)


def _write_token(state_dir: Path, name: str = "token") -> Path:
    path = state_dir / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")  # hex: never starts with "-", safe as a CLI argument
    return path


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _health_check(sp: ServiceProcess) -> Callable[[], bool]:
    if sp.name in GRPC_SERVICES:
        return lambda: rpc.check_health(f"127.0.0.1:{sp.port}", GRPC_SERVICES[sp.name], timeout_s=1.0)
    return lambda: _http_ok(f"http://127.0.0.1:{sp.port}/healthz")


def start_stack(config: StackConfig) -> StackInfo:
    """Start the stack and return it once every started service is healthy (see module doc)."""
    state_dir = config.state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    if _any_running(state_dir):
        raise StackRunningError(
            f"a stack is already running in {state_dir}; stop it with `furlong down --state-dir {state_dir}`"
        )
    stack_file(state_dir).unlink(missing_ok=True)
    info = StackInfo(
        state_dir=str(state_dir),
        rest_url="",
        token_file=str(_write_token(state_dir)),
        redis_url="",
        addresses=dict(config.external),
        processes=(),
        started_at=time.time(),
        viewer_token_file=str(_write_token(state_dir, "viewer-token")),
        internal_token_file=str(_write_token(state_dir, "internal-token")),
    )
    try:
        info = _launch(config, state_dir, info)
        info = _wait_healthy(config, info)
    except BaseException:
        current = load_stack(state_dir) or info
        terminate_stack(current, config.stop_timeout_s)
        stack_file(state_dir).unlink(missing_ok=True)
        raise
    info = replace(info, ready=True)
    _write(info)
    return info


def _any_running(state_dir: Path) -> bool:
    info = load_stack(state_dir)
    return info is not None and any(is_running(p) for p in info.processes)


def _with(info: StackInfo, sp: ServiceProcess, **changes: Any) -> StackInfo:
    updated = replace(info, processes=(*info.processes, sp), **changes)
    _write(updated)
    return updated


def _launch(config: StackConfig, state_dir: Path, info: StackInfo) -> StackInfo:
    logs = state_dir / "logs"
    redis = RedisServer(data_dir=state_dir / "redis", appendfsync="always")
    try:
        redis.start()
    except BaseException:
        redis.stop()
        raise
    process = redis.process
    assert process is not None and isinstance(process.args, list)  # start() ran a list of strings
    info = _with(
        info,
        adopt(
            "redis",
            process.pid,
            redis.port,
            state_dir / "redis" / "redis.log",
            [str(a) for a in process.args],
        ),
        redis_url=redis.url,
    )
    addresses = dict(config.external)
    py = config.python
    for name in ("weight_broker", "trainer", "rollout"):
        if name not in config.services:
            continue
        port, metrics_port = free_port(), free_port()
        argv = [
            py,
            "-m",
            f"furlong.{name}",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--auth-token-file",
            info.internal_token_file,
        ]
        if name != "weight_broker":
            argv += [
                "--redis-url",
                info.redis_url,
                "--broker",
                addresses["weight_broker"],
                "--num-threads",
                str(config.torch_threads),
            ]
        if name == "weight_broker":
            argv += ["--ack-timeout-s", repr(float(config.broker_ack_timeout_s))]
            if config.broker_fault_hooks:
                argv.append("--enable-fault-hooks")
        if name == "trainer":
            argv += ["--checkpoint-dir", str(state_dir / "checkpoints")]
            argv += ["--policy-dir", str(state_dir / "policies")]
        sp = spawn(name, argv, logs / f"{name}.log", port, metrics_port)
        addresses[name] = f"127.0.0.1:{port}"
        info = _with(info, sp, addresses=dict(addresses))
    port = free_port()
    argv = [
        py,
        "-m",
        "furlong.controller",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--redis-url",
        info.redis_url,
        "--trainer",
        addresses["trainer"],
        "--rollout",
        addresses["rollout"],
        "--broker",
        addresses["weight_broker"],
        "--token-file",
        info.token_file,
        "--viewer-token-file",
        info.viewer_token_file,
        "--auth-token-file",
        info.internal_token_file,
    ]
    sp = spawn("controller", argv, logs / "controller.log", port)
    info = _with(info, sp, rest_url=f"http://127.0.0.1:{port}")
    if "dashboard" in config.services:
        port = free_port()
        argv = [
            py,
            "-m",
            "furlong.dashboard",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--controller-url",
            info.rest_url,
            "--controller-token-file",
            info.viewer_token_file,
        ]
        for watched in info.processes:
            argv += ["--watch-pid", str(watched.pid)]
        sp = spawn("dashboard", argv, logs / "dashboard.log", port)
        info = _with(info, sp, dashboard_url=f"http://127.0.0.1:{port}")
    return info


def _wait_healthy(config: StackConfig, info: StackInfo) -> StackInfo:
    waiting = {sp.name: (sp, _health_check(sp)) for sp in info.processes if sp.name != "redis"}
    deadline = time.monotonic() + config.ready_timeout_s
    while waiting:
        for name, (sp, healthy) in list(waiting.items()):
            if not is_running(sp):
                tail = log_tail(sp.log_path)
                raise StackStartError(
                    f"{name} exited during startup; see {sp.log_path}", name, sp.log_path, tail
                )
            if healthy():
                log.info("%s is healthy on port %d", name, sp.port)
                del waiting[name]
        if waiting and time.monotonic() > deadline:
            name, (sp, _) = next(iter(waiting.items()))
            raise StackStartError(
                f"{', '.join(waiting)} not healthy after {config.ready_timeout_s:.0f}s; see {sp.log_path}",
                name,
                sp.log_path,
                log_tail(sp.log_path),
            )
        if waiting:
            time.sleep(0.1)
    return info


def terminate_stack(info: StackInfo, timeout_s: float) -> list[str]:
    """Stop the stack's processes in waves; the names of those that had to be killed."""
    by_name = {p.name: p for p in info.processes}
    killed: list[str] = []
    for wave in _STOP_WAVES:
        killed += terminate([by_name[n] for n in wave if n in by_name], timeout_s)
    return killed


def stop_stack(state_dir: Path, timeout_s: float = 15.0) -> StackInfo | None:
    """Stop what `start_stack` recorded in state_dir and remove stack.json; None if nothing was
    recorded."""
    info = load_stack(state_dir)
    if info is None:
        return None
    killed = terminate_stack(info, timeout_s)
    if killed:
        log.warning("killed after the stop deadline: %s", killed)
    stack_file(state_dir).unlink(missing_ok=True)
    return info


class StackSupervisor:
    """The local stack's restart policy: every `poll_s`, each recorded service process that is no
    longer running is started again with its own argv, port and log file (after `backoff_s`), and
    stack.json is updated. `restarts` counts the respawns per service. Thread-safe; one thread."""

    def __init__(self, state_dir: Path, poll_s: float = 0.2, backoff_s: float = 0.5) -> None:
        if poll_s <= 0 or backoff_s < 0:
            raise ValueError(f"poll_s must be > 0 and backoff_s >= 0, got {poll_s}, {backoff_s}")
        self._state_dir = Path(state_dir)
        self._poll_s = poll_s
        self._backoff_s = backoff_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="furlong-stack-supervisor", daemon=True)
        self.restarts: dict[str, int] = {}

    def start(self) -> StackSupervisor:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self.check()
            except Exception:
                log.exception("stack supervisor: poll failed")

    def check(self) -> list[str]:
        """Respawn the dead services once; their names."""
        with self._lock:
            info = load_stack(self._state_dir)
            if info is None:
                return []
            dead = [p for p in info.processes if p.argv and not is_running(p)]
            if not dead:
                return []
            self._stop.wait(self._backoff_s)
            processes = list(info.processes)
            for sp in dead:
                new = spawn(sp.name, sp.argv, Path(sp.log_path), sp.port, sp.metrics_port)
                processes[processes.index(sp)] = new
                self.restarts[sp.name] = self.restarts.get(sp.name, 0) + 1
                log.warning(
                    "stack supervisor: %s (pid %d) died; restarted as pid %d", sp.name, sp.pid, new.pid
                )
            _write(replace(info, processes=tuple(processes)))
            return [sp.name for sp in dead]
