"""Starting, identifying and stopping the local stack's OS processes.

Every process is started in its own session (so a Ctrl-C in the terminal does not reach it, and it
can be signalled as a process group) with its output going to its own log file; a service started
by the stack's supervisor gets SIGTERM from the kernel when the supervisor dies (`parent_death`). A
process is identified by pid *and* creation time, so a pid the OS has since reused is never
signalled.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from furlong.controller.parent_death import command_line as parent_death_command

log = logging.getLogger(__name__)

# psutil reports creation times rounded to the clock tick; two readings of one process agree to
# well under this, while a reused pid belongs to a process created later.
_CREATE_TIME_TOLERANCE_S = 0.05


@dataclass(frozen=True)
class ServiceProcess:
    name: str
    pid: int
    create_time: float  # psutil.Process.create_time(), to recognise the process later
    port: int
    log_path: str
    argv: tuple[str, ...] = ()
    metrics_port: int | None = None
    restarts: int = 0  # how often the supervisor started it again

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "pid": self.pid,
            "create_time": self.create_time,
            "port": self.port,
            "metrics_port": self.metrics_port,
            "log_path": self.log_path,
            "argv": list(self.argv),
            "restarts": self.restarts,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServiceProcess:
        return cls(
            name=data["name"],
            pid=int(data["pid"]),
            create_time=float(data["create_time"]),
            port=int(data["port"]),
            metrics_port=data.get("metrics_port"),
            log_path=data["log_path"],
            argv=tuple(data.get("argv", ())),
            restarts=int(data.get("restarts", 0)),
        )


def start_process(
    argv: Sequence[str], log_path: Path, env_extra: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start argv in a new session (its own process group), stdout and stderr appended to
    log_path, stdin closed."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )


def spawn(
    name: str,
    argv: Sequence[str],
    log_path: Path,
    port: int,
    metrics_port: int | None = None,
    *,
    env_extra: Mapping[str, str] | None = None,
    parent_death: bool = True,
    restarts: int = 0,
) -> tuple[ServiceProcess, subprocess.Popen[bytes]]:
    """Start a service (see start_process); with parent_death it gets SIGTERM when this process
    dies (`parent_death`). The record keeps argv itself, unwrapped."""
    command = parent_death_command(os.getpid(), list(argv)) if parent_death else list(argv)
    proc = start_process(command, log_path, env_extra)
    log.info("started %s (pid %d): %s", name, proc.pid, " ".join(argv))
    sp = adopt(name, proc.pid, port, log_path, argv, metrics_port)
    return replace(sp, restarts=restarts), proc


def adopt(
    name: str, pid: int, port: int, log_path: Path, argv: Sequence[str] = (), metrics_port: int | None = None
) -> ServiceProcess:
    """Record an already started process (its creation time is read now)."""
    return ServiceProcess(
        name=name,
        pid=pid,
        create_time=psutil.Process(pid).create_time(),
        port=port,
        log_path=str(log_path),
        argv=tuple(argv),
        metrics_port=metrics_port,
    )


def find(sp: ServiceProcess) -> psutil.Process | None:
    """The live process sp describes, or None when it exited or its pid now names another one."""
    try:
        proc = psutil.Process(sp.pid)
        if abs(proc.create_time() - sp.create_time) > _CREATE_TIME_TOLERANCE_S:
            return None
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def is_running(sp: ServiceProcess) -> bool:
    return find(sp) is not None


def _signal_group(sp: ServiceProcess, sig: signal.Signals) -> None:
    try:
        os.killpg(sp.pid, sig)  # the session leader's group: the service and anything it forked
    except ProcessLookupError:
        pass
    except PermissionError as exc:
        log.warning("cannot signal %s (pid %d): %s", sp.name, sp.pid, exc)


def _reap(pid: int) -> None:
    """Collect the exit status if pid is our child, so it does not linger as a zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def wait_gone(processes: Iterable[ServiceProcess], timeout_s: float) -> list[ServiceProcess]:
    """Poll until every process has exited (a zombie counts as exited); those still running."""
    pending = list(processes)
    deadline = time.monotonic() + timeout_s
    while True:
        for sp in pending:
            _reap(sp.pid)
        pending = [sp for sp in pending if is_running(sp)]
        if not pending or time.monotonic() >= deadline:
            return pending
        time.sleep(0.05)


def terminate(processes: Iterable[ServiceProcess], timeout_s: float) -> list[str]:
    """SIGTERM each process that is still the one we started, SIGKILL whatever is left after
    timeout_s; returns the names of the processes that had to be killed."""
    live = [sp for sp in processes if is_running(sp)]
    for sp in live:
        log.info("stopping %s (pid %d)", sp.name, sp.pid)
        _signal_group(sp, signal.SIGTERM)
    stubborn = wait_gone(live, timeout_s)
    for sp in stubborn:
        log.warning("%s (pid %d) ignored SIGTERM for %.0fs; killing it", sp.name, sp.pid, timeout_s)
        _signal_group(sp, signal.SIGKILL)
    left = wait_gone(stubborn, 5.0)
    if left:
        log.error("still running after SIGKILL: %s", [(sp.name, sp.pid) for sp in left])
    return [sp.name for sp in stubborn]


def log_tail(path: str | Path, lines: int = 30) -> str:
    """The last lines of a log file ("" when it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])
