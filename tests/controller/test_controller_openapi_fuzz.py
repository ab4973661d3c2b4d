"""Schemathesis against the served OpenAPI document: every generated request (positive and
negative) to a real server on 127.0.0.1 must get a documented status, content type and body, and
never a 5xx. A final test checks that at least 1000 requests were made."""

from __future__ import annotations

import httpx
import pytest
import redis
import schemathesis
from controller_fakes import fake_stack
from hypothesis import HealthCheck, given, settings

from furlong.controller.auth import ApiTokens
from furlong.controller.config import DriverTimeouts
from furlong.controller.run_store import RunStore
from furlong.controller.server import HttpServer, build_controller

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ADMIN = "fuzz-admin-token-0123456789abcdef"
EXAMPLES_PER_OPERATION = 130
REQUIRED_REQUESTS = 1000
calls: list[int] = []


@pytest.fixture(scope="module")
def server(redis_server_url):
    redis.Redis.from_url(redis_server_url).flushall()
    fakes = fake_stack()
    store = RunStore.from_url(redis_server_url)
    controller = build_controller(
        store,
        fakes.services,
        ApiTokens(admin=(ADMIN,)),
        lambda: {"redis": True},
        DriverTimeouts(end_s=1.0),
    )
    http = HttpServer(controller.app).start()
    yield http
    controller.close(10)
    http.stop()
    store.close()


def test_api_conforms_to_its_openapi_document(server):
    api = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    headers = {"Authorization": f"Bearer {ADMIN}"}
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) == 15

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def check(case):
            response = case.call(base_url=server.url, headers=headers, timeout=10)
            calls.append(response.status_code)
            assert response.status_code < 500, (case.method, case.path, response.text)
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
    assert httpx.get(f"{server.url}/healthz").status_code == 200
