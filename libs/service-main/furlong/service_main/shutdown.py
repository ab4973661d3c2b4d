"""Graceful shutdown of a service process on SIGTERM or SIGINT, within a deadline.

A service registers its stop steps in the order they must run: first what stops taking new work and
lets the work in flight drain (a gRPC server's `stop(grace)`, an HTTP server's graceful shutdown),
then what closes its resources (clients, engines, threads). On the first signal `run` executes them
in order on a helper thread; each step is given the seconds it may take: what is left of the grace
period, less a reserve for the steps after it (a tenth of the grace period, at most 1 s). When the
deadline passes before the last step returns, `run` logs one line naming the step it was in, the
steps it never reached and what the registered probes say is still running (say, the gRPC calls in
flight), and reports the overrun; the scaffold then exits at once (`os._exit`: threads that are
still busy would otherwise keep the interpreter from exiting). A second signal while stopping exits
at once the same way.

Knows nothing about what a step stops; thread-safe.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_UNCLEAN = 1  # the deadline passed, a second signal came, or a stop step raised
_MAX_RESERVE_S = 1.0


class Closeable(Protocol):
    def close(self) -> Any: ...


@dataclass(frozen=True)
class Stopped:
    """How `GracefulShutdown.run` ended: the exit status, and whether every step returned before
    the deadline (if not, the process must exit at once: `exit_now`)."""

    exit_code: int
    in_time: bool
    seconds_left: float  # until the deadline, when run returned


@dataclass(frozen=True)
class _Step:
    name: str
    stop: Callable[[float], object]


class GracefulShutdown:
    """The stop steps of one service process and the signals that start them (see the module doc)."""

    def __init__(self, service: str, grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not grace_s > 0:
            raise ValueError(f"grace_s must be > 0, got {grace_s!r}")
        self.service = service
        self.grace_s = float(grace_s)
        self._clock = clock
        self._requested = threading.Event()
        self._lock = threading.Lock()
        self._steps: list[_Step] = []
        self._probes: list[tuple[str, Callable[[], str]]] = []
        self._reason = ""
        self._current: str | None = None
        self._pending: list[str] = []
        self._stopping = False

    # -- registration --------------------------------------------------------------------------

    def add(self, name: str, stop: Callable[[float], object]) -> None:
        """Run `stop(seconds_it_may_take)` when the process stops, after the steps added before."""
        with self._lock:
            self._steps.append(_Step(name, stop))

    def add_close(self, name: str, resource: Closeable) -> None:
        """Call `resource.close()` when the process stops, after the steps added before."""
        self.add(name, lambda _seconds: resource.close())

    def probe(self, name: str, still_running: Callable[[], str]) -> None:
        """`still_running()` describes work still in flight ("" when none); quoted if the deadline
        passes."""
        with self._lock:
            self._probes.append((name, still_running))

    # -- signals -------------------------------------------------------------------------------

    def install(self) -> GracefulShutdown:
        """Handle SIGTERM and SIGINT (from the main thread only, as Python requires)."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self._stopping:
            log.error("%s: %s while stopping: exiting now; %s", self.service, name, self._unfinished())
            exit_now(EXIT_UNCLEAN)
        self.request(name)

    def request(self, reason: str) -> None:
        """Ask the process to stop (what a signal does); callable from any thread."""
        with self._lock:
            if not self._reason:
                self._reason = reason
        self._requested.set()

    @property
    def requested(self) -> bool:
        return self._requested.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until a stop is requested (True) or timeout_s passed (False)."""
        deadline = None if timeout_s is None else self._clock() + timeout_s
        while not self._requested.wait(0.5):  # short waits: the main thread stays responsive
            if deadline is not None and self._clock() >= deadline:
                return False
        return True

    # -- stopping ------------------------------------------------------------------------------

    def run(self) -> Stopped:
        """Run the stop steps within the grace period (see the module doc)."""
        with self._lock:
            steps = list(self._steps)
            self._stopping = True
            self._pending = [s.name for s in steps]
            reason = self._reason or "requested"
        deadline = self._clock() + self.grace_s
        reserve_s = min(_MAX_RESERVE_S, self.grace_s / 10)
        log.info(
            "%s shutting down (%s): no new work; waiting up to %.1fs for work in flight",
            self.service,
            reason,
            self.grace_s,
        )
        failed: list[str] = []

        def work() -> None:
            for i, step in enumerate(steps):
                with self._lock:
                    self._current = step.name
                    self._pending.remove(step.name)
                later = reserve_s if i < len(steps) - 1 else 0.0
                try:
                    step.stop(max(0.0, deadline - self._clock() - later))
                except Exception:
                    log.exception("%s: stopping %s failed", self.service, step.name)
                    failed.append(step.name)
            with self._lock:
                self._current = None

        worker = threading.Thread(target=work, name="furlong-shutdown", daemon=True)
        worker.start()
        worker.join(max(0.0, deadline - self._clock()))
        if worker.is_alive():
            log.error(
                "%s: shutdown deadline of %.1fs passed; exiting anyway; %s",
                self.service,
                self.grace_s,
                self._unfinished(),
            )
            return Stopped(EXIT_UNCLEAN, in_time=False, seconds_left=0.0)
        left_s = max(0.0, deadline - self._clock())
        if failed:
            log.error("%s stopped; these stop steps failed: %s", self.service, ", ".join(failed))
            return Stopped(EXIT_UNCLEAN, in_time=True, seconds_left=left_s)
        log.info("%s stopped cleanly (%.1fs before the deadline)", self.service, left_s)
        return Stopped(EXIT_OK, in_time=True, seconds_left=left_s)

    def _unfinished(self) -> str:
        with self._lock:
            current, pending, probes = self._current, list(self._pending), list(self._probes)
        running = []
        for name, still_running in probes:
            try:
                what = still_running()
            except Exception as exc:  # noqa: BLE001 - a probe must not hide the rest of the report
                what = f"unknown ({type(exc).__name__}: {exc})"
            if what:
                running.append(f"{name}: {what}")
        return (
            f"still running: {current or 'nothing'}"
            + (f" [{'; '.join(running)}]" if running else "")
            + (f"; not reached: {', '.join(pending)}" if pending else "")
        )


def exit_now(code: int) -> None:
    """Exit the process at once with `code`, log records written: threads still busy (a handler
    that ignores cancellation, a non-daemon pool) cannot hold it."""
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    os._exit(code)
