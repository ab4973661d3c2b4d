"""The events stream over real HTTP on 127.0.0.1 (uvicorn, httpx, real Redis, fake services): a
run driven through pause, checkpoint and resume, and a finished run whose events an earlier
controller wrote as flat strings, both arrive with JSON numbers and booleans; the SSE `event:` is
the payload's type and `id:` the stream id; a client resuming after the final event gets an
empty stream that ends."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import redis
from controller_fakes import fake_stack
from polling import wait_until
from run_event_samples import EVERY_EVENT_TYPES, rewrite_as_legacy, run_through_every_event

from furlong.controller.auth import ApiTokens
from furlong.controller.config import DriverTimeouts
from furlong.controller.run_store import RunStore, events_key
from furlong.controller.server import HttpServer, build_controller

pytestmark = pytest.mark.integration

ADMIN = "events-admin-token-0123456789abcdef"
SPEC = {
    "name": "sse",
    "model": "/models/tiny",
    "task": "addition",
    "steps": 2,
    "prompts_per_step": 2,
    "samples_per_prompt": 2,
}
INTEGER_FIELDS = ("current_step", "policy_version")
BOOLEAN_FIELDS = ("stop_requested", "pause_requested")


@pytest.fixture
def served(redis_url):
    fakes = fake_stack()
    store = RunStore.from_url(redis_url)
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    legacy = run_through_every_event(store, "legacy")
    legacy_ids = rewrite_as_legacy(raw, store, legacy)
    controller = build_controller(
        store,
        fakes.services,
        ApiTokens(admin=(ADMIN,)),
        lambda: {"redis": True},
        DriverTimeouts(end_s=1.0, pause_poll_s=0.02),
    )
    server = HttpServer(controller.app).start()
    http = httpx.Client(base_url=server.url, timeout=10.0, headers={"Authorization": f"Bearer {ADMIN}"})
    yield http, fakes, raw, (legacy, legacy_ids)
    for gate in fakes.faults.gates.values():
        gate.set()
    controller.close(10)
    server.stop()
    http.close()
    store.close()
    raw.close()


def read_stream(http: httpx.Client, run_id: str, last_event_id: str | None = None) -> tuple[str, list[dict]]:
    """The raw text of the run's event stream (read to its end) and its messages."""
    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    with http.stream("GET", f"/v1/runs/{run_id}/events", headers=headers, timeout=5.0) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        text = resp.read().decode()
    messages = []
    for block in text.split("\n\n"):
        if block.strip():
            messages.append(dict(line.split(": ", 1) for line in block.split("\n")))
    return text, messages


def assert_typed(text: str, messages: list[dict]) -> list[dict]:
    payloads = [json.loads(m["data"]) for m in messages]
    for message, payload in zip(messages, payloads, strict=True):
        assert message["event"] == payload["type"]
        for name in INTEGER_FIELDS:
            assert type(payload[name]) is int, (name, payload)
        for name in BOOLEAN_FIELDS:
            assert type(payload[name]) is bool, (name, payload)
        assert type(payload["time"]) is float
        if payload["type"] == "checkpoint":
            assert type(payload["checkpoint_step"]) is int
    # on the wire: JSON literals, never quoted strings
    assert '"pause_requested": true' in text and '"stop_requested": false' in text
    assert '"current_step": "' not in text and '_requested": "' not in text
    return payloads


def test_a_driven_run_streams_json_numbers_and_booleans(served):
    http, fakes, raw, _ = served
    fakes.faults.gates["train_step"] = gate = threading.Event()
    run_id = http.post("/v1/runs", json=SPEC).json()["run_id"]
    wait_until(lambda: http.get(f"/v1/runs/{run_id}").json()["state"] == "running", what="run to run")
    http.post(f"/v1/runs/{run_id}/pause")
    gate.set()
    wait_until(lambda: http.get(f"/v1/runs/{run_id}").json()["state"] == "paused", what="run to pause")
    assert http.post(f"/v1/runs/{run_id}/checkpoint").status_code == 200
    http.post(f"/v1/runs/{run_id}/resume")
    text, messages = read_stream(http, run_id)  # follows the run to its end
    payloads = assert_typed(text, messages)
    assert [m["id"] for m in messages] == [entry_id for entry_id, _ in raw.xrange(events_key(run_id))]
    kinds = [(p["type"], p["state"], p["current_step"], p["pause_requested"]) for p in payloads]
    assert ("request", "running", 0, True) in kinds  # the pause request
    assert ("step", "running", 1, True) in kinds
    assert ("state", "paused", 1, True) in kinds
    assert [(p["checkpoint_step"], p["policy_version"]) for p in payloads if p["type"] == "checkpoint"] == [
        (1, 1)
    ]
    assert [p["current_step"] for p in payloads if p["type"] == "step"] == [1, 2]
    assert payloads[-1]["state"] == "succeeded" and payloads[-1]["pause_requested"] is False
    # resuming after the final event: nothing more, and the stream ends
    assert read_stream(http, run_id, last_event_id=messages[-1]["id"]) == ("", [])
    assert [m["id"] for m in read_stream(http, run_id, last_event_id=messages[-3]["id"])[1]] == [
        m["id"] for m in messages[-2:]
    ]


def test_events_an_earlier_controller_wrote_stream_typed(served):
    http, _, _, (run_id, ids) = served
    text, messages = read_stream(http, run_id)
    payloads = assert_typed(text, messages)
    assert [m["id"] for m in messages] == ids  # the entry no event decodes from is skipped
    assert [p["type"] for p in payloads] == EVERY_EVENT_TYPES
    checkpoint = payloads[EVERY_EVENT_TYPES.index("checkpoint")]
    assert (checkpoint["checkpoint_step"], checkpoint["checkpoint_path"]) == (1, f"/checkpoints/{run_id}")
    assert payloads[-1]["state"] == "cancelled" and payloads[-1]["stop_requested"] is True
