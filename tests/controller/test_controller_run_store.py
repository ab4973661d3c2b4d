"""RunStore on a real Redis server."""

from __future__ import annotations

import threading

import pytest
import redis

from furlong.controller.core.run_state import RunState
from furlong.controller.core.step_record import StepRecord
from furlong.controller.run_spec import parse_run_spec
from furlong.controller.run_store import INDEX_KEY, RunStore, run_key
from furlong.core.errors import ConflictError, NotFoundError, UnavailableError

pytestmark = pytest.mark.integration


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def spec(name: str = "addition", steps: int = 3):
    return parse_run_spec({"name": name, "model": "/m", "task": "addition", "steps": steps})


def record(step: int, version: int) -> StepRecord:
    return StepRecord(
        step=step,
        reward_mean=0.5,
        loss=0.25,
        policy_version=version,
        samples=8,
        step_seconds=1.0,
        generate_seconds=0.5,
        train_seconds=0.4,
        sync_seconds=0.1,
        trainer_metrics={"grad_norm": 2.0},
    )


@pytest.fixture
def store(redis_url):
    s = RunStore(redis.Redis.from_url(redis_url, decode_responses=True), clock=Clock())
    yield s
    s.close()


def test_create_get_list(store, redis_url):
    a = store.create(spec("first"))
    b = store.create(spec("second"))
    assert a.run_id.startswith("first-") and a.state == RunState.PENDING
    assert store.get(a.run_id) == a
    assert [r.run_id for r in store.list_runs()] == [b.run_id, a.run_id]  # newest first
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    assert raw.exists(run_key(a.run_id)) and raw.zscore(INDEX_KEY, a.run_id) == a.created_at
    assert all(k.startswith("furlong:runs:") for k in raw.keys("*"))


def test_unknown_run_is_not_found(store):
    with pytest.raises(NotFoundError, match="nope"):
        store.get("nope")
    with pytest.raises(NotFoundError):
        store.transition("nope", RunState.STARTING)
    with pytest.raises(NotFoundError):
        store.metrics("nope")


def test_transitions_follow_the_table(store):
    run = store.create(spec())
    started = store.transition(run.run_id, RunState.STARTING, expected=RunState.PENDING)
    assert started.state == RunState.STARTING and started.started_at is not None
    with pytest.raises(ConflictError, match="starting -> succeeded"):
        store.transition(run.run_id, RunState.SUCCEEDED)
    with pytest.raises(ConflictError, match="expected pending"):
        store.transition(run.run_id, RunState.RUNNING, expected=RunState.PENDING)
    assert store.get(run.run_id).state == RunState.STARTING
    store.transition(run.run_id, RunState.FAILED, reason="trainer down")
    failed = store.get(run.run_id)
    assert (failed.state, failed.reason) == (RunState.FAILED, "trainer down")
    assert [r.run_id for r in store.list_runs(RunState.FAILED)] == [run.run_id]
    assert store.list_runs(RunState.RUNNING) == []


def test_record_step_appends_in_order(store):
    run = store.create(spec())
    with pytest.raises(ConflictError, match="while pending"):
        store.record_step(run.run_id, record(1, 1))
    store.transition(run.run_id, RunState.STARTING)
    store.transition(run.run_id, RunState.RUNNING)
    store.record_step(run.run_id, record(1, 1))
    after = store.record_step(run.run_id, record(2, 2))
    assert (after.current_step, after.policy_version) == (2, 2)
    with pytest.raises(ConflictError, match="step 4 recorded after step 2"):
        store.record_step(run.run_id, record(4, 4))
    steps = store.metrics(run.run_id)
    assert [s.step for s in steps] == [1, 2]
    assert steps[0].trainer_metrics == {"grad_norm": 2.0}
    assert [s.step for s in store.metrics(run.run_id, since=1)] == [2]
    assert store.metrics(run.run_id, since=5) == []


def test_stop_pending_cancels_started_flags_finished_conflicts(store):
    pending = store.create(spec("p"))
    cancelled = store.request_stop(pending.run_id)
    assert cancelled.state == RunState.CANCELLED and "before it started" in cancelled.reason
    started = store.create(spec("s"))
    store.transition(started.run_id, RunState.STARTING)
    flagged = store.request_stop(started.run_id)
    assert flagged.state == RunState.STARTING and flagged.stop_requested
    assert store.request_stop(started.run_id).stop_requested  # idempotent
    with pytest.raises(ConflictError, match="already finished"):
        store.request_stop(pending.run_id)


def test_concurrent_updates_are_not_lost(store):
    run = store.create(spec(steps=200))
    store.transition(run.run_id, RunState.STARTING)
    store.transition(run.run_id, RunState.RUNNING)
    errors = []

    def steps():
        try:
            for i in range(1, 41):
                store.record_step(run.run_id, record(i, i))
        except Exception as exc:  # noqa: BLE001 - the test thread reports it to the main thread
            errors.append(exc)

    writer = threading.Thread(target=steps)
    writer.start()
    store.request_stop(run.run_id)
    writer.join()
    final = store.get(run.run_id)
    assert errors == []
    assert final.stop_requested and final.current_step == 40
    assert len(store.metrics(run.run_id)) == 40


def test_unreachable_redis_is_unavailable():
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from furlong.rpc.ports import free_port

    s = RunStore(
        redis.Redis(
            host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0)
        )
    )
    assert s.ping() is False
    with pytest.raises(UnavailableError, match="redis"):
        s.get("x")
