"""The REST API over a real uvicorn server on 127.0.0.1, real Redis, fake services."""

from __future__ import annotations

import logging
import threading

import httpx
import pytest
import redis
from controller_fakes import fake_stack
from polling import wait_until as wait_for

from furlong.controller.client import HttpControllerClient, InProcessControllerClient
from furlong.controller.config import DriverTimeouts
from furlong.controller.run_store import RunStore
from furlong.controller.server import HttpServer, build_controller
from furlong.core.errors import NotFoundError
from furlong.core.settings import SettingError

pytestmark = pytest.mark.integration

TOKEN = "test-token-0123456789abcdef"
SPEC = {
    "name": "addition-grpo",
    "model": "/models/tiny",
    "task": "addition",
    "steps": 3,
    "prompts_per_step": 2,
    "samples_per_prompt": 2,
}


class Env:
    def __init__(self, redis_url: str, ready: dict[str, bool]) -> None:
        self.fakes = fake_stack()
        self.store = RunStore.from_url(redis_url)
        self.ready = ready
        self.controller = build_controller(
            self.store,
            self.fakes.services,
            TOKEN,
            lambda: dict(self.ready),
            DriverTimeouts(end_s=1.0),
        )
        self.server = HttpServer(self.controller.app).start()
        self.http = httpx.Client(base_url=self.server.url, timeout=10.0)
        self.auth = {"Authorization": f"Bearer {TOKEN}"}

    def get(self, path, **kw):
        return self.http.get(path, headers=self.auth, **kw)

    def post(self, path, **kw):
        return self.http.post(path, headers=self.auth, **kw)

    def state(self, run_id: str) -> str:
        return self.get(f"/v1/runs/{run_id}").json()["state"]

    def close(self) -> None:
        for gate in self.fakes.faults.gates.values():
            gate.set()
        self.controller.close(10)
        self.server.stop()
        self.http.close()
        self.store.close()


@pytest.fixture
def env(redis_url):
    e = Env(redis_url, {"redis": True, "trainer": True, "rollout": True, "broker": True})
    yield e
    e.close()


ROUTES = [
    ("POST", "/v1/runs"),
    ("GET", "/v1/runs"),
    ("GET", "/v1/runs/x"),
    ("POST", "/v1/runs/x/stop"),
    ("GET", "/v1/runs/x/metrics"),
]
BAD_HEADERS = [None, "Bearer wrong-token-0123456789", f"Basic {TOKEN}", "Bearer", f"Bearer {TOKEN}x"]


def test_v1_requires_the_bearer_token(env, caplog):
    caplog.set_level(logging.DEBUG)
    for method, path in ROUTES:
        for header in BAD_HEADERS:
            headers = {"Authorization": header} if header else {}
            resp = env.http.request(method, path, headers=headers, json=SPEC)
            assert resp.status_code == 401, (method, path, header)
            assert resp.headers["www-authenticate"] == "Bearer"
    assert env.get("/v1/runs").json()["runs"] == []  # nothing was created
    assert TOKEN not in caplog.text


def test_malformed_spec_is_422_naming_the_field_and_creates_nothing(env, redis_url):
    bad = {**SPEC, "sampling": {"top_p": 1.5}}
    resp = env.post("/v1/runs", json=bad)
    assert resp.status_code == 422
    assert resp.json()["field"] == "sampling.top_p"
    assert "sampling.top_p" in resp.json()["detail"]
    assert resp.headers["content-type"] == "application/problem+json"
    for body, field in [
        ({**SPEC, "task": "sorting"}, "task"),
        ({**SPEC, "foo": 1}, "foo"),
        ({k: v for k, v in SPEC.items() if k != "model"}, "model"),
        # what a service would refuse is refused here, by the same declaration
        ({**SPEC, "algorithm": {"clip_eps": 1.0}}, "algorithm.clip_eps"),
        ({**SPEC, "sampling": {"min_p": 1.0}}, "sampling.min_p"),
        # greedy decoding is for generation and evaluation, not for training runs
        ({**SPEC, "sampling": {"temperature": 0}}, "sampling.temperature"),
        ({**SPEC, "prompts_per_step": 100000000}, "prompts_per_step"),
        ({**SPEC, "steps": 99999999999999999999999}, "steps"),
        ({**SPEC, "precision": {"dtype": "float16"}}, "precision.dtype"),
        ({**SPEC, "precision": {"gradient_checkpointing": 1}}, "precision.gradient_checkpointing"),
        # asynchronous mode needs an off-policy correction
        ({**SPEC, "rollout": {"max_staleness": 1}}, "rollout.max_staleness"),
        ({**SPEC, "rollout": {"max_staleness": -2}}, "rollout.max_staleness"),
    ]:
        resp = env.post("/v1/runs", json=body)
        assert (resp.status_code, resp.json()["field"]) == (422, field)
    resp = env.http.post(
        "/v1/runs", content=b"{not json", headers={**env.auth, "content-type": "application/json"}
    )
    assert (resp.status_code, resp.json()["field"]) == (422, "body")
    assert env.get("/v1/runs").json()["runs"] == []
    assert redis.Redis.from_url(redis_url).keys("furlong:runs:*") == []
    assert env.fakes.rollout.configured == {}


def test_unknown_run_is_404(env):
    for resp in (
        env.get("/v1/runs/nope-1"),
        env.post("/v1/runs/nope-1/stop"),
        env.get("/v1/runs/nope-1/metrics"),
    ):
        assert resp.status_code == 404 and "nope-1" in resp.json()["detail"]


def test_create_list_get_metrics(env):
    resp = env.post("/v1/runs", json=SPEC)
    assert resp.status_code == 201
    created = resp.json()
    run_id = created["run_id"]
    assert created["state"] == "pending" and created["total_steps"] == 3
    assert created["spec"]["sampling"]["top_p"] == 1.0  # the resolved spec is returned
    wait_for(lambda: env.state(run_id) == "succeeded", what="run to succeed")
    run = env.get(f"/v1/runs/{run_id}").json()
    assert (run["current_step"], run["policy_version"], run["reason"]) == (3, 3, "")
    assert [r["run_id"] for r in env.get("/v1/runs").json()["runs"]] == [run_id]
    assert env.get("/v1/runs", params={"state": "succeeded"}).json()["runs"][0]["run_id"] == run_id
    assert env.get("/v1/runs", params={"state": "running"}).json()["runs"] == []
    bad_state = env.get("/v1/runs", params={"state": "sleeping"})
    assert (bad_state.status_code, bad_state.json()["field"]) == (422, "state")
    steps = env.get(f"/v1/runs/{run_id}/metrics").json()["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert [s["reward_mean"] for s in steps] == pytest.approx([0.1, 0.2, 0.3])
    assert set(steps[0]) >= {
        "step",
        "reward_mean",
        "loss",
        "policy_version",
        "samples",
        "step_seconds",
        "generate_seconds",
        "train_seconds",
        "sync_seconds",
    }
    tail = env.get(f"/v1/runs/{run_id}/metrics", params={"since": 2}).json()["steps"]
    assert [s["step"] for s in tail] == [3]
    stop_done = env.post(f"/v1/runs/{run_id}/stop")
    assert stop_done.status_code == 409 and "already finished" in stop_done.json()["detail"]


def test_stop_a_running_run_and_a_waiting_one(env):
    gate = threading.Event()
    env.fakes.faults.gates["generate"] = gate
    first = env.post("/v1/runs", json=SPEC).json()["run_id"]
    second = env.post("/v1/runs", json={**SPEC, "name": "second"}).json()["run_id"]
    wait_for(lambda: env.state(first) == "running", what="first run to run")
    assert env.state(second) == "pending"  # one run at a time
    waiting = env.post(f"/v1/runs/{second}/stop")
    assert waiting.status_code == 200 and waiting.json()["state"] == "cancelled"
    stopping = env.post(f"/v1/runs/{first}/stop").json()
    assert stopping["stop_requested"] is True and stopping["state"] == "running"
    gate.set()
    wait_for(lambda: env.state(first) == "cancelled", what="first run to be cancelled")
    assert "stopped by request" in env.get(f"/v1/runs/{first}").json()["reason"]
    assert env.fakes.rollout.configured.keys() == {first}


def test_failed_run_shows_its_reason(env):
    env.fakes.faults.raise_in["publish_weights"] = ValueError("version 1 is stale")
    run_id = env.post("/v1/runs", json=SPEC).json()["run_id"]
    wait_for(lambda: env.state(run_id) == "failed", what="run to fail")
    assert (
        env.get(f"/v1/runs/{run_id}").json()["reason"]
        == "step 1 trainer.PublishWeights: ValueError: version 1 is stale"
    )


def test_health_ready_and_prometheus(env):
    assert env.http.get("/healthz").json() == {"status": "ok"}
    ready = env.http.get("/readyz")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    env.ready["trainer"] = False
    not_ready = env.http.get("/readyz")
    assert not_ready.status_code == 503
    assert not_ready.json()["checks"] == {"redis": True, "trainer": False, "rollout": True, "broker": True}
    run_id = env.post("/v1/runs", json=SPEC).json()["run_id"]
    wait_for(lambda: env.state(run_id) == "succeeded", what="run to succeed")
    metrics = env.http.get("/metrics", follow_redirects=False)
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    assert 'furlong_controller_runs_total{state="succeeded"} 1.0' in text
    assert 'furlong_controller_runs_total{state="pending"} 1.0' in text
    assert f'furlong_controller_reward_mean{{run_id="{run_id}"}} 0.3' in text
    assert "furlong_controller_step_seconds_count 3.0" in text


def test_http_client_and_in_process_twin_agree(env):
    http = HttpControllerClient(env.server.url, TOKEN)
    twin = InProcessControllerClient(env.controller.service)
    for client in (http, twin):
        run = client.create_run(SPEC)
        wait_for(
            lambda client=client, run=run: client.get_run(run["run_id"])["state"] == "succeeded", what="run"
        )
        assert [s["step"] for s in client.run_metrics(run["run_id"], since=1)] == [2, 3]
        with pytest.raises(SettingError) as err:
            client.create_run({**SPEC, "steps": 0})
        assert (
            err.value.field == "steps"
            and str(err.value) == "steps: must be an integer in [1, 10000000], got 0"
        )
        with pytest.raises(NotFoundError):
            client.get_run("missing-1")
    runs_http, runs_twin = http.list_runs(), twin.list_runs()
    assert runs_http == runs_twin and len(runs_http) == 2
    with pytest.raises(PermissionError):
        HttpControllerClient(env.server.url, "wrong-token-0123456789").list_runs()
    http.close()
