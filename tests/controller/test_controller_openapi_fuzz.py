"""Schemathesis against the served OpenAPI document: every generated request (positive and
negative) to a real server on 127.0.0.1 must get a documented status, content type and body, and
never a 5xx. Two finished runs are seeded that went through every event type, one of them with its
events in the earlier flat-string format (and an entry that no event decodes from); the reads of
a run are sent to them as well as to generated ids, so schemathesis' checks of Server-Sent Events
(each event against `itemSchema`, the `data` against its `contentSchema`, the whole stream against
`schema`) see real streams. Final tests check that at least 1000 requests were made, that event
streams with data were among them, and that the checks reject a stream with string-typed payloads."""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass

import httpx
import pytest
import redis
import schemathesis
from controller_fakes import fake_stack
from hypothesis import HealthCheck, given, settings
from run_event_samples import EVERY_EVENT_TYPES, legacy_fields, rewrite_as_legacy, run_through_every_event
from schemathesis.core.failures import FailureGroup

from furlong.controller.auth import ApiTokens
from furlong.controller.config import DriverTimeouts
from furlong.controller.run_events import decode_fields
from furlong.controller.run_store import RunStore
from furlong.controller.server import HttpServer, build_controller

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ADMIN = "fuzz-admin-token-0123456789abcdef"
EXAMPLES_PER_OPERATION = 130
REQUIRED_REQUESTS = 1000
REQUIRED_EVENT_STREAMS = 30  # 200 answers of the events operation that carried events
EVENTS_PATH = "/v1/runs/{run_id}/events"
calls: list[int] = []
event_streams: collections.Counter[str] = collections.Counter()


@dataclass
class Served:
    url: str
    seeded: tuple[str, str]  # a finished run with typed events, and one with legacy events


@pytest.fixture(scope="module")
def server(redis_server_url):
    redis.Redis.from_url(redis_server_url).flushall()
    fakes = fake_stack()
    store = RunStore.from_url(redis_server_url)
    raw = redis.Redis.from_url(redis_server_url, decode_responses=True)
    # finished before the controller starts, so its executor leaves them alone
    typed = run_through_every_event(store, "seeded")
    legacy = run_through_every_event(store, "legacy")
    rewrite_as_legacy(raw, store, legacy)
    controller = build_controller(
        store,
        fakes.services,
        ApiTokens(admin=(ADMIN,)),
        lambda: {"redis": True},
        DriverTimeouts(end_s=1.0),
    )
    http = HttpServer(controller.app).start()
    yield Served(url=http.url, seeded=(typed, legacy))
    controller.close(10)
    http.stop()
    store.close()
    raw.close()


def test_api_conforms_to_its_openapi_document(server):
    api = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) == 15
    for operation in operations:
        fuzz(server, operation)


def fuzz(server: Served, operation) -> None:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    # reads of a run also go to the seeded runs (a third of the cases each); changes do not, as
    # they would change or delete them
    reads_a_run = operation.method == "get" and "{run_id}" in operation.path
    targets = (*server.seeded, None) if reads_a_run else (None,)
    sent = collections.Counter[str]()

    @given(case=operation.as_strategy())
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def check(case):
        target = targets[sent["cases"] % len(targets)]
        sent["cases"] += 1
        if target is not None:
            case.path_parameters["run_id"] = target
        response = case.call(base_url=server.url, headers=headers, timeout=10)
        calls.append(response.status_code)
        assert response.status_code < 500, (case.method, case.path, response.text)
        if operation.path == EVENTS_PATH and response.status_code == 200 and "data:" in response.text:
            event_streams["typed" if target == server.seeded[0] else "legacy"] += 1
        case.validate_response(
            response,
            excluded_checks=[
                # schema-valid bodies can still be semantically invalid (ranges, unknown task)
                schemathesis.checks.positive_data_acceptance,
            ],
        )

    check()


def test_enough_requests_were_generated(server):
    assert len(calls) >= REQUIRED_REQUESTS, len(calls)
    assert all(code < 500 for code in calls)
    assert sum(event_streams.values()) >= REQUIRED_EVENT_STREAMS, event_streams
    assert min(event_streams["typed"], event_streams["legacy"]) > 0, event_streams
    assert httpx.get(f"{server.url}/healthz").status_code == 200
    print(f"{len(calls)} requests, event streams with data: {dict(event_streams)}")


def events_case_and_stream(server: Served) -> tuple[schemathesis.Case, schemathesis.Response]:
    api = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    case = api[EVENTS_PATH]["GET"].Case(path_parameters={"run_id": server.seeded[0]})
    response = case.call(base_url=server.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert response.status_code == 200 and response.headers["content-type"][0].startswith("text/event-stream")
    return case, response


def with_content(response: schemathesis.Response, content: str) -> schemathesis.Response:
    return schemathesis.Response(
        status_code=200,
        headers=response.headers,
        content=content.encode(),
        request=response.request,
        elapsed=response.elapsed,
        verify=True,
    )


def sse_blocks(text: str) -> list[dict[str, str]]:
    blocks = []
    for block in text.strip().split("\n\n"):
        blocks.append(dict(line.split(": ", 1) for line in block.splitlines()))
    return blocks


def test_the_served_stream_passes_and_the_sse_checks_reject_string_typed_payloads(server):
    case, response = events_case_and_stream(server)
    blocks = sse_blocks(response.text)
    assert [b["event"] for b in blocks] == EVERY_EVENT_TYPES
    case.validate_response(response, checks=[schemathesis.checks.response_schema_conformance])

    def stringly(block: dict[str, str]) -> str:
        event = decode_fields({"format": "2", "data": block["data"]})
        return f"id: {block['id']}\nevent: {block['event']}\ndata: {json.dumps(legacy_fields(event))}\n\n"

    tampered = {
        "string-typed payload": "".join(stringly(b) for b in blocks),
        "event name not the payload's type": response.text.replace("event: step", "event: state", 1),
        "no id": response.text.replace(f"id: {blocks[0]['id']}\n", "", 1),
        "unknown event type": response.text.replace("event: created", "event: promoted", 1),
        "unknown payload field": response.text.replace('{"current_step"', '{"extra": 1, "current_step"', 1),
    }
    for what, content in tampered.items():
        assert content != response.text, what
        with pytest.raises(FailureGroup) as failure:
            case.validate_response(
                with_content(response, content), checks=[schemathesis.checks.response_schema_conformance]
            )
        assert "SSE event violates schema" in str(failure.value), (what, str(failure.value))
