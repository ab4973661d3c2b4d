"""The local stack from the CLI's side: start one (through its supervisor process), stop one.

`start_stack` checks the state directory (`stack_file.stack_status`: a stack already there is a
`StackRunningError` with the one command that fixes it; the record of one whose processes all
exited is replaced), chooses the Redis binary of the state directory (`redis_binary`), writes three
fresh tokens, and starts `python -m furlong.controller.stack_supervisor` in its own session. The
supervisor starts Redis and the five services as its children and restarts whatever exits (see
`stack_supervisor`); `start_stack` follows its events until the stack is ready and returns the
recorded `StackInfo`, or raises `StackStartError` with the log tail of the service that failed
(everything started is stopped again). A stack started with `StackConfig(owned=True)` (`furlong
run`) ends when the process that started it does, however it ends; otherwise (`furlong up`) it
runs until `stop_stack`.

`stop_stack` sends SIGTERM to the supervisor, which stops the services in waves (controller first,
Redis last), and waits for it; whatever is still running then (a supervisor that was killed) is
stopped directly, by pid and creation time, and `stack.json` is removed.

Redis keeps an append-only file fsynced on every write (`--appendfsync always`), so a Redis that is
killed and started again on the same port and directory has everything it acknowledged. The trainer
writes training checkpoints under `STATE_DIR/checkpoints` (resumed after a restart).

Three fresh tokens per start, each in a 0600 file of the state dir: `token` (the REST admin token,
for the CLI), `viewer-token` (read-only, for the dashboard) and `internal-token` (the shared gRPC
token every service requires of its callers, passed with `--auth-token-file`).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

from furlong.controller import stack_events
from furlong.controller.redis_binary import choose_redis_binary
from furlong.controller.stack_config import GRPC_SERVICES, SERVICES, StackConfig
from furlong.controller.stack_events import StackEventKind, StackEventTail
from furlong.controller.stack_file import (
    StackInfo,
    StackState,
    load_stack,
    stack_file,
    stack_status,
)
from furlong.controller.stack_processes import is_running, log_tail, start_process, terminate, wait_gone
from furlong.controller.stack_supervisor import STOP_WAVES

__all__ = [
    "GRPC_SERVICES",
    "SERVICES",
    "StackConfig",
    "StackInfo",
    "StackRunningError",
    "StackStartError",
    "load_stack",
    "running_stack",
    "start_stack",
    "stop_stack",
]

log = logging.getLogger(__name__)

START_FILE = "supervisor-start.json"
# After the services' own ready timeout: how long the supervisor may take to report either way.
_START_MARGIN_S = 60.0


class StackRunningError(RuntimeError):
    """state_dir already holds a stack (running, starting, restarting or broken)."""


class StackStartError(RuntimeError):
    """A service did not become healthy; everything started was stopped again."""

    def __init__(self, message: str, service: str, log_path: str, tail: str) -> None:
        super().__init__(message)
        self.service = service
        self.log_path = log_path
        self.tail = tail


def running_stack(state_dir: Path) -> StackInfo | None:
    """The stack recorded in state_dir if its REST API can be used (running, or restarting a
    service that exited), else None."""
    status = stack_status(Path(state_dir))
    return status.info if status.usable else None


def _write_token(state_dir: Path, name: str) -> Path:
    path = state_dir / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")  # hex: never starts with "-", safe as a CLI argument
    return path


def start_stack(config: StackConfig) -> StackInfo:
    """Start the stack and return it once every started service is healthy (see module doc)."""
    state_dir = config.state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    status = stack_status(state_dir)
    if status.state == StackState.STALE:
        log.warning("%s", status.message())
        stack_file(state_dir).unlink(missing_ok=True)
    elif status.state != StackState.ABSENT:
        raise StackRunningError(status.explain())
    binary = choose_redis_binary(state_dir / "redis", config.redis_binary or None)
    config = replace(config, state_dir=state_dir, redis_binary=binary.path)
    info = StackInfo(
        state_dir=str(state_dir),
        rest_url="",
        token_file=str(_write_token(state_dir, "token")),
        redis_url="",
        addresses=dict(config.external),
        processes=(),
        started_at=time.time(),
        viewer_token_file=str(_write_token(state_dir, "viewer-token")),
        internal_token_file=str(_write_token(state_dir, "internal-token")),
        owned=config.owned,
        redis_binary=binary.describe(),
    )
    start = state_dir / START_FILE
    start.write_text(json.dumps({"config": config.to_dict(), "info": info.to_dict()}, indent=2))
    stack_events.reset(state_dir)
    argv = [config.python, "-m", "furlong.controller.stack_supervisor", "--start", str(start)]
    if config.owned:
        argv += ["--owner-pid", str(os.getpid())]
    supervisor_log = state_dir / "logs" / "supervisor.log"
    proc = start_process(argv, supervisor_log)
    try:
        return _wait_ready(config, proc, supervisor_log)
    except BaseException:
        _stop_supervisor(proc, config.stop_timeout_s)
        stack_file(state_dir).unlink(missing_ok=True)
        raise


def _wait_ready(config: StackConfig, proc: subprocess.Popen[bytes], supervisor_log: Path) -> StackInfo:
    tail = StackEventTail(config.state_dir, from_start=True)
    deadline = time.monotonic() + config.ready_timeout_s + _START_MARGIN_S
    while True:
        for event in tail.read():
            if event.kind == StackEventKind.READY:
                info = load_stack(config.state_dir)
                if info is None:  # pragma: no cover - the supervisor writes it before READY
                    raise RuntimeError(
                        f"the supervisor reported ready but wrote no {stack_file(config.state_dir)}"
                    )
                return info
            if event.kind == StackEventKind.START_FAILED:
                proc.wait(config.stop_timeout_s * len(STOP_WAVES) + 10)  # it stops what it started
                raise StackStartError(event.message, event.service, event.log_path, event.log_tail)
        code = proc.poll()
        if code is not None:
            raise StackStartError(
                f"the stack supervisor exited with status {code} before the stack was ready; "
                f"see {supervisor_log}",
                "supervisor",
                str(supervisor_log),
                log_tail(supervisor_log),
            )
        if time.monotonic() > deadline:
            waited_s = config.ready_timeout_s + _START_MARGIN_S
            raise StackStartError(
                f"the stack supervisor reported nothing within {waited_s:.0f}s",
                "supervisor",
                str(supervisor_log),
                log_tail(supervisor_log),
            )
        time.sleep(0.1)


def _stop_supervisor(proc: subprocess.Popen[bytes], stop_timeout_s: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(stop_timeout_s * len(STOP_WAVES) + 10)
    except subprocess.TimeoutExpired:
        log.error("the stack supervisor (pid %d) did not stop; killing it", proc.pid)
        proc.kill()
        proc.wait()


def stop_stack(state_dir: Path, timeout_s: float = 15.0) -> StackInfo | None:
    """Stop what state_dir records (see the module docstring) and remove stack.json; the record
    (None if there was none)."""
    info = load_stack(state_dir)
    if info is None:
        return None
    supervisor = info.supervisor
    if supervisor is not None and is_running(supervisor):
        os.kill(supervisor.pid, signal.SIGTERM)
        if wait_gone([supervisor], timeout_s * len(STOP_WAVES) + 10):
            log.error("the stack supervisor (pid %d) did not stop; killing what it started", supervisor.pid)
            terminate([supervisor], 1.0)
    by_name = {p.name: p for p in info.processes}
    for wave in STOP_WAVES:  # what a dead supervisor left behind
        killed = terminate([by_name[n] for n in wave if n in by_name], timeout_s)
        if killed:
            log.warning("killed after the stop deadline: %s", killed)
    stack_file(state_dir).unlink(missing_ok=True)
    return info
