"""The local stack's supervisor: the process that starts Redis and the services, restarts what exits,
and stops them all.

    python -m furlong.controller.stack_supervisor --start STATE_DIR/supervisor-start.json [--owner-pid PID]

`furlong up` and `furlong run` start it (`local_stack.start_stack`), in its own session. It starts a
private Redis (data in `STATE_DIR/redis`, the binary recorded there: `redis_binary`), the weight
broker, trainer, rollout, the controller and the dashboard as its children, each on free loopback
ports and logging to `STATE_DIR/logs/<service>.log`, records them in `STATE_DIR/stack.json` as they
start, and waits until each is healthy (gRPC health, HTTP `/healthz`; rollout also serves its
OpenAI-compatible gateway on a port of its own, recorded as `gateway_url`, and is healthy once that
answers too).

Then it watches them. A service that exits is reported at once (`stack_events`: which service, its
pid, exit status or signal, the tail of its log, whether it is restarted) to `STATE_DIR/
stack-events.jsonl`, which the CLI follows, and as a `service` event into the event stream of every
active run. It is started again with its same command line, ports and log file after the restart
policy's backoff (`restart_policy`); once a service spends its restart budget it stays down and the
stack is broken (`stack_file`), with one short reason.

Nothing outlives it: each child is started through `parent_death`, so the kernel sends it SIGTERM
when the supervisor dies, even by SIGKILL. With `--owner-pid` (`furlong run`) it watches the command
that started it, its parent: once that is gone (exited, or killed even with -9: the kernel gives
the orphan another parent) it stops the stack. Without it (`furlong up`) the stack runs until
`furlong down` sends SIGTERM.
Stopping: controller and dashboard first (the controller ends its active run), then rollout,
trainer and broker, then Redis; then `stack.json` is removed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any

from furlong.controller import stack_events
from furlong.controller.redis_server import RedisServer, ping
from furlong.controller.run_store import RunStore
from furlong.controller.stack_argv import controller_argv, dashboard_argv, grpc_service_argv, health_check
from furlong.controller.stack_config import StackConfig, service_kind
from furlong.controller.stack_events import StackEvent, StackEventKind, ended_words, how_it_ended
from furlong.controller.stack_file import StackInfo, stack_file, write_stack
from furlong.controller.stack_processes import ServiceProcess, adopt, log_tail, spawn, terminate
from furlong.core.errors import FurlongError
from furlong.service_main.ports import free_port

log = logging.getLogger("furlong.controller.stack_supervisor")

# Stopped in these waves: the controller first (it ends the active run on the services), Redis last.
STOP_WAVES = (("controller", "dashboard"), ("rollout", "trainer", "weight_broker"), ("redis",))
FAULT_ENV_DIR = "fault-env"
POLL_S = 0.1
LOG_TAIL_LINES = 12
_MAX_RUN_NOTES = 200


class StartFailed(Exception):
    def __init__(self, message: str, service: str, log_path: str) -> None:
        super().__init__(message)
        self.service = service
        self.log_path = log_path


class _Stop(Exception):
    """Asked to stop (SIGTERM, or the owner went away) while starting."""


class OwnerWatch:
    """The process that started the supervisor and whose end ends the stack: gone once the
    supervisor's parent is no longer that pid (the kernel re-parents an orphan)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    @property
    def gone(self) -> bool:
        return os.getppid() != self.pid


class Supervisor:
    """Single-threaded: every method runs on the supervisor process's main thread."""

    def __init__(self, config: StackConfig, info: StackInfo, owner: OwnerWatch | None) -> None:
        self.config = config
        self.info = info
        self._owner = owner
        self.stop_reason = ""
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._restarted_at: dict[str, list[float]] = {}
        self._due: dict[str, tuple[float, int]] = {}  # service -> (monotonic due time, restart no.)
        self._run_notes: list[StackEvent] = []
        self._unhealthy: dict[str, Callable[[], bool]] = {}  # restarted, not healthy yet
        self._exited_at: dict[str, float] = {}  # monotonic
        self._store: RunStore | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        if not self.stop_reason:
            self.stop_reason = reason

    def _check_stop(self) -> None:
        if self._owner is not None and self._owner.gone:
            self.request_stop("the command that started the stack exited")
        if self.stop_reason:
            raise _Stop(self.stop_reason)

    def _sleep(self, seconds: float) -> None:
        time.sleep(seconds)  # a signal cuts it short; the callers look at their flags

    def emit(self, event: StackEvent, for_runs: bool = False) -> None:
        stack_events.append(Path(self.info.state_dir), event)
        (log.warning if event.kind != StackEventKind.READY else log.info)("%s", event.message)
        if for_runs:
            self._run_notes = [*self._run_notes, event][-_MAX_RUN_NOTES:]
            self._flush_run_notes()

    def _write(self) -> None:
        write_stack(self.info)

    # -- starting ----------------------------------------------------------------------------------

    def _fault_env(self, name: str) -> dict[str, str]:
        if not self.config.broker_fault_hooks:
            return {}
        path = Path(self.info.state_dir) / FAULT_ENV_DIR / f"{name}.json"
        try:
            env: dict[str, str] = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        log.warning("FAULT INJECTION: %s starts with extra environment %s", name, sorted(env))
        return env

    def _start(self, sp: ServiceProcess, restarts: int = 0) -> ServiceProcess:
        new, proc = spawn(
            sp.name,
            sp.argv,
            Path(sp.log_path),
            sp.port,
            sp.metrics_port,
            env_extra=self._fault_env(sp.name),
            restarts=restarts,
        )
        self._children[sp.name] = proc
        return new

    def _add(self, sp: ServiceProcess, **changes: Any) -> ServiceProcess:
        started = self._start(sp)
        self.info = replace(self.info, processes=(*self.info.processes, started), **changes)
        self._write()
        return started

    def launch(self) -> None:
        """Start every configured process, recording each as it starts, then wait until all are
        healthy. StartFailed names the first that exited or was not healthy in time."""
        state_dir = Path(self.info.state_dir)
        logs = state_dir / "logs"
        redis = RedisServer(data_dir=state_dir / "redis", appendfsync="always")
        redis.data_dir.mkdir(parents=True, exist_ok=True)
        argv = redis.command(self.config.redis_binary)
        self._add(
            ServiceProcess("redis", 0, 0.0, redis.port, str(redis.data_dir / "redis.log"), tuple(argv)),
            redis_url=redis.url,
        )
        self._wait_redis(redis)
        addresses = dict(self.config.external)
        for name in ("weight_broker", "trainer", "rollout"):
            if name not in self.config.services:
                continue
            port, metrics_port = free_port(), free_port()
            argv = grpc_service_argv(self.config, self.info, name, port, metrics_port, addresses)
            addresses[name] = f"127.0.0.1:{port}"
            changes: dict[str, Any] = {"addresses": dict(addresses)}
            if name == "rollout":  # its OpenAI-compatible gateway, on a port kept across restarts
                gateway_port = free_port()
                argv += ["--gateway-port", str(gateway_port)]
                changes["gateway_url"] = f"http://127.0.0.1:{gateway_port}/v1"
                if self.config.rollout_replicas > 1:
                    argv += ["--replica-id", "0"]
            self._add(
                ServiceProcess(name, 0, 0.0, port, str(logs / f"{name}.log"), tuple(argv), metrics_port),
                **changes,
            )
        rollouts = [addresses["rollout"]] if "rollout" in addresses else []
        for k in range(1, self.config.rollout_replicas):  # each replica with a gateway of its own
            name, port, metrics_port = f"rollout-{k}", free_port(), free_port()
            argv = grpc_service_argv(self.config, self.info, "rollout", port, metrics_port, addresses)
            argv += ["--gateway-port", str(free_port()), "--replica-id", str(k)]
            rollouts.append(f"127.0.0.1:{port}")
            log_path = str(logs / f"{name}.log")
            self._add(ServiceProcess(name, 0, 0.0, port, log_path, tuple(argv), metrics_port))
        port = free_port()
        argv = controller_argv(self.config, self.info, port, addresses, rollouts)
        self._add(
            ServiceProcess("controller", 0, 0.0, port, str(logs / "controller.log"), tuple(argv)),
            rest_url=f"http://127.0.0.1:{port}",
        )
        if "dashboard" in self.config.services:
            port = free_port()
            argv = dashboard_argv(self.config, self.info, port)
            self._add(
                ServiceProcess("dashboard", 0, 0.0, port, str(logs / "dashboard.log"), tuple(argv)),
                dashboard_url=f"http://127.0.0.1:{port}",
            )
        self._wait_healthy()
        self.info = replace(self.info, ready=True)
        self._write()

    def _wait_redis(self, redis: RedisServer) -> None:
        deadline = time.monotonic() + min(30.0, self.config.ready_timeout_s)
        sp = self.info.processes[-1]
        while not ping(redis.host, redis.port):
            self._check_stop()
            if self._children["redis"].poll() is not None:
                raise StartFailed(f"redis exited during startup; see {sp.log_path}", "redis", sp.log_path)
            if time.monotonic() > deadline:
                raise StartFailed(f"redis not answering on port {redis.port}", "redis", sp.log_path)
            self._sleep(0.05)

    def _wait_healthy(self) -> None:
        waiting = {sp.name: (sp, health_check(sp)) for sp in self.info.processes if sp.name != "redis"}
        deadline = time.monotonic() + self.config.ready_timeout_s
        while waiting:
            self._check_stop()
            for name, (sp, healthy) in list(waiting.items()):
                if self._children[name].poll() is not None:
                    raise StartFailed(f"{name} exited during startup; see {sp.log_path}", name, sp.log_path)
                if healthy():
                    log.info("%s is healthy on port %d", name, sp.port)
                    del waiting[name]
            if waiting and time.monotonic() > deadline:
                name, (sp, _) = next(iter(waiting.items()))
                raise StartFailed(
                    f"{', '.join(waiting)} not healthy after {self.config.ready_timeout_s:.0f}s; "
                    f"see {sp.log_path}",
                    name,
                    sp.log_path,
                )
            if waiting:
                self._sleep(0.1)

    # -- supervising -------------------------------------------------------------------------------

    def supervise(self) -> None:
        """Until asked to stop: report and restart services that exit (see the module docstring)."""
        while True:
            if self._owner is not None and self._owner.gone:
                self.request_stop("the command that started the stack exited")
            if self.stop_reason:
                return
            self.check_once(time.monotonic())
            self._sleep(POLL_S)

    def check_once(self, now: float) -> None:
        for sp in self.info.processes:
            proc = self._children.get(sp.name)
            if proc is None or sp.name in self._due or sp.name in self.info.given_up:
                continue
            code = proc.poll()
            if code is not None:
                self._exited(sp, code, now)
        for name, (due, restart) in list(self._due.items()):
            if now >= due:
                del self._due[name]
                self._restart(name, restart)
        for name, healthy in list(self._unhealthy.items()):
            if name not in self._due and healthy():
                del self._unhealthy[name]
                self._set_restarting(name, False)
                sp = next(p for p in self.info.processes if p.name == name)
                self.emit(
                    StackEvent(
                        StackEventKind.HEALTHY,
                        time=time.time(),
                        message=(
                            f"{name} (pid {sp.pid}) is healthy again, "
                            f"{time.monotonic() - self._exited_at.get(name, now):.1f}s after it exited"
                        ),
                        service=name,
                        pid=sp.pid,
                        restart=sp.restarts,
                    )
                )
        self._flush_run_notes()

    def _set_restarting(self, name: str, restarting: bool) -> None:
        names = [n for n in self.info.restarting if n != name] + ([name] if restarting else [])
        self.info = replace(self.info, restarting=tuple(names))
        self._write()

    def _exited(self, sp: ServiceProcess, code: int, now: float) -> None:
        exit_code, sig = how_it_ended(code)
        words = ended_words(exit_code, sig)
        policy = self.config.restart
        decision = policy.decide(self._restarted_at.get(sp.name, []), now)
        base = StackEvent(
            StackEventKind.EXITED,
            time=time.time(),
            message="",
            service=sp.name,
            pid=sp.pid,
            exit_code=exit_code,
            signal=sig,
            budget=policy.budget,
            log_path=sp.log_path,
            log_tail=log_tail(sp.log_path, LOG_TAIL_LINES),
        )
        self._exited_at[sp.name] = now
        if decision is None:
            reason = policy.spent(sp.name, words)
            self._unhealthy.pop(sp.name, None)
            self._set_restarting(sp.name, False)
            self.info = replace(self.info, given_up={**self.info.given_up, sp.name: reason})
            self._write()
            self.emit(replace(base, kind=StackEventKind.GAVE_UP, message=reason), for_runs=True)
            return
        self._due[sp.name] = (now + decision.delay_s, decision.restart)
        self._set_restarting(sp.name, True)
        message = (
            f"{sp.name} (pid {sp.pid}) {words}; restarting it in {decision.delay_s:g}s "
            f"(restart {decision.restart} of {policy.budget} within {policy.window_s:g}s)"
        )
        self.emit(
            replace(base, message=message, restart=decision.restart, delay_s=decision.delay_s), for_runs=True
        )

    def _restart(self, name: str, restart: int) -> None:
        processes = list(self.info.processes)
        index = next(i for i, p in enumerate(processes) if p.name == name)
        old = processes[index]
        new = self._start(old, restarts=old.restarts + 1)
        self._restarted_at.setdefault(name, []).append(time.monotonic())
        processes[index] = new
        self.info = replace(self.info, processes=tuple(processes))
        self._write()
        self._unhealthy[name] = (
            (lambda: ping("127.0.0.1", new.port)) if name == "redis" else health_check(new)
        )
        self.emit(
            StackEvent(
                StackEventKind.RESTARTED,
                time=time.time(),
                message=f"{name} restarted as pid {new.pid} (was pid {old.pid}; restart {restart})",
                service=name,
                pid=old.pid,
                new_pid=new.pid,
                restart=restart,
                budget=self.config.restart.budget,
                log_path=new.log_path,
            ),
            for_runs=True,
        )

    def _flush_run_notes(self) -> None:
        """Copy the pending service events into every active run's event stream (kept for later
        while Redis is down)."""
        if not self._run_notes or not self.info.redis_url:
            return
        if self._store is None:
            self._store = RunStore.from_url(self.info.redis_url, socket_timeout_s=1.0)
        try:
            for event in list(self._run_notes):
                for run_id in self._store.active_run_ids():
                    self._store.record_service_event(run_id, _service_event_fields(event))
                self._run_notes.remove(event)
        except FurlongError as exc:
            log.info("service events wait for Redis: %s", exc)

    # -- stopping ----------------------------------------------------------------------------------

    def stop_all(self) -> None:
        for wave in STOP_WAVES:
            members = [p for p in self.info.processes if service_kind(p.name) in wave]
            killed = terminate(members, self.config.stop_timeout_s)
            if killed:
                log.warning("killed after the stop deadline: %s", killed)
        for proc in self._children.values():
            try:
                proc.wait(1.0)
            except subprocess.TimeoutExpired:
                log.error("pid %d still running after the stop", proc.pid)
        if self._store is not None:
            self._store.close()


def _service_event_fields(event: StackEvent) -> dict[str, Any]:
    action = {
        StackEventKind.EXITED: "restarting" if event.restart else "exited",
        StackEventKind.RESTARTED: "restarted",
        StackEventKind.GAVE_UP: "gave_up",
    }[event.kind]
    return {
        "service": event.service,
        "pid": event.pid,
        "new_pid": event.new_pid,
        "exit_code": -1 if event.exit_code is None else event.exit_code,
        "signal": event.signal,
        "action": action,
        "restart": event.restart,
        "log_tail": event.log_tail,
        "message": event.message,
    }


def run_supervisor(config: StackConfig, info: StackInfo, owner: OwnerWatch | None) -> int:
    """Start, supervise and stop the stack; the process's exit status."""
    supervisor = Supervisor(config, info, owner)

    def on_term(signum: int, frame: FrameType | None) -> None:
        supervisor.request_stop(f"{signal.Signals(signum).name} received")

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the CLI's; it decides what to stop
    state_dir = Path(info.state_dir)
    code = 0
    try:
        supervisor.launch()
        supervisor.emit(StackEvent(StackEventKind.READY, time.time(), f"the stack in {state_dir} is ready"))
        supervisor.supervise()
    except StartFailed as exc:
        supervisor.emit(
            StackEvent(
                StackEventKind.START_FAILED,
                time=time.time(),
                message=str(exc),
                service=exc.service,
                log_path=exc.log_path,
                log_tail=log_tail(exc.log_path),
            )
        )
        supervisor.request_stop(f"{exc.service} did not start")
        code = 1
    except _Stop:
        pass
    except BaseException as exc:
        log.exception("stack supervisor failed")
        supervisor.request_stop(f"the supervisor failed: {type(exc).__name__}: {exc}")
        code = 1
    finally:
        supervisor.stop_all()
        stack_file(state_dir).unlink(missing_ok=True)
        supervisor.emit(
            StackEvent(
                StackEventKind.STOPPED,
                time.time(),
                f"stopped the stack in {state_dir} ({supervisor.stop_reason or 'done'})",
            )
        )
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m furlong.controller.stack_supervisor")
    parser.add_argument(
        "--start", type=Path, required=True, help="JSON of the stack's config and initial record"
    )
    parser.add_argument(
        "--owner-pid", type=int, default=0, help="stop the stack when this parent process is gone"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    start = json.loads(args.start.read_text())
    config = StackConfig.from_dict(start["config"])
    info = StackInfo.from_dict(start["info"])
    me = adopt("supervisor", os.getpid(), 0, Path(info.state_dir) / "logs" / "supervisor.log", sys.argv)
    info = replace(info, supervisor=me)
    write_stack(info)
    owner = OwnerWatch(args.owner_pid) if args.owner_pid else None
    return run_supervisor(config, info, owner)


if __name__ == "__main__":
    sys.exit(main())
