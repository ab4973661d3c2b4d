"""The broker's state machine: per run, the registered engines, the latest policy version, which
rounds of it are staged and who pulled them, who acknowledged it, who was fenced out of it, the
committed version, and each engine's event subscription.

Rules (one lock, so every method is thread-safe):
- Versions strictly increase per run; a new version cannot begin while the previous one is pending
  (the trainer would be overwriting bytes engines are still reading). Both are ConflictError.
- A version is staged in rounds (`stage_round`, in order). A round can be staged once every engine
  still required has pulled the previous one (`ack_round`), unless the source holds all rounds.
- A version commits once every engine that must acknowledge it did so with ok=True. The set is the
  engines registered when it began, plus engines registering while they can still take all of it
  (round 0 still staged, or a source that holds all rounds), minus engines that unregister, whose
  watch closes, or that are fenced.
- An ok=False acknowledgement (of a round or of the version) re-sends what the engine needs to try
  again; after `max_ack_attempts` failed attempts, or when it has not acknowledged the current stage
  within `ack_timeout_s`, the engine is fenced: told so (FENCED), dropped from the run and from the
  version, which commits for the others. If every engine that had to take a version was fenced and
  none took it, the version fails.
- A subscriber gets the latest version (PUBLISHED plus its staged rounds) when it subscribes, if it
  can still take all of it.
- Runs start implicitly (first registration or version) and end explicitly; an ended run id stays
  ended, so engines that outlive their run cannot bring it back.
Knows nothing about gRPC, NIXL or metrics backends: observers receive plain calls.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from furlong.core.errors import ConflictError, NotFoundError
from furlong.core.weight_shards import ShardLayout
from furlong.core.weight_versions import (
    NO_VERSION,
    EventKind,
    RoundAck,
    VersionAck,
    VersionEventInfo,
    VersionStatusInfo,
    WeightSourceInfo,
)
from furlong.core.weights import Manifest
from furlong.weight_broker.core.subscription import EventSubscription
from furlong.weight_broker.core.versions import NO_ROUND, Phase, Run, Version, published, round_ready

log = logging.getLogger(__name__)

_MAX_REMEMBERED_FAILURES = 64
# A relayed run R is published to R + UPSTREAM_SUFFIX (furlong.weight_broker.relay), where the relay
# is the engine; the engines of R pull from the relay.
UPSTREAM_SUFFIX = "~upstream"


class BrokerObserver(Protocol):
    """Receives what happened, for metrics. Called under the broker's lock: must be quick and must
    not call back into the broker."""

    def engines_changed(self, run_id: str, num_engines: int) -> None: ...
    def ack_received(
        self,
        run_id: str,
        engine_id: str,
        version: int,
        ok: bool,
        transfer_seconds: float,
        transfer_bytes: int,
        lane: str,
    ) -> None: ...
    def engine_fenced(self, run_id: str, engine_id: str, version: int, reason: str) -> None: ...
    def version_committed(self, run_id: str, version: int, commit_seconds: float) -> None: ...
    def version_failed(self, run_id: str, version: int, reason: str) -> None: ...
    def run_ended(self, run_id: str) -> None: ...


def _require_id(kind: str, value: str) -> None:
    if not value:
        raise ValueError(f"empty {kind}")


class BrokerCore:
    def __init__(
        self,
        max_ack_attempts: int = 3,
        observer: BrokerObserver | None = None,
        *,
        ack_timeout_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_ack_attempts < 1:
            raise ValueError(f"max_ack_attempts {max_ack_attempts} < 1")
        if not ack_timeout_s > 0:
            raise ValueError(f"ack_timeout_s {ack_timeout_s} is not > 0")
        self._max_ack_attempts = max_ack_attempts
        self._ack_timeout_s = ack_timeout_s
        self._clock = clock
        self._observer = observer
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._runs: dict[str, Run] = {}
        self._ended_runs: set[str] = set()  # a run id is never reused once ended

    # -- engines -----------------------------------------------------------------------------------

    def register_engine(self, run_id: str, engine_id: str, shard_layout: ShardLayout | None = None) -> int:
        """Idempotent. shard_layout: the tensors the engine holds when they differ from the
        published ones (None: as published); a later registration replaces it. Returns the run's
        committed version (-1 none)."""
        _require_id("run_id", run_id)
        _require_id("engine_id", engine_id)
        with self._lock:
            run = self._open_run(run_id)
            if shard_layout is None:
                run.layouts.pop(engine_id, None)
            else:
                run.layouts[engine_id] = shard_layout
            if engine_id not in run.engines:
                run.engines.add(engine_id)
                latest = run.latest
                if (
                    latest is not None
                    and latest.phase is Phase.PENDING
                    and latest.can_join(engine_id, shard_layout)
                ):
                    latest.required.add(engine_id)
                log.info("run %s: engine %s registered (%d engines)", run_id, engine_id, len(run.engines))
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
        """Events for a registered engine, starting with the latest version if it can still take all
        of it. A newer subscription of the same engine ends the older one; closing the current one
        unregisters the engine."""
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
            if (
                latest is not None
                and latest.can_join(engine_id, run.layouts.get(engine_id))
                and (latest.phase is Phase.COMMITTED or engine_id in latest.required)
            ):
                for event in latest.events_for_newcomer(run_id):
                    sub.put(event)
            elif latest is not None:
                log.info(
                    "run %s: engine %s watches; it cannot take version %d (%s), waits for the next one",
                    run_id,
                    engine_id,
                    latest.number,
                    latest.phase.value,
                )
            return sub

    def _subscription_closed(self, sub: EventSubscription) -> None:
        with self._lock:
            run = self._runs.get(sub.run_id)
            if run is not None and run.subscriptions.get(sub.engine_id) is sub:
                del run.subscriptions[sub.engine_id]
                self._drop_engine(run, sub.engine_id, "watch closed")

    def destinations(self, run_id: str) -> list[ShardLayout]:
        """The distinct shard layouts of the run's registered engines (by layout id), for which a
        version must carry round digests (Manifest.destinations). For the upstream run of a
        relayed run, the layouts of the relayed run's engines too: the relay passes the manifest
        on unchanged, so their digests must come from the trainer."""
        with self._lock:
            runs = [self._run(run_id)]
            if run_id.endswith(UPSTREAM_SUFFIX):
                relayed = self._runs.get(run_id[: -len(UPSTREAM_SUFFIX)])
                if relayed is not None:
                    runs.append(relayed)
            found = {
                layout.layout_id: layout
                for run in runs
                for engine_id, layout in run.layouts.items()
                if engine_id in run.engines
            }
            return [found[key] for key in sorted(found)]

    def _drop_engine(self, run: Run, engine_id: str, why: str) -> None:
        if engine_id not in run.engines:
            return
        run.engines.discard(engine_id)
        run.layouts.pop(engine_id, None)
        log.info(
            "run %s: engine %s removed (%s); %d engines left", run.run_id, engine_id, why, len(run.engines)
        )
        self._notify_engines(run)
        latest = run.latest
        if latest is not None and latest.phase is Phase.PENDING:
            latest.required.discard(engine_id)
            latest.acked.discard(engine_id)
            latest.failed_attempts.pop(engine_id, None)
            self._settle(run)

    # -- versions ----------------------------------------------------------------------------------

    def begin_version(self, run_id: str, manifest: Manifest, source: WeightSourceInfo) -> list[str]:
        """Record a new version and publish it to subscribers. Returns the engines that must
        acknowledge it (sorted); with none, the version commits at once."""
        _require_id("run_id", run_id)
        needed = (
            manifest.total_bytes
            if source.holds_all_rounds
            else max(r.bucket_offset_bytes + r.size_bytes for r in manifest.rounds)
        )
        if source.size_bytes < needed:
            raise ValueError(
                f"run {run_id}: source region of {source.size_bytes} bytes is smaller "
                f"than the {needed} bytes version {manifest.version} stages in it"
            )
        with self._lock:
            run = self._open_run(run_id)
            latest = run.latest
            if latest is not None and manifest.version <= latest.number:
                raise ConflictError(
                    f"run {run_id}: version {manifest.version} is not newer than "
                    f"version {latest.number} ({latest.phase.value})"
                )
            if latest is not None and latest.phase is Phase.PENDING:
                raise ConflictError(
                    f"run {run_id}: cannot begin version {manifest.version} while "
                    f"version {latest.number} is pending on engines "
                    f"{sorted(latest.required - latest.acked)}"
                )
            now = self._clock()
            version = Version(manifest, source, now, required=set(), staged_at=now)
            for engine_id in sorted(run.engines):
                layout = run.layouts.get(engine_id)
                if version.covers(layout):
                    version.required.add(engine_id)
                else:
                    log.warning(
                        "run %s: version %d has no checksums for the shard layout %s of "
                        "engine %s (registered after the trainer asked for destinations); "
                        "it takes the next version",
                        run_id,
                        manifest.version,
                        layout.layout_id if layout else "",
                        engine_id,
                    )
            run.latest = version
            log.info(
                "run %s: version %d begun, %d bytes in %d rounds, waiting for %s",
                run_id,
                manifest.version,
                manifest.total_bytes,
                version.num_rounds,
                sorted(version.required),
            )
            run.broadcast(published(run_id, version), only=version.required)
            if not version.required:
                self._commit(run)
            return sorted(version.required)

    def stage_round(self, run_id: str, version: int, index: int) -> list[str]:
        """The source staged round `index` of the pending `version`: tell the engines to pull it.
        Rounds are staged in order; unless the source holds all rounds, the previous round must have
        been pulled by every engine still required (ConflictError otherwise). Returns the engines
        that must pull it (sorted)."""
        with self._lock:
            run = self._run(run_id)
            current = self._latest_alive(run, version)
            if index != current.staged_round + 1 or index >= current.num_rounds:
                raise ConflictError(
                    f"run {run_id}: version {version} cannot stage round {index} "
                    f"after round {current.staged_round} of {current.num_rounds}"
                )
            if index > 0 and not current.source.holds_all_rounds:
                waiting = current.pending_on_round(index - 1)
                if waiting:
                    raise ConflictError(
                        f"run {run_id}: version {version} round {index - 1} is still "
                        f"being pulled by engines {sorted(waiting)}"
                    )
            current.staged_round = index
            current.staged_at = self._clock()
            run.broadcast(round_ready(run_id, version, index), only=current.required)
            self._cond.notify_all()
            return sorted(current.pending_on_round(index))

    def ack_round(self, ack: RoundAck) -> None:
        """Record an engine's verdict on one round it pulled (ok: bytes verified). The transfer
        figures are informative; the version acknowledgement carries the totals."""
        run_id, engine_id, version, index = ack.run_id, ack.engine_id, ack.version, ack.index
        with self._lock:
            run = self._run(run_id)
            current = self._acked_version(run, engine_id, version)
            if not 0 <= index <= current.staged_round:
                raise ConflictError(
                    f"run {run_id}: engine {engine_id} acknowledged round {index} of "
                    f"version {version}, staged up to {current.staged_round}"
                )
            # Transfer figures reach the observer once, with the version's acknowledgement.
            if ack.ok:
                current.round_acks.setdefault(index, set()).add(engine_id)
                self._cond.notify_all()
            else:
                retry = [round_ready(run_id, version, index)] if index in current.resident_rounds() else []
                self._failed_attempt(run, current, engine_id, f"round {index}: {ack.error}", retry)

    def wait_round(self, run_id: str, version: int, index: int, timeout_s: float) -> list[str]:
        """Block until every engine still required pulled round `index` of `version`. Engines that
        have not after timeout_s (or after the broker's ack timeout) are fenced, and the call returns
        normally. Returns the engines fenced out of the version so far (sorted). ConflictError if the
        version failed or is not the pending one."""
        _check_timeout(timeout_s)
        deadline = self._clock() + timeout_s
        with self._cond:
            while True:
                run = self._run(run_id)
                current = run.latest
                if current is None or current.number != version:
                    raise ConflictError(f"run {run_id}: version {version} is not the latest")
                if current.phase is Phase.FAILED:
                    raise ConflictError(f"run {run_id}: {current.failure}")
                if current.phase is Phase.COMMITTED or not current.pending_on_round(index):
                    return sorted(current.fenced)
                now = self._clock()
                if now >= deadline:
                    for engine_id in sorted(current.pending_on_round(index)):
                        self._fence(
                            run,
                            current,
                            engine_id,
                            f"did not pull round {index} of version {version} within {timeout_s} s",
                        )
                    continue
                self._fence_overdue(run)
                self._cond.wait(min(deadline - now, self._until_overdue(run)))

    def ack_version(self, ack: VersionAck) -> int:
        """Record an engine's verdict on the latest version. Returns the committed version."""
        with self._lock:
            run = self._run(ack.run_id)
            latest = self._acked_version(run, ack.engine_id, ack.version)
            if self._observer is not None:
                self._observer.ack_received(
                    ack.run_id,
                    ack.engine_id,
                    ack.version,
                    ack.ok,
                    ack.transfer_seconds,
                    ack.transfer_bytes,
                    ack.lane,
                )
            if ack.ok:
                latest.acked.add(ack.engine_id)
                self._settle(run)
            else:
                self._failed_attempt(
                    run, latest, ack.engine_id, ack.error, latest.events_for_newcomer(ack.run_id)
                )
            return run.committed_version

    def _acked_version(self, run: Run, engine_id: str, version: int) -> Version:
        if engine_id not in run.engines:
            raise NotFoundError(f"engine {engine_id} is not registered for run {run.run_id}")
        latest = run.latest
        if latest is None or version > latest.number:
            raise NotFoundError(
                f"run {run.run_id}: version {version} was never begun (latest "
                f"{NO_VERSION if latest is None else latest.number})"
            )
        if version < latest.number:
            raise ConflictError(
                f"run {run.run_id}: acknowledgement of version {version} from "
                f"engine {engine_id} is stale; latest is version {latest.number}"
            )
        if latest.phase is Phase.FAILED:
            raise ConflictError(f"run {run.run_id}: version {version} already failed: {latest.failure}")
        return latest

    def _failed_attempt(
        self, run: Run, version: Version, engine_id: str, error: str, retry: list[VersionEventInfo]
    ) -> None:
        attempts = version.failed_attempts.get(engine_id, 0) + 1
        version.failed_attempts[engine_id] = attempts
        log.warning(
            "run %s: engine %s could not take version %d (attempt %d of %d): %s",
            run.run_id,
            engine_id,
            version.number,
            attempts,
            self._max_ack_attempts,
            error,
        )
        if attempts < self._max_ack_attempts:
            run.send(engine_id, retry)
        elif version.phase is Phase.PENDING and engine_id in version.required:
            self._fence(
                run,
                version,
                engine_id,
                f"engine {engine_id} failed version {version.number} after {attempts} attempts: {error}",
            )
        else:
            log.error(
                "run %s: engine %s gave up on committed version %d: %s",
                run.run_id,
                engine_id,
                version.number,
                error,
            )

    def _fence(self, run: Run, version: Version, engine_id: str, reason: str) -> None:
        """Take engine_id out of the pending version and the run; it may register again and will
        take the next version."""
        version.fenced[engine_id] = reason
        version.required.discard(engine_id)
        log.error(
            "run %s: engine %s fenced out of version %d: %s", run.run_id, engine_id, version.number, reason
        )
        if self._observer is not None:
            self._observer.engine_fenced(run.run_id, engine_id, version.number, reason)
        sub = run.subscriptions.pop(engine_id, None)
        if sub is not None:
            sub.put(VersionEventInfo(run.run_id, EventKind.FENCED, version.number, reason=reason))
            sub.end()
        if engine_id in run.engines:
            run.engines.discard(engine_id)
            self._notify_engines(run)
        self._settle(run)

    def _settle(self, run: Run) -> None:
        """Commit the pending version once everyone still required acknowledged it; fail it when
        every engine was fenced and none took it."""
        latest = run.latest
        if latest is None or latest.phase is not Phase.PENDING:
            return
        if latest.fenced and not latest.required and not latest.acked:
            self._fail(
                run, "every engine was fenced: " + "; ".join(latest.fenced[e] for e in sorted(latest.fenced))
            )
        elif latest.required <= latest.acked:
            self._commit(run)
        self._cond.notify_all()

    def _fence_overdue(self, run: Run) -> None:
        latest = run.latest
        if latest is None or latest.phase is not Phase.PENDING:
            return
        if self._clock() < latest.staged_at + self._ack_timeout_s:
            return
        last_stage = latest.staged_round in (NO_ROUND, latest.num_rounds - 1)
        overdue = (
            latest.required - latest.acked if last_stage else latest.pending_on_round(latest.staged_round)
        )
        for engine_id in sorted(overdue):
            what = "version" if last_stage else f"round {latest.staged_round} of version"
            self._fence(
                run,
                latest,
                engine_id,
                f"did not acknowledge {what} {latest.number} within {self._ack_timeout_s} s",
            )

    def _until_overdue(self, run: Run) -> float:
        latest = run.latest
        if latest is None or latest.phase is not Phase.PENDING:
            return self._ack_timeout_s
        return max(0.001, latest.staged_at + self._ack_timeout_s - self._clock())

    def _commit(self, run: Run) -> None:
        version = run.latest
        assert version is not None and version.phase is Phase.PENDING
        version.phase = Phase.COMMITTED
        run.committed_version = version.number
        commit_seconds = self._clock() - version.began_at
        log.info("run %s: version %d committed after %.3f s", run.run_id, version.number, commit_seconds)
        run.broadcast(VersionEventInfo(run.run_id, EventKind.COMMITTED, version.number))
        if self._observer is not None:
            self._observer.version_committed(run.run_id, version.number, commit_seconds)
        self._cond.notify_all()

    def _fail(self, run: Run, reason: str) -> None:
        version = run.latest
        assert version is not None and version.phase is Phase.PENDING
        version.phase = Phase.FAILED
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
        failed, TimeoutError after timeout_s, NotFoundError if the run is unknown or ends. Engines
        overdue by the broker's ack timeout are fenced meanwhile."""
        _check_timeout(timeout_s)
        deadline = self._clock() + timeout_s
        with self._cond:
            while True:
                run = self._run(run_id)
                self._fence_overdue(run)
                if version in run.failures:
                    raise ConflictError(f"run {run_id}: {run.failures[version]}")
                if run.committed_version >= version:
                    return self._status(run)
                remaining = deadline - self._clock()
                if remaining <= 0:
                    status = self._status(run)
                    raise TimeoutError(
                        f"run {run_id}: version {version} not committed after "
                        f"{timeout_s} s (committed {status.committed_version}, "
                        f"pending engines {list(status.pending_engine_ids)})"
                    )
                self._cond.wait(min(remaining, self._until_overdue(run)))

    def get_version(self, run_id: str) -> VersionStatusInfo:
        with self._lock:
            run = self._run(run_id)
            self._fence_overdue(run)
            return self._status(run)

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

    def _run(self, run_id: str) -> Run:
        run = self._runs.get(run_id)
        if run is None:
            state = "has ended" if run_id in self._ended_runs else "is not known to the weight broker"
            raise NotFoundError(f"run {run_id} {state}")
        return run

    def _latest_alive(self, run: Run, version: int) -> Version:
        latest = run.latest
        if latest is None or latest.number != version:
            raise NotFoundError(f"run {run.run_id}: version {version} is not the latest version")
        if latest.phase is Phase.FAILED:
            raise ConflictError(f"run {run.run_id}: version {version} failed: {latest.failure}")
        return latest  # a committed version may still stage rounds for engines that join late

    def _open_run(self, run_id: str) -> Run:
        """The run's state, created on first use; ConflictError for a run that has ended."""
        if run_id in self._ended_runs:
            raise ConflictError(f"run {run_id} has ended")
        return self._runs.setdefault(run_id, Run(run_id))

    def _status(self, run: Run) -> VersionStatusInfo:
        latest = run.latest
        pending = () if latest is None else tuple(sorted(run.engines - latest.acked))
        return VersionStatusInfo(
            run_id=run.run_id,
            latest_version=NO_VERSION if latest is None else latest.number,
            committed_version=run.committed_version,
            engine_ids=tuple(sorted(run.engines)),
            pending_engine_ids=pending,
            fenced_engine_ids=() if latest is None else tuple(sorted(latest.fenced)),
        )

    def _notify_engines(self, run: Run) -> None:
        if self._observer is not None:
            self._observer.engines_changed(run.run_id, len(run.engines))


def _check_timeout(timeout_s: float) -> None:
    if not timeout_s >= 0 or timeout_s == float("inf"):
        raise ValueError(f"timeout_s {timeout_s} is not a finite number >= 0")
