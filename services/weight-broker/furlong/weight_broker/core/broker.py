"""The broker's state machine: per run, the registered engines, the latest policy version and who has
acknowledged it, the committed version, and each engine's event subscription.

Rules (one lock, so every method is thread-safe):
- Versions strictly increase per run; a new version cannot begin while the previous one is pending
  (the trainer would be overwriting bytes engines are still reading). Both are ConflictError.
- A version commits once every engine that must acknowledge it did so with ok=True. The set is the
  engines registered when it began, plus engines registering while it is pending, minus engines that
  unregister (or whose watch subscription closes) before acknowledging.
- An ok=False acknowledgement re-sends the PUBLISHED event to that engine; after `max_ack_attempts`
  failed attempts the version fails with the engine's error.
- A subscriber gets the latest version as PUBLISHED when it subscribes, unless that version failed.
- Runs start implicitly (first registration or version) and end explicitly; an ended run id stays
  ended, so engines that outlive their run cannot bring it back.
Knows nothing about gRPC, NIXL or metrics backends: observers receive plain calls.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from furlong.core.errors import ConflictError, NotFoundError
from furlong.core.weights import Manifest
from furlong.weight_broker.core.events import (
    NO_VERSION, EventKind, VersionEventInfo, VersionStatusInfo, WeightSourceInfo)
from furlong.weight_broker.core.subscription import EventSubscription

log = logging.getLogger(__name__)

_MAX_REMEMBERED_FAILURES = 64


class BrokerObserver(Protocol):
    """Receives what happened, for metrics. Called under the broker's lock: must be quick and must
    not call back into the broker."""

    def engines_changed(self, run_id: str, num_engines: int) -> None: ...
    def ack_received(self, run_id: str, engine_id: str, version: int, ok: bool,
                     transfer_seconds: float, transfer_bytes: int) -> None: ...
    def version_committed(self, run_id: str, version: int, commit_seconds: float) -> None: ...
    def version_failed(self, run_id: str, version: int, reason: str) -> None: ...
    def run_ended(self, run_id: str) -> None: ...


class _Phase(enum.Enum):
    PENDING = "pending"
    COMMITTED = "committed"
    FAILED = "failed"


@dataclass
class _Version:
    manifest: Manifest
    source: WeightSourceInfo
    began_at: float
    required: set[str]
    acked: set[str] = field(default_factory=set)
    failed_attempts: dict[str, int] = field(default_factory=dict)
    phase: _Phase = _Phase.PENDING
    failure: str = ""

    @property
    def number(self) -> int:
        return self.manifest.version


@dataclass
class _Run:
    run_id: str
    engines: set[str] = field(default_factory=set)
    subscriptions: dict[str, EventSubscription] = field(default_factory=dict)
    latest: _Version | None = None
    committed_version: int = NO_VERSION
    failures: dict[int, str] = field(default_factory=dict)


def _require_id(kind: str, value: str) -> None:
    if not value:
        raise ValueError(f"empty {kind}")


class BrokerCore:
    def __init__(self, max_ack_attempts: int = 3, observer: BrokerObserver | None = None) -> None:
        if max_ack_attempts < 1:
            raise ValueError(f"max_ack_attempts {max_ack_attempts} < 1")
        self._max_ack_attempts = max_ack_attempts
        self._observer = observer
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._runs: dict[str, _Run] = {}
        self._ended_runs: set[str] = set()   # a run id is never reused once ended

    # -- engines -----------------------------------------------------------------------------------

    def register_engine(self, run_id: str, engine_id: str) -> int:
        """Idempotent. Returns the run's committed version (-1 none)."""
        _require_id("run_id", run_id)
        _require_id("engine_id", engine_id)
        with self._lock:
            run = self._open_run(run_id)
            if engine_id not in run.engines:
                run.engines.add(engine_id)
                if run.latest is not None and run.latest.phase is _Phase.PENDING:
                    run.latest.required.add(engine_id)
                log.info("run %s: engine %s registered (%d engines)", run_id, engine_id,
                         len(run.engines))
                self._notify_engines(run)
            return run.committed_version

    def unregister_engine(self, run_id: str, engine_id: str) -> None:
        """Idempotent. Ends the engine's subscription; a pending version no longer waits for it."""
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                return
            sub = run.subscriptions.pop(engine_id, None)
            if sub is not None:
                sub.end()
            self._drop_engine(run, engine_id, "unregistered")

    def subscribe(self, run_id: str, engine_id: str) -> EventSubscription:
        """Events for a registered engine, starting with the latest version unless it failed. A newer
        subscription of the same engine ends the older one; closing the current one unregisters."""
        with self._lock:
            run = self._run(run_id)
            if engine_id not in run.engines:
                raise NotFoundError(f"engine {engine_id} is not registered for run {run_id}")
            old = run.subscriptions.get(engine_id)
            if old is not None:
                old.end()
            sub = EventSubscription(run_id, engine_id, self._subscription_closed)
            run.subscriptions[engine_id] = sub
            latest = run.latest
            if latest is not None and latest.phase is not _Phase.FAILED:
                sub.put(_published(run_id, latest))
            elif latest is not None:
                log.info("run %s: engine %s watches; latest version %d failed, nothing to pull yet",
                         run_id, engine_id, latest.number)
            return sub

    def _subscription_closed(self, sub: EventSubscription) -> None:
        with self._lock:
            run = self._runs.get(sub.run_id)
            if run is not None and run.subscriptions.get(sub.engine_id) is sub:
                del run.subscriptions[sub.engine_id]
                self._drop_engine(run, sub.engine_id, "watch closed")

    def _drop_engine(self, run: _Run, engine_id: str, why: str) -> None:
        if engine_id not in run.engines:
            return
        run.engines.discard(engine_id)
        log.info("run %s: engine %s removed (%s); %d engines left", run.run_id, engine_id, why,
                 len(run.engines))
        self._notify_engines(run)
        latest = run.latest
        if latest is not None and latest.phase is _Phase.PENDING:
            latest.required.discard(engine_id)
            latest.acked.discard(engine_id)
            latest.failed_attempts.pop(engine_id, None)
            if latest.required <= latest.acked:
                self._commit(run)

    # -- versions ----------------------------------------------------------------------------------

    def begin_version(self, run_id: str, manifest: Manifest, source: WeightSourceInfo) -> list[str]:
        """Record a new version and publish it to subscribers. Returns the engines that must
        acknowledge it (sorted); with none, the version commits at once."""
        _require_id("run_id", run_id)
        if source.size_bytes < manifest.total_bytes:
            raise ValueError(f"run {run_id}: source region of {source.size_bytes} bytes is smaller "
                             f"than version {manifest.version}'s {manifest.total_bytes} bytes")
        with self._lock:
            run = self._open_run(run_id)
            latest = run.latest
            if latest is not None and manifest.version <= latest.number:
                raise ConflictError(f"run {run_id}: version {manifest.version} is not newer than "
                                    f"version {latest.number} ({latest.phase.value})")
            if latest is not None and latest.phase is _Phase.PENDING:
                raise ConflictError(f"run {run_id}: cannot begin version {manifest.version} while "
                                    f"version {latest.number} is pending on engines "
                                    f"{sorted(latest.required - latest.acked)}")
            version = _Version(manifest, source, time.monotonic(), required=set(run.engines))
            run.latest = version
            log.info("run %s: version %d begun, %d bytes, waiting for %s", run_id, manifest.version,
                     manifest.total_bytes, sorted(version.required))
            event = _published(run_id, version)
            for sub in run.subscriptions.values():
                sub.put(event)
            if not version.required:
                self._commit(run)
            return sorted(version.required)

    def ack_version(self, run_id: str, engine_id: str, version: int, ok: bool, error: str = "",
                    transfer_seconds: float = 0.0, transfer_bytes: int = 0) -> int:
        """Record an engine's verdict on the latest version. Returns the committed version."""
        if transfer_seconds < 0 or transfer_bytes < 0:
            raise ValueError(f"negative transfer figures: {transfer_seconds} s, {transfer_bytes} bytes")
        with self._lock:
            run = self._run(run_id)
            if engine_id not in run.engines:
                raise NotFoundError(f"engine {engine_id} is not registered for run {run_id}")
            latest = run.latest
            if latest is None or version > latest.number:
                raise NotFoundError(f"run {run_id}: version {version} was never begun (latest "
                                    f"{NO_VERSION if latest is None else latest.number})")
            if version < latest.number:
                raise ConflictError(f"run {run_id}: acknowledgement of version {version} from engine "
                                    f"{engine_id} is stale; latest is version {latest.number}")
            if self._observer is not None:
                self._observer.ack_received(run_id, engine_id, version, ok, transfer_seconds,
                                            transfer_bytes)
            if latest.phase is _Phase.FAILED:
                raise ConflictError(f"run {run_id}: version {version} already failed: {latest.failure}")
            if ok:
                latest.acked.add(engine_id)
                if latest.phase is _Phase.PENDING and latest.required <= latest.acked:
                    self._commit(run)
            else:
                self._failed_ack(run, latest, engine_id, error)
            return run.committed_version

    def _failed_ack(self, run: _Run, version: _Version, engine_id: str, error: str) -> None:
        attempts = version.failed_attempts.get(engine_id, 0) + 1
        version.failed_attempts[engine_id] = attempts
        log.warning("run %s: engine %s could not take version %d (attempt %d of %d): %s",
                    run.run_id, engine_id, version.number, attempts, self._max_ack_attempts, error)
        if attempts < self._max_ack_attempts:
            sub = run.subscriptions.get(engine_id)
            if sub is not None:
                sub.put(_published(run.run_id, version))
        elif version.phase is _Phase.PENDING and engine_id in version.required:
            self._fail(run, f"engine {engine_id} failed version {version.number} after {attempts} "
                            f"attempts: {error}")
        else:
            log.error("run %s: engine %s gave up on committed version %d: %s", run.run_id,
                      engine_id, version.number, error)

    def _commit(self, run: _Run) -> None:
        version = run.latest
        assert version is not None and version.phase is _Phase.PENDING
        version.phase = _Phase.COMMITTED
        run.committed_version = version.number
        commit_seconds = time.monotonic() - version.began_at
        log.info("run %s: version %d committed after %.3f s", run.run_id, version.number,
                 commit_seconds)
        event = VersionEventInfo(run.run_id, EventKind.COMMITTED, version.number)
        for sub in run.subscriptions.values():
            sub.put(event)
        if self._observer is not None:
            self._observer.version_committed(run.run_id, version.number, commit_seconds)
        self._cond.notify_all()

    def _fail(self, run: _Run, reason: str) -> None:
        version = run.latest
        assert version is not None and version.phase is _Phase.PENDING
        version.phase = _Phase.FAILED
        version.failure = reason
        run.failures[version.number] = reason
        while len(run.failures) > _MAX_REMEMBERED_FAILURES:
            del run.failures[min(run.failures)]
        log.error("run %s: version %d failed: %s", run.run_id, version.number, reason)
        if self._observer is not None:
            self._observer.version_failed(run.run_id, version.number, reason)
        self._cond.notify_all()

    def wait_committed(self, run_id: str, version: int, timeout_s: float) -> VersionStatusInfo:
        """Block until the committed version is at least `version`. ConflictError if that version
        failed, TimeoutError after timeout_s, NotFoundError if the run is unknown or ends."""
        if not timeout_s >= 0 or timeout_s == float("inf"):
            raise ValueError(f"timeout_s {timeout_s} is not a finite number >= 0")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                run = self._run(run_id)
                if version in run.failures:
                    raise ConflictError(f"run {run_id}: {run.failures[version]}")
                if run.committed_version >= version:
                    return self._status(run)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    status = self._status(run)
                    raise TimeoutError(f"run {run_id}: version {version} not committed after "
                                       f"{timeout_s} s (committed {status.committed_version}, "
                                       f"pending engines {list(status.pending_engine_ids)})")
                self._cond.wait(remaining)

    def get_version(self, run_id: str) -> VersionStatusInfo:
        with self._lock:
            return self._status(self._run(run_id))

    def end_run(self, run_id: str) -> None:
        """Forget a run; idempotent. Its subscriptions end, its waiters get NotFoundError, and
        registering or beginning a version for it again is a ConflictError."""
        with self._lock:
            run = self._runs.pop(run_id, None)
            self._ended_runs.add(run_id)
            if run is None:
                return
            for sub in run.subscriptions.values():
                sub.end()
            log.info("run %s ended at committed version %d", run_id, run.committed_version)
            if self._observer is not None:
                self._observer.run_ended(run_id)
            self._cond.notify_all()

    def shutdown(self) -> None:
        """End every subscription (the service is stopping); state is kept."""
        with self._lock:
            for run in self._runs.values():
                for sub in run.subscriptions.values():
                    sub.end()

    # -- helpers -----------------------------------------------------------------------------------

    def _run(self, run_id: str) -> _Run:
        run = self._runs.get(run_id)
        if run is None:
            state = "has ended" if run_id in self._ended_runs else "is not known to the weight broker"
            raise NotFoundError(f"run {run_id} {state}")
        return run

    def _open_run(self, run_id: str) -> _Run:
        """The run's state, created on first use; ConflictError for a run that has ended."""
        if run_id in self._ended_runs:
            raise ConflictError(f"run {run_id} has ended")
        return self._runs.setdefault(run_id, _Run(run_id))

    def _status(self, run: _Run) -> VersionStatusInfo:
        latest = run.latest
        pending = () if latest is None else tuple(sorted(run.engines - latest.acked))
        return VersionStatusInfo(
            run_id=run.run_id,
            latest_version=NO_VERSION if latest is None else latest.number,
            committed_version=run.committed_version,
            engine_ids=tuple(sorted(run.engines)),
            pending_engine_ids=pending,
        )

    def _notify_engines(self, run: _Run) -> None:
        if self._observer is not None:
            self._observer.engines_changed(run.run_id, len(run.engines))


def _published(run_id: str, version: _Version) -> VersionEventInfo:
    return VersionEventInfo(run_id, EventKind.PUBLISHED, version.number, version.manifest,
                            version.source)
