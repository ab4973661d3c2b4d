"""Runs submitted runs on one background thread, one at a time, in submission order.

A run waits in `pending` until the thread takes it. On start, `recover()` queues the runs a previous
controller process left active (their driver is gone) to resume from their last checkpoint
(`RunDriver.resume`: a run whose spec allows no recovery, or that was already stopping, is ended on
the services and finished instead), ahead of the runs left pending, which are re-queued. `close()`
asks the active run to stop and waits for its teardown, bounded by a deadline; runs still queued
stay pending in Redis.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading

from furlong.controller.core.run_state import ACTIVE_STATES, RunState
from furlong.controller.driver import RunDriver
from furlong.controller.run_store import RunStore
from furlong.core.errors import FurlongError

log = logging.getLogger(__name__)


class _Shutdown(enum.Enum):
    """The queue item that ends the loop (an enum member, so that `is` narrows the item's type)."""

    TOKEN = "shutdown"


_SHUTDOWN = _Shutdown.TOKEN


class RunExecutor:
    def __init__(self, store: RunStore, driver: RunDriver) -> None:
        self._store = store
        self._driver = driver
        self._queue: queue.Queue[tuple[str, str] | _Shutdown] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="furlong-run-executor", daemon=True)
        self._lock = threading.Lock()
        self._active: str | None = None
        self._closing = False

    @property
    def active_run(self) -> str | None:
        with self._lock:
            return self._active

    def start(self) -> RunExecutor:
        self._thread.start()
        return self

    def submit(self, run_id: str) -> None:
        """Queue a pending run; it starts once every run submitted before it has finished."""
        self._queue.put(("run", run_id))

    def recover(self) -> list[str]:
        """Queue runs left active by a previous process to resume (first), and re-queue pending
        ones, oldest first; returns the re-queued pending run ids."""
        runs = sorted(self._store.list_runs(), key=lambda r: r.created_at)
        for run in runs:
            if run.state in ACTIVE_STATES:
                log.info(
                    "run %s was %s when the previous controller stopped; resuming it",
                    run.run_id,
                    run.state.value,
                )
                self._queue.put(("resume", run.run_id))
        requeued = [run.run_id for run in runs if run.state == RunState.PENDING]
        for run_id in requeued:
            self.submit(run_id)
        if requeued:
            log.info("re-queued %d pending runs: %s", len(requeued), requeued)
        return requeued

    def close(self, timeout_s: float = 60.0) -> bool:
        """Stop taking runs, ask the active one to stop, and wait up to timeout_s for the thread;
        True when it finished in time."""
        with self._lock:
            self._closing = True
            active = self._active
        if active is not None:
            try:
                self._store.request_stop(active)
            except FurlongError as exc:
                log.warning("could not request stop of run %s: %s", active, exc)
        self._queue.put(_SHUTDOWN)
        if not self._thread.is_alive():
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            with self._lock:
                if item is _SHUTDOWN or self._closing:
                    return  # runs still queued stay pending in Redis for the next process
                kind, run_id = item
                self._active = run_id if kind in ("run", "resume") else None
            try:
                if kind == "end":
                    self._driver.end_on_services(run_id)
                    continue
                run = self._driver.resume(run_id) if kind == "resume" else self._driver.execute(run_id)
                log.info("run %s finished: %s %s", run_id, run.state.value, run.reason)
            except Exception:
                log.exception("run %s could not be executed", run_id)
            finally:
                with self._lock:
                    self._active = None
