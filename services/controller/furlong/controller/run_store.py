"""Runs and their per-step metrics in Redis.

Keys (all under `furlong:runs:`):
  furlong:runs:{run_id}          the run record, JSON (`Run.to_dict()`)
  furlong:runs:{run_id}:metrics  list of per-step records, JSON, in step order
  furlong:runs:{run_id}:events   stream of the run's events (`run_events`: creation, state changes,
                                 steps, checkpoints, requests, recovery), appended in the same
                                 transaction as the change; and the local stack's `service` events
  furlong:runs:_index            sorted set of run ids scored by creation time
  furlong:runs:_idem:{key}       JSON {fingerprint, run_id} of a POST with an Idempotency-Key (24 h)
  furlong:ledger:{run_id}:*      the run's sample ledger (`furlong.ledger.group_ledger`), deleted with it

Every change of a run is a compare-and-set (WATCH/MULTI), so a stop request and the run's driver
cannot overwrite each other, and every state change goes through the transition table. Redis
connection failures are raised as UnavailableError. Knows nothing about the services a run drives.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import logging
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any, cast

import redis
from redis.typing import EncodableT, FieldT

from furlong.controller.core.run_state import CheckpointRef, PolicyRef, Run, RunState
from furlong.controller.core.step_record import StepRecord
from furlong.controller.run_events import (
    EventDecodeError,
    EventPage,
    RunEvent,
    decode_fields,
    encode_fields,
    event_for_change,
    recovery_event,
    service_event,
)
from furlong.controller.run_spec import RunSpec
from furlong.core.errors import ConflictError, NotFoundError, UnavailableError
from furlong.ledger.group_ledger import GroupLedger, ledger_keys

log = logging.getLogger(__name__)

PREFIX = "furlong:runs:"
INDEX_KEY = PREFIX + "_index"
IDEMPOTENCY_TTL_S = 24 * 3600
EVENTS_MAXLEN = 10_000
_PAGE_SCAN = 200
_MAX_LIST_INDEX = 2**63 - 1


# redis-py types every reply as bytes | str (and xadd's fields as an invariant Dict of its unions):
# its annotations cannot follow `decode_responses`. This store's client decodes replies, so the
# casts below state the str replies the client gives.


def _stream_fields(event: RunEvent) -> dict[FieldT, EncodableT]:
    """The fields of event's stream entry, typed as xadd takes them."""
    return cast("dict[FieldT, EncodableT]", encode_fields(event))


def run_key(run_id: str) -> str:
    return f"{PREFIX}{run_id}"


def metrics_key(run_id: str) -> str:
    return f"{PREFIX}{run_id}:metrics"


def events_key(run_id: str) -> str:
    return f"{PREFIX}{run_id}:events"


def drained_key(run_id: str) -> str:
    """The set of the run's engine ids drained through the REST API (re-drained after a recovery)."""
    return f"{PREFIX}{run_id}:drained"


def idempotency_key(key: str) -> str:
    return f"{PREFIX}_idem:{hashlib.sha256(key.encode()).hexdigest()}"


def encode_cursor(score: float, run_id: str) -> str:
    return base64.urlsafe_b64encode(json.dumps([score, run_id]).encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[float, str]:
    """(score, run_id) of the last run of the previous page; ValueError for a malformed cursor."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        score, run_id = json.loads(raw)
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not isinstance(run_id, str):
            raise TypeError
        return float(score), run_id
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError):
        raise ValueError(f"malformed cursor {cursor[:64]!r}") from None


class RunStore:
    """Thread-safe (redis-py clients are); every method is one round trip or one CAS loop."""

    def __init__(self, client: redis.Redis, clock: Callable[[], float] = time.time) -> None:
        self._redis = client
        self._clock = clock

    @classmethod
    def from_url(cls, url: str, socket_timeout_s: float = 10.0) -> RunStore:
        return cls(
            redis.Redis.from_url(
                url,
                decode_responses=True,
                socket_timeout=socket_timeout_s,
                socket_connect_timeout=socket_timeout_s,
            )
        )

    def close(self) -> None:
        self._redis.close()

    def ledger(self, run_id: str) -> GroupLedger:
        """The run's sample ledger, on this store's Redis."""
        return GroupLedger(self._redis, run_id)

    def ping(self) -> bool:
        try:
            return bool(self._redis.ping())
        except redis.RedisError:
            return False

    def create(self, spec: RunSpec) -> Run:
        return self.create_idempotent(spec, None, "")[0]

    def create_idempotent(self, spec: RunSpec, key: str | None, fingerprint: str) -> tuple[Run, bool]:
        """Create a pending run; with an idempotency key, a repeat with the same fingerprint returns
        the run the key created (and True), a different fingerprint is a ConflictError."""
        now = self._clock()
        idem = idempotency_key(key) if key is not None else None
        with self._errors(), self._redis.pipeline() as pipe:
            for _ in range(8):
                run = Run(
                    run_id=f"{spec.name}-{secrets.token_hex(4)}",
                    spec=spec,
                    state=RunState.PENDING,
                    created_at=now,
                    updated_at=now,
                )
                rkey = run_key(run.run_id)
                try:
                    pipe.watch(rkey, *([idem] if idem else []))  # type: ignore[no-untyped-call]  # redis-py leaves Pipeline.watch unannotated
                    if idem is not None:
                        previous = pipe.get(idem)
                        if previous is not None:
                            pipe.unwatch()
                            return self._replay(json.loads(previous), fingerprint), True
                    if pipe.exists(rkey):
                        pipe.unwatch()
                        continue
                    pipe.multi()
                    pipe.set(rkey, json.dumps(run.to_dict()))
                    pipe.zadd(INDEX_KEY, {run.run_id: now})
                    pipe.xadd(
                        events_key(run.run_id),
                        _stream_fields(event_for_change(None, run)),
                        maxlen=EVENTS_MAXLEN,
                        approximate=True,
                    )
                    if idem is not None:
                        pipe.set(
                            idem,
                            json.dumps({"fingerprint": fingerprint, "run_id": run.run_id}),
                            ex=IDEMPOTENCY_TTL_S,
                        )
                    pipe.execute()
                except redis.WatchError:
                    continue
                log.info("created run %s (%s, %d steps)", run.run_id, spec.task, spec.steps)
                return run, False
        raise ConflictError(f"could not allocate a unique id for run name {spec.name!r}")

    def _replay(self, previous: dict[str, Any], fingerprint: str) -> Run:
        if previous["fingerprint"] != fingerprint:
            raise ConflictError(
                "Idempotency-Key was already used with a different request body "
                f"(it created run {previous['run_id']})"
            )
        try:
            return self.get(previous["run_id"])
        except NotFoundError:
            raise ConflictError(
                f"Idempotency-Key created run {previous['run_id']}, which has since been deleted"
            ) from None

    def get(self, run_id: str) -> Run:
        with self._errors():
            raw = self._redis.get(run_key(run_id))
        if raw is None:
            raise NotFoundError(f"run {run_id!r} not found")
        return Run.from_dict(json.loads(raw))

    def list_runs(self, state: RunState | None = None) -> list[Run]:
        """All runs, newest first, optionally only those in state."""
        with self._errors():
            ids = cast(list[str], self._redis.zrevrange(INDEX_KEY, 0, -1))  # decoded replies
            raws = self._redis.mget([run_key(i) for i in ids]) if ids else []
        runs = [Run.from_dict(json.loads(raw)) for raw in raws if raw is not None]
        return [r for r in runs if state is None or r.state == state]

    def list_page(
        self, state: RunState | None, limit: int, cursor: str | None = None
    ) -> tuple[list[Run], str | None]:
        """Up to limit runs, newest first, after cursor (from the previous page), optionally only
        those in state; and the cursor of the next page (None on the last page: a full page is only
        given a cursor when at least one more run follows it)."""
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        after = decode_cursor(cursor) if cursor else None
        page: list[Run] = []
        full_at: tuple[float, str] | None = None  # the page's last run, once the page is full
        offset = 0
        with self._errors():
            while True:
                high = "+inf" if after is None else after[0]
                batch = cast(  # decoded replies
                    list[tuple[str, float]],
                    self._redis.zrevrangebyscore(
                        INDEX_KEY, high, "-inf", start=offset, num=_PAGE_SCAN, withscores=True
                    ),
                )
                offset += len(batch)
                last_batch = len(batch) < _PAGE_SCAN
                if after is not None:  # same score: ids sort in reverse; keep those past the cursor
                    batch = [(i, sc) for i, sc in batch if sc < after[0] or i < after[1]]
                raws = self._redis.mget([run_key(i) for i, _ in batch]) if batch else []
                for (run_id, score), raw in zip(batch, raws):
                    if raw is None:
                        continue
                    run = Run.from_dict(json.loads(raw))
                    if state is not None and run.state != state:
                        continue
                    if full_at is not None:  # one more run follows the full page
                        return page, encode_cursor(*full_at)
                    page.append(run)
                    if len(page) == limit:
                        full_at = (score, run_id)
                if last_batch:
                    return page, None

    def delete(self, run_id: str) -> None:
        """Remove a finished run with its metrics and events; ConflictError for an unfinished one."""
        key = run_key(run_id)
        with self._errors(), self._redis.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)  # type: ignore[no-untyped-call]  # redis-py leaves Pipeline.watch unannotated
                    raw = pipe.get(key)
                    if raw is None:
                        raise NotFoundError(f"run {run_id!r} not found")
                    run = Run.from_dict(json.loads(raw))
                    if not run.state.terminal:
                        raise ConflictError(
                            f"run {run_id} is {run.state.value}; only finished runs "
                            "can be deleted (stop it first)"
                        )
                    pipe.multi()
                    pipe.delete(
                        key,
                        metrics_key(run_id),
                        events_key(run_id),
                        drained_key(run_id),
                        *ledger_keys(run_id),
                    )
                    pipe.zrem(INDEX_KEY, run_id)
                    pipe.execute()
                    log.info("deleted run %s", run_id)
                    return
                except redis.WatchError:
                    continue

    def record_drained(self, run_id: str, engine_id: str) -> None:
        """Remember that engine_id of run_id was drained, so that a recovery, which starts fresh
        engines, drains it again. NotFoundError for a run this store does not hold."""
        self.get(run_id)
        with self._errors():
            self._redis.sadd(drained_key(run_id), engine_id)

    def drained_engines(self, run_id: str) -> list[str]:
        """The engine ids of run_id drained through the REST API, sorted."""
        with self._errors():
            return sorted(cast("set[str]", self._redis.smembers(drained_key(run_id))))

    def active_run_ids(self) -> list[str]:
        """The runs not in a final state (pending ones included), newest first."""
        return [r.run_id for r in self.list_runs() if not r.state.terminal]

    def record_service_event(self, run_id: str, fields: Mapping[str, Any]) -> None:
        """Append a `service` event (a local-stack service exited, was restarted or given up on;
        fields: ServiceEvent's own) to the run's events; the run itself is not changed."""
        run = self.get(run_id)
        event = service_event(run, fields, self._clock())
        with self._errors():
            self._redis.xadd(
                events_key(run_id), _stream_fields(event), maxlen=EVENTS_MAXLEN, approximate=True
            )

    def events(self, run_id: str, after: str = "0-0", count: int = 100) -> EventPage:
        """The events of up to count stream entries recorded after stream id after, oldest first.
        An entry that decodes to no event (see `run_events`) is skipped with a warning."""
        with self._errors():
            entries = cast(  # decoded replies
                list[tuple[str, dict[str, str]]],
                self._redis.xrange(
                    events_key(run_id), f"({after}" if after != "0-0" else "-", "+", count=count
                ),
            )
        events: list[tuple[str, RunEvent]] = []
        for entry_id, fields in entries:
            try:
                events.append((entry_id, decode_fields(fields)))
            except EventDecodeError as exc:
                log.warning("run %s: skipping event %s that cannot be decoded: %s", run_id, entry_id, exc)
        return EventPage(
            events=events, last_id=entries[-1][0] if entries else after, num_entries=len(entries)
        )

    def transition(
        self, run_id: str, target: RunState, reason: str | None = None, expected: RunState | None = None
    ) -> Run:
        """Move the run to target (ConflictError if illegal, or if it is not in expected)."""

        def change(run: Run) -> Run:
            if expected is not None and run.state != expected:
                raise ConflictError(f"run {run_id}: is {run.state.value}, expected {expected.value}")
            return run.transitioned(target, self._clock(), reason)

        run = self._update(run_id, change)
        log.info("run %s -> %s%s", run_id, target.value, f" ({reason})" if reason else "")
        return run

    def request_stop(self, run_id: str) -> Run:
        """Cancel a pending run at once; flag a started one for its driver to stop between phases.
        Idempotent for a run that is already stopping; ConflictError for a finished one."""

        def change(run: Run) -> Run:
            if run.state == RunState.PENDING:
                return run.transitioned(RunState.CANCELLED, self._clock(), "stopped before it started")
            if run.state.terminal:
                raise ConflictError(f"run {run_id} already finished ({run.state.value})")
            return replace(run, stop_requested=True, updated_at=self._clock())

        run = self._update(run_id, change)
        log.info("stop requested for run %s (now %s)", run_id, run.state.value)
        return run

    def request_pause(self, run_id: str) -> Run:
        """Flag a starting or running run for its driver to pause before its next step. Idempotent
        for a run already paused or asked to; ConflictError in any other state."""

        def change(run: Run) -> Run:
            if run.state not in (RunState.STARTING, RunState.RUNNING, RunState.PAUSED) or run.stop_requested:
                raise ConflictError(
                    f"run {run_id} is {run.state.value}"
                    f"{' and stopping' if run.stop_requested else ''}; only a "
                    "starting or running run can be paused"
                )
            if run.pause_requested:
                return run
            return replace(run, pause_requested=True, updated_at=self._clock())

        run = self._update(run_id, change)
        log.info("pause requested for run %s (now %s)", run_id, run.state.value)
        return run

    def request_resume(self, run_id: str) -> Run:
        """Clear a pause request; the driver then leaves `paused`. ConflictError unless the run is
        paused or asked to pause."""

        def change(run: Run) -> Run:
            if not run.pause_requested or run.state.terminal:
                raise ConflictError(f"run {run_id} is {run.state.value} and not paused; nothing to resume")
            return replace(run, pause_requested=False, updated_at=self._clock())

        run = self._update(run_id, change)
        log.info("resume requested for run %s (now %s)", run_id, run.state.value)
        return run

    def record_checkpoint(self, run_id: str, checkpoint: CheckpointRef) -> Run:
        """Remember a checkpoint the trainer wrote for the run (whatever state the run reached in
        the meantime: the checkpoint exists either way); NotFoundError for an unknown run."""
        run = self._update(run_id, lambda run: replace(run, checkpoint=checkpoint, updated_at=self._clock()))
        log.info("run %s: checkpoint of step %d at %s", run_id, checkpoint.step, checkpoint.path)
        return run

    def record_policy(self, run_id: str, policy: PolicyRef) -> Run:
        """Remember a policy the trainer exported for the run; one of the same step (an export
        repeated after a recovery) is replaced. NotFoundError for an unknown run."""

        def change(run: Run) -> Run:
            kept = tuple(p for p in run.policies if (p.step, p.final) != (policy.step, policy.final))
            ordered = tuple(sorted((*kept, policy), key=lambda p: (p.step, p.final)))
            return replace(run, policies=ordered, updated_at=self._clock())

        run = self._update(run_id, change)
        log.info("run %s: policy of step %d exported to %s", run_id, policy.step, policy.path)
        return run

    def record_step(self, run_id: str, record: StepRecord) -> Run:
        """Append a completed step's record and advance the run's step and policy version."""

        def change(run: Run) -> Run:
            if run.state != RunState.RUNNING:
                raise ConflictError(f"run {run_id}: cannot record step {record.step} while {run.state.value}")
            if record.step != run.current_step + 1:
                raise ConflictError(
                    f"run {run_id}: step {record.step} recorded after step {run.current_step}"
                )
            return replace(
                run, current_step=record.step, policy_version=record.policy_version, updated_at=self._clock()
            )

        return self._update(run_id, change, push=(metrics_key(run_id), json.dumps(record.to_dict())))

    def rewind(
        self,
        run_id: str,
        step: int,
        policy_version: int,
        reason: str,
        restored: StepRecord | None = None,
    ) -> Run:
        """Recovery: the run goes back to `step` (its last checkpoint) now serving `policy_version`;
        the records of later steps are dropped and a `recovery` event names the reason. A checkpoint
        written just before a crash can be one step past the last recorded one (the controller died
        between the trainer's checkpoint and its own record): `restored`, the record of that step
        rebuilt from the checkpoint, is then appended in the same transaction, so every step that
        ran has exactly one record. A `restored` record of another step is a ValueError."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if restored is not None and restored.step != step:
            raise ValueError(f"restored record is of step {restored.step}, not the checkpoint's {step}")
        before = self.get(run_id)
        push = None
        if restored is not None and before.current_step == step - 1:
            push = (metrics_key(run_id), json.dumps(restored.to_dict()))

        def change(run: Run) -> Run:
            if run.state.terminal:
                raise ConflictError(f"run {run_id} already finished ({run.state.value})")
            if run.current_step != before.current_step:
                raise ConflictError(
                    f"run {run_id}: step changed from {before.current_step} to {run.current_step} "
                    "during its rewind"
                )
            return replace(run, current_step=step, policy_version=policy_version, updated_at=self._clock())

        run = self._update(
            run_id,
            change,
            push=push,
            trim=(metrics_key(run_id), step),
            describe=lambda _before, after: recovery_event(after, reason),
        )
        if push is not None:
            log.info("run %s: record of step %d restored from the trainer's checkpoint", run_id, step)
        log.info("run %s rewound to step %d (version %d): %s", run_id, step, policy_version, reason)
        return run

    def metrics(self, run_id: str, since: int = 0) -> list[StepRecord]:
        """The run's step records from index since (0 = the first step's)."""
        if since < 0:
            raise ValueError(f"since must be >= 0, got {since}")
        with self._errors():
            exists = self._redis.exists(run_key(run_id))
            # Redis list indices are signed 64-bit; any larger since is past the end all the same
            raws = self._redis.lrange(metrics_key(run_id), min(since, _MAX_LIST_INDEX), -1)
        if not exists:
            raise NotFoundError(f"run {run_id!r} not found")
        return [StepRecord.from_dict(json.loads(raw)) for raw in raws]

    def _update(
        self,
        run_id: str,
        change: Callable[[Run], Run],
        push: tuple[str, str] | None = None,
        trim: tuple[str, int] | None = None,
        describe: Callable[[Run, Run], RunEvent] | None = None,
    ) -> Run:
        """Apply change to the run in one compare-and-set, with the event describe (default
        `event_for_change`) makes of it; an unchanged run is written only with describe given."""
        key = run_key(run_id)
        with self._errors(), self._redis.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)  # type: ignore[no-untyped-call]  # redis-py leaves Pipeline.watch unannotated
                    raw = pipe.get(key)
                    if raw is None:
                        raise NotFoundError(f"run {run_id!r} not found")
                    before = Run.from_dict(json.loads(raw))
                    run = change(before)
                    if run == before and describe is None:
                        pipe.unwatch()
                        return run
                    pipe.multi()
                    pipe.set(key, json.dumps(run.to_dict()))
                    pipe.xadd(
                        events_key(run_id),
                        _stream_fields((describe or event_for_change)(before, run)),
                        maxlen=EVENTS_MAXLEN,
                        approximate=True,
                    )
                    if push is not None:
                        pipe.rpush(*push)
                    if trim is not None and trim[1] == 0:
                        pipe.delete(trim[0])
                    elif trim is not None:
                        pipe.ltrim(trim[0], 0, trim[1] - 1)
                    pipe.execute()
                    return run
                except redis.WatchError:
                    continue

    @staticmethod
    @contextlib.contextmanager
    def _errors() -> Iterator[None]:
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise UnavailableError(f"redis: {exc}") from exc
