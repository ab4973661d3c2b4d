"""Runs and their per-step metrics in Redis.

Keys (all under `furlong:runs:`):
  furlong:runs:{run_id}          the run record, JSON (`Run.to_dict()`)
  furlong:runs:{run_id}:metrics  list of per-step records, JSON, in step order
  furlong:runs:_index            sorted set of run ids scored by creation time

Every change of a run is a compare-and-set (WATCH/MULTI), so a stop request and the run's driver
cannot overwrite each other, and every state change goes through the transition table. Redis
connection failures are raised as UnavailableError. Knows nothing about the services a run drives.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from dataclasses import replace
from typing import Callable, Iterator

import redis

from furlong.core.errors import ConflictError, NotFoundError, UnavailableError

from furlong.controller.core.run_state import Run, RunState
from furlong.controller.core.step_record import StepRecord
from furlong.controller.run_spec import RunSpec

log = logging.getLogger(__name__)

PREFIX = "furlong:runs:"
INDEX_KEY = PREFIX + "_index"


def run_key(run_id: str) -> str:
    return f"{PREFIX}{run_id}"


def metrics_key(run_id: str) -> str:
    return f"{PREFIX}{run_id}:metrics"


class RunStore:
    """Thread-safe (redis-py clients are); every method is one round trip or one CAS loop."""

    def __init__(self, client: redis.Redis, clock: Callable[[], float] = time.time) -> None:
        self._redis = client
        self._clock = clock

    @classmethod
    def from_url(cls, url: str) -> "RunStore":
        return cls(redis.Redis.from_url(url, decode_responses=True, socket_timeout=10.0))

    def close(self) -> None:
        self._redis.close()

    def ping(self) -> bool:
        try:
            return bool(self._redis.ping())
        except redis.RedisError:
            return False

    def create(self, spec: RunSpec) -> Run:
        now = self._clock()
        with self._errors(), self._redis.pipeline() as pipe:
            for _ in range(8):
                run = Run(run_id=f"{spec.name}-{secrets.token_hex(4)}", spec=spec,
                          state=RunState.PENDING, created_at=now, updated_at=now)
                key = run_key(run.run_id)
                try:
                    pipe.watch(key)
                    if pipe.exists(key):
                        pipe.unwatch()
                        continue
                    pipe.multi()
                    pipe.set(key, json.dumps(run.to_dict()))
                    pipe.zadd(INDEX_KEY, {run.run_id: now})
                    pipe.execute()
                except redis.WatchError:
                    continue
                log.info("created run %s (%s, %d steps)", run.run_id, spec.task, spec.steps)
                return run
        raise ConflictError(f"could not allocate a unique id for run name {spec.name!r}")

    def get(self, run_id: str) -> Run:
        with self._errors():
            raw = self._redis.get(run_key(run_id))
        if raw is None:
            raise NotFoundError(f"run {run_id!r} not found")
        return Run.from_dict(json.loads(raw))

    def list_runs(self, state: RunState | None = None) -> list[Run]:
        """All runs, newest first, optionally only those in state."""
        with self._errors():
            ids = self._redis.zrevrange(INDEX_KEY, 0, -1)
            raws = self._redis.mget([run_key(i) for i in ids]) if ids else []
        runs = [Run.from_dict(json.loads(raw)) for raw in raws if raw is not None]
        return [r for r in runs if state is None or r.state == state]

    def transition(self, run_id: str, target: RunState, reason: str | None = None,
                   expected: RunState | None = None) -> Run:
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

    def record_step(self, run_id: str, record: StepRecord) -> Run:
        """Append a completed step's record and advance the run's step and policy version."""

        def change(run: Run) -> Run:
            if run.state != RunState.RUNNING:
                raise ConflictError(f"run {run_id}: cannot record step {record.step} while "
                                    f"{run.state.value}")
            if record.step != run.current_step + 1:
                raise ConflictError(f"run {run_id}: step {record.step} recorded after step "
                                    f"{run.current_step}")
            return replace(run, current_step=record.step, policy_version=record.policy_version,
                           updated_at=self._clock())

        return self._update(run_id, change, push=(metrics_key(run_id), json.dumps(record.to_dict())))

    def metrics(self, run_id: str, since: int = 0) -> list[StepRecord]:
        """The run's step records from index since (0 = the first step's)."""
        if since < 0:
            raise ValueError(f"since must be >= 0, got {since}")
        with self._errors():
            exists = self._redis.exists(run_key(run_id))
            raws = self._redis.lrange(metrics_key(run_id), since, -1)
        if not exists:
            raise NotFoundError(f"run {run_id!r} not found")
        return [StepRecord.from_dict(json.loads(raw)) for raw in raws]

    def _update(self, run_id: str, change: Callable[[Run], Run],
                push: tuple[str, str] | None = None) -> Run:
        key = run_key(run_id)
        with self._errors(), self._redis.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    raw = pipe.get(key)
                    if raw is None:
                        raise NotFoundError(f"run {run_id!r} not found")
                    run = change(Run.from_dict(json.loads(raw)))
                    pipe.multi()
                    pipe.set(key, json.dumps(run.to_dict()))
                    if push is not None:
                        pipe.rpush(*push)
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
