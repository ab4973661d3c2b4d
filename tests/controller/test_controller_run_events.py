"""Run events: each type round-trips through a real Redis stream entry with real types, entries of
the earlier flat-string format still decode, undecodable entries are skipped, and each event's
JSON matches the schema the OpenAPI document serves for its type."""

from __future__ import annotations

import json
import logging

import jsonschema
import pytest
import redis
from run_event_samples import (
    EVERY_EVENT_TYPES,
    legacy_fields,
    rewrite_as_legacy,
    run_through_every_event,
    sample_events,
)

from furlong.controller import api_models
from furlong.controller.core.run_state import RunState
from furlong.controller.run_events import (
    EVENT_CLASSES,
    EventDecodeError,
    StepEvent,
    decode_fields,
    encode_fields,
    event_from_dict,
)
from furlong.controller.run_store import RunStore, events_key

pytestmark = pytest.mark.integration


@pytest.fixture
def client(redis_url):
    c = redis.Redis.from_url(redis_url, decode_responses=True)
    yield c
    c.close()


def through_redis(client: redis.Redis, fields: dict[str, str]) -> dict[str, str]:
    entry_id = client.xadd("test:events", fields)
    [(_, read)] = client.xrange("test:events", entry_id, entry_id)
    return read


def assert_real_types(event) -> None:
    for name, declared in {"current_step": int, "policy_version": int, "time": float}.items():
        assert type(getattr(event, name)) is declared, (name, getattr(event, name))
    assert type(event.stop_requested) is bool and type(event.pause_requested) is bool
    assert isinstance(event.state, RunState)


def test_every_event_type_has_a_sample():
    assert sorted(type(e).__name__ for e in sample_events()) == sorted(c.__name__ for c in EVENT_CLASSES)


@pytest.mark.parametrize("event", sample_events(), ids=lambda e: e.TYPE.value)
def test_each_event_type_round_trips_through_a_redis_entry_with_real_types(client, event):
    fields = encode_fields(event)
    assert fields["format"] == "2"
    stored = json.loads(fields["data"])
    assert stored == event.to_dict() and stored["type"] == event.TYPE.value
    assert type(stored["current_step"]) is int and type(stored["pause_requested"]) is bool
    decoded = decode_fields(through_redis(client, fields))
    assert decoded == event and type(decoded) is type(event)
    assert_real_types(decoded)
    assert event_from_dict(stored) == event


@pytest.mark.parametrize("event", sample_events(), ids=lambda e: e.TYPE.value)
def test_each_event_type_decodes_from_the_earlier_flat_string_entry(client, event):
    fields = legacy_fields(event)
    assert all(isinstance(v, str) for v in fields.values()) and "format" not in fields
    decoded = decode_fields(through_redis(client, fields))
    assert decoded == event
    assert_real_types(decoded)


def test_a_legacy_entry_as_an_earlier_controller_wrote_it_decodes_with_real_types():
    entry = {
        "type": "step",
        "state": "running",
        "reason": "",
        "current_step": "4",
        "policy_version": "4",
        "stop_requested": "0",
        "pause_requested": "1",
        "time": "1767000012.345",
    }
    event = decode_fields(entry)
    assert event == StepEvent(
        state=RunState.RUNNING,
        reason="",
        current_step=4,
        policy_version=4,
        stop_requested=False,
        pause_requested=True,
        time=1767000012.345,
    )
    assert json.loads(json.dumps(event.to_dict()))["pause_requested"] is True


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"type": "promoted", "state": "running"}, "unknown event type 'promoted'"),
        ({"format": "3", "data": "{}"}, "unknown event entry format '3'"),
        ({"format": "2", "data": "not json"}, "without a JSON object"),
        ({"format": "2"}, "without a JSON object"),
        ({"format": "2", "data": "[1, 2]"}, "must be a JSON object"),
        (
            {**legacy_fields(sample_events()[2]), "current_step": "two"},
            "'current_step' must be a whole number",
        ),
        (
            {**legacy_fields(sample_events()[2]), "current_step": "-1"},
            "current_step must be >= 0, got -1",
        ),
        ({**legacy_fields(sample_events()[2]), "pause_requested": "yes"}, "must be '0' or '1'"),
        ({**legacy_fields(sample_events()[2]), "time": "nan"}, "'time' must be a finite number"),
        ({**legacy_fields(sample_events()[2]), "state": "exploded"}, "unknown run state 'exploded'"),
        ({k: v for k, v in legacy_fields(sample_events()[3]).items() if k != "checkpoint_path"}, "without"),
    ],
)
def test_entries_that_are_no_event_raise_naming_the_value(fields, words):
    with pytest.raises(EventDecodeError, match=words):
        decode_fields(fields)


@pytest.mark.parametrize(
    ("name", "value", "words"),
    [
        ("current_step", "3", "must be an integer"),
        ("current_step", True, "must be an integer"),
        ("current_step", -2, "must be >= 0"),
        ("pause_requested", 0, "must be a boolean"),
        ("time", "1.5", "must be a finite number"),
        ("reason", None, "must be a string"),
    ],
)
def test_typed_entries_are_checked_strictly(name, value, words):
    data = {**sample_events()[2].to_dict(), name: value}
    with pytest.raises(EventDecodeError, match=words):
        decode_fields({"format": "2", "data": json.dumps(data)})


def test_the_store_skips_undecodable_entries_with_a_warning_and_reads_past_them(redis_url, client, caplog):
    store = RunStore(client)
    run_id = run_through_every_event(store, "legacy")
    ids = rewrite_as_legacy(client, store, run_id)
    with caplog.at_level(logging.WARNING, logger="furlong.controller.run_store"):
        page = store.events(run_id)
    assert [e.TYPE.value for _, e in page.events] == EVERY_EVENT_TYPES
    assert [i for i, _ in page.events] == ids
    assert page.num_entries == len(ids) + 1 and page.last_id == ids[-1]
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "cannot be decoded" in caplog.text and "'current_step' must be a whole number" in caplog.text
    # a page of only the bad entry still moves the cursor past it
    bad_only = store.events(run_id, after=ids[-2], count=1)
    assert bad_only.events == [] and bad_only.num_entries == 1 and bad_only.last_id != ids[-2]
    assert store.events(run_id, after=bad_only.last_id).events[0][0] == ids[-1]
    assert client.xlen(events_key(run_id)) == len(ids) + 1  # nothing was deleted


def test_the_store_writes_every_event_type_as_typed_entries(client):
    store = RunStore(client)
    run_id = run_through_every_event(store, "typed")
    entries = client.xrange(events_key(run_id))
    assert {tuple(sorted(fields)) for _, fields in entries} == {("data", "format")}
    events = [e for _, e in store.events(run_id).events]
    assert [e.TYPE.value for e in events] == EVERY_EVENT_TYPES
    for event in events:
        assert_real_types(event)
    checkpoint = events[EVERY_EVENT_TYPES.index("checkpoint")]
    assert (checkpoint.checkpoint_step, checkpoint.checkpoint_path) == (1, f"/checkpoints/{run_id}")
    recovery = events[EVERY_EVENT_TYPES.index("recovery")]
    assert (recovery.current_step, recovery.policy_version) == (1, 1)
    assert recovery.reason.startswith("resumed from step 1 after step 2")
    assert events[-1].state == RunState.CANCELLED and events[-1].stop_requested is True


@pytest.mark.parametrize("event", sample_events(), ids=lambda e: e.TYPE.value)
def test_each_event_matches_its_served_schema_and_the_string_typed_form_does_not(event):
    components = api_models.event_components()
    schema = components[type(event).__name__]
    jsonschema.validate(event.to_dict(), schema)
    union = {"$ref": "#/components/schemas/RunEvent", "components": {"schemas": components}}
    jsonschema.validate(event.to_dict(), union)
    stringly = json.loads(json.dumps(legacy_fields(event)))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(stringly, schema)
    for other in EVENT_CLASSES:
        if other is not type(event):
            assert not jsonschema.Draft202012Validator(components[other.__name__]).is_valid(event.to_dict())
