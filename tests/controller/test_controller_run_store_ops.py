"""RunStore: pages with equal creation times, events recorded with each change, idempotency
under concurrent creation, deletion. Real Redis."""

from __future__ import annotations

import threading

import pytest
import redis

from furlong.controller.core.run_state import RunState
from furlong.controller.run_spec import parse_run_spec
from furlong.controller.run_store import RunStore, decode_cursor, encode_cursor
from furlong.core.errors import ConflictError

pytestmark = pytest.mark.integration


@pytest.fixture
def store(redis_url):
    s = RunStore(redis.Redis.from_url(redis_url, decode_responses=True), clock=lambda: 100.0)
    yield s
    s.close()


def spec(name: str = "r"):
    return parse_run_spec({"name": name, "model": "/m", "task": "addition", "steps": 3})


def test_pages_are_complete_and_disjoint_when_creation_times_tie(store):
    ids = {store.create(spec(f"r{i}")).run_id for i in range(23)}  # all at t=100.0
    seen, cursor = [], None
    while True:
        page, cursor = store.list_page(None, 5, cursor)
        seen += [r.run_id for r in page]
        if cursor is None:
            break
    assert len(seen) == len(set(seen)) == 23 and set(seen) == ids
    assert seen == sorted(ids, reverse=True)
    store.transition(seen[3], RunState.CANCELLED)
    assert [r.run_id for r in store.list_page(RunState.CANCELLED, 5)[0]] == [seen[3]]
    assert store.list_page(RunState.RUNNING, 5) == ([], None)


@pytest.mark.unit
def test_cursor_codec():
    assert decode_cursor(encode_cursor(12.5, "a-1")) == (12.5, "a-1")
    for bad in ("", "!!", encode_cursor(1.0, "x")[:-3], "WzEsMl0"):  # "[1,2]"
        with pytest.raises(ValueError, match="malformed cursor"):
            decode_cursor(bad)


def test_every_change_is_an_event_in_order(store):
    run = store.create(spec())
    store.transition(run.run_id, RunState.STARTING)
    store.request_pause(run.run_id)
    store.request_pause(run.run_id)  # idempotent: no second event
    store.request_resume(run.run_id)
    store.request_stop(run.run_id)
    kinds = [
        (e.TYPE.value, e.state, e.pause_requested, e.stop_requested)
        for _, e in store.events(run.run_id).events
    ]
    assert kinds == [
        ("created", RunState.PENDING, False, False),
        ("state", RunState.STARTING, False, False),
        ("request", RunState.STARTING, True, False),
        ("request", RunState.STARTING, False, False),
        ("request", RunState.STARTING, False, True),
    ]
    first_id = store.events(run.run_id).events[0][0]
    assert len(store.events(run.run_id, after=first_id).events) == 4
    page = store.events(run.run_id, count=2)
    assert len(page.events) == 2 and page.num_entries == 2 and page.last_id == page.events[-1][0]


def test_pause_on_a_pending_run_is_refused(store):
    run = store.create(spec())
    with pytest.raises(ConflictError, match="only a starting or running run can be paused"):
        store.request_pause(run.run_id)


def test_concurrent_idempotent_creates_make_one_run(store):
    results, barrier = [], threading.Barrier(8)

    def create():
        barrier.wait()
        results.append(store.create_idempotent(spec(), "key-1", "fp"))

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len({run.run_id for run, _ in results}) == 1
    assert sorted(replayed for _, replayed in results) == [False] + [True] * 7
    assert len(store.list_runs()) == 1
    with pytest.raises(ConflictError, match="different request body"):
        store.create_idempotent(spec(), "key-1", "other")
