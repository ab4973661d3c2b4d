"""Run operations of the REST API: idempotent creation, pages, pause/resume, checkpoint, delete,
Server-Sent Events, roles, problem+json errors, body limits and the served OpenAPI document.
Real uvicorn on 127.0.0.1, real Redis, fake services."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from controller_fakes import fake_stack
from polling import wait_until as wait_for

from furlong.controller.auth import ApiTokens
from furlong.controller.config import DriverTimeouts
from furlong.controller.run_store import RunStore
from furlong.controller.server import HttpServer, build_controller
from furlong.core.errors import UnavailableError

pytestmark = pytest.mark.integration

ADMIN = "admin-token-0123456789abcdef"
VIEWER = "viewer-token-0123456789abcdef"
SPEC = {
    "name": "ops",
    "model": "/models/tiny",
    "task": "addition",
    "steps": 3,
    "prompts_per_step": 2,
    "samples_per_prompt": 2,
}


class Env:
    def __init__(self, redis_url: str, max_body_bytes: int | None = None) -> None:
        self.fakes = fake_stack()
        self.store = RunStore.from_url(redis_url)
        self.controller = build_controller(
            self.store,
            self.fakes.services,
            ApiTokens(admin=(ADMIN,), viewer=(VIEWER,)),
            lambda: {"redis": True},
            DriverTimeouts(end_s=1.0, pause_poll_s=0.02),
        )
        self.server = HttpServer(self.controller.app).start()
        self.http = httpx.Client(
            base_url=self.server.url, timeout=10.0, headers={"Authorization": f"Bearer {ADMIN}"}
        )

    def state(self, run_id: str) -> str:
        return self.http.get(f"/v1/runs/{run_id}").json()["state"]

    def close(self) -> None:
        for gate in self.fakes.faults.gates.values():
            gate.set()
        self.controller.close(10)
        self.server.stop()
        self.http.close()
        self.store.close()


@pytest.fixture
def env(redis_url):
    e = Env(redis_url)
    yield e
    e.close()


def is_problem(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/problem+json"
    body = resp.json()
    assert body["status"] == status and body["type"] == "about:blank" and body["title"]
    assert isinstance(body["detail"], str) and body["detail"]
    return body


def test_idempotency_key_same_body_same_run_other_body_409(env):
    key = {"Idempotency-Key": "create-ops-1"}
    first = env.http.post("/v1/runs", json=SPEC, headers=key)
    assert first.status_code == 201
    again = env.http.post("/v1/runs", json=dict(reversed(list(SPEC.items()))), headers=key)
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
    assert again.json()["run_id"] == first.json()["run_id"]
    other = env.http.post("/v1/runs", json={**SPEC, "steps": 4}, headers=key)
    assert first.json()["run_id"] in is_problem(other, 409)["detail"]
    no_key = env.http.post("/v1/runs", json=SPEC)
    assert no_key.status_code == 201 and no_key.json()["run_id"] != first.json()["run_id"]
    assert len(env.http.get("/v1/runs").json()["runs"]) == 2
    bad_key = env.http.post("/v1/runs", json=SPEC, headers={"Idempotency-Key": "x" * 256})
    assert is_problem(bad_key, 422)["field"] == "Idempotency-Key"
    wait_for(lambda: env.state(no_key.json()["run_id"]) == "succeeded", what="runs to finish")


def test_cursor_pages_and_state_filter(env):
    gate = threading.Event()
    env.fakes.faults.gates["generate"] = gate
    ids = [env.http.post("/v1/runs", json={**SPEC, "name": f"p{i}"}).json()["run_id"] for i in range(7)]
    seen, cursor, pages = [], None, 0
    while True:
        params = {"limit": 3, **({"cursor": cursor} if cursor else {})}
        page = env.http.get("/v1/runs", params=params).json()
        seen += [r["run_id"] for r in page["runs"]]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == list(reversed(ids)) and pages == 3
    wait_for(lambda: env.state(ids[0]) == "running", what="first run to run")
    pending = env.http.get("/v1/runs", params={"state": "pending", "limit": 4}).json()
    assert [r["run_id"] for r in pending["runs"]] == list(reversed(ids[1:]))[:4]
    rest = env.http.get("/v1/runs", params={"state": "pending", "cursor": pending["next_cursor"]})
    assert [r["run_id"] for r in rest.json()["runs"]] == list(reversed(ids[1:]))[4:]
    assert rest.json()["next_cursor"] is None
    # a last page that is exactly full has no next cursor (one would only lead to an empty page)
    last = env.http.get("/v1/runs", params={"limit": 3, "cursor": pending["next_cursor"]}).json()
    assert len(last["runs"]) == 3 and last["next_cursor"] is None
    exact = env.http.get("/v1/runs", params={"limit": 7}).json()
    assert len(exact["runs"]) == 7 and exact["next_cursor"] is None
    assert is_problem(env.http.get("/v1/runs", params={"cursor": "@@nope"}), 422)["field"] == "cursor"
    assert is_problem(env.http.get("/v1/runs", params={"limit": 0}), 422)["field"] == "limit"
    gate.set()


def test_pause_resume_and_illegal_transitions_are_409(env):
    gate = threading.Event()
    env.fakes.faults.gates["train_step"] = gate
    run_id = env.http.post("/v1/runs", json=SPEC).json()["run_id"]
    wait_for(lambda: env.state(run_id) == "running", what="run to run")
    is_problem(env.http.post(f"/v1/runs/{run_id}/resume"), 409)  # not paused
    paused = env.http.post(f"/v1/runs/{run_id}/pause")
    assert paused.status_code == 200 and paused.json()["pause_requested"] is True
    assert env.http.post(f"/v1/runs/{run_id}/pause").status_code == 200  # idempotent
    gate.set()
    wait_for(lambda: env.state(run_id) == "paused", what="run to pause")
    step = env.http.get(f"/v1/runs/{run_id}").json()["current_step"]
    time.sleep(0.2)  # the run must not go on while paused
    assert env.http.get(f"/v1/runs/{run_id}").json()["current_step"] == step == 1
    is_problem(env.http.delete(f"/v1/runs/{run_id}"), 409)  # not finished
    assert env.http.post(f"/v1/runs/{run_id}/resume").json()["pause_requested"] is False
    wait_for(lambda: env.state(run_id) == "succeeded", what="run to finish after resume")
    run = env.http.get(f"/v1/runs/{run_id}").json()
    assert (run["current_step"], run["policy_version"]) == (3, 3)
    for op in ("pause", "resume", "stop"):
        assert "succeeded" in is_problem(env.http.post(f"/v1/runs/{run_id}/{op}"), 409)["detail"]
    assert "checkpoint" in is_problem(env.http.post(f"/v1/runs/{run_id}/checkpoint"), 409)["detail"]
    is_problem(env.http.post("/v1/runs/nope-1/checkpoint"), 404)


def test_checkpoint_of_a_running_or_paused_run_is_recorded(env):
    from furlong.core.errors import ConflictError, NotFoundError, UnavailableError

    env.fakes.faults.gates["rollout.configure_run"] = starting = threading.Event()
    gate = threading.Event()
    env.fakes.faults.gates["train_step"] = gate
    run_id = env.http.post("/v1/runs", json=SPEC).json()["run_id"]
    wait_for(lambda: env.state(run_id) == "starting", what="run to start")
    assert "starting" in is_problem(env.http.post(f"/v1/runs/{run_id}/checkpoint"), 409)["detail"]
    starting.set()
    wait_for(lambda: env.state(run_id) == "running", what="run to run")
    taken = env.http.post(f"/v1/runs/{run_id}/checkpoint")
    assert taken.status_code == 200, taken.text
    checkpoint = taken.json()["checkpoint"]
    assert (checkpoint["step"], checkpoint["path"], checkpoint["policy_version"]) == (
        0,
        f"/checkpoints/{run_id}",
        0,
    )
    env.http.post(f"/v1/runs/{run_id}/pause")
    gate.set()
    wait_for(lambda: env.state(run_id) == "paused", what="run to pause")
    paused = env.http.post(f"/v1/runs/{run_id}/checkpoint").json()
    assert (paused["state"], paused["checkpoint"]["step"], paused["checkpoint"]["policy_version"]) == (
        "paused",
        1,
        1,
    )
    assert env.http.get(f"/v1/runs/{run_id}").json()["checkpoint"] == paused["checkpoint"]
    # what the trainer answers decides the status: it cannot (409), lost the run (409), is gone (503)
    for error, status, words in (
        (ConflictError("run is offloaded"), 409, "cannot checkpoint"),
        (NotFoundError("no run"), 409, "no state of this run"),
        (UnavailableError("trainer down"), 503, "trainer down"),
    ):
        env.fakes.faults.raise_in["trainer.checkpoint"] = error
        assert words in is_problem(env.http.post(f"/v1/runs/{run_id}/checkpoint"), status)["detail"]
    del env.fakes.faults.raise_in["trainer.checkpoint"]
    assert env.http.get(f"/v1/runs/{run_id}").json()["checkpoint"] == paused["checkpoint"]
    env.http.post(f"/v1/runs/{run_id}/resume")
    wait_for(lambda: env.state(run_id) == "succeeded", what="run to finish")
    finished = env.http.get(f"/v1/runs/{run_id}").json()
    assert finished["checkpoint"] == paused["checkpoint"]  # kept after the run ends
    assert "succeeded" in is_problem(env.http.post(f"/v1/runs/{run_id}/checkpoint"), 409)["detail"]
    events = [json.loads(e["data"]) for e in read_sse(env.http, f"/v1/runs/{run_id}/events")]
    taken_events = [e for e in events if e["type"] == "checkpoint"]
    assert [(e["checkpoint_step"], e["checkpoint_path"]) for e in taken_events] == [
        (0, f"/checkpoints/{run_id}"),
        (1, f"/checkpoints/{run_id}"),
    ]


def test_stop_a_paused_run_cancels_it_and_delete_removes_it(env, redis_url):
    gate = threading.Event()
    env.fakes.faults.gates["train_step"] = gate
    run_id = env.http.post("/v1/runs", json=SPEC).json()["run_id"]
    wait_for(lambda: env.state(run_id) == "running", what="run to run")
    env.http.post(f"/v1/runs/{run_id}/pause")
    gate.set()
    wait_for(lambda: env.state(run_id) == "paused", what="run to pause")
    assert env.http.post(f"/v1/runs/{run_id}/stop").status_code == 200
    wait_for(lambda: env.state(run_id) == "cancelled", what="paused run to be cancelled")
    assert "while paused" in env.http.get(f"/v1/runs/{run_id}").json()["reason"]
    assert env.http.delete(f"/v1/runs/{run_id}").status_code == 204
    is_problem(env.http.get(f"/v1/runs/{run_id}"), 404)
    is_problem(env.http.delete(f"/v1/runs/{run_id}"), 404)
    import redis as redis_lib

    assert [
        k for k in redis_lib.Redis.from_url(redis_url).keys("furlong:runs:*") if run_id.encode() in k
    ] == []


def read_sse(client: httpx.Client, path: str, headers: dict | None = None) -> list[dict]:
    events, current = [], {}
    with client.stream("GET", path, headers=headers or {}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if not line:
                if current:
                    events.append(current)
                current = {}
            elif not line.startswith(":"):
                name, _, value = line.partition(": ")
                current[name] = value
    return events


def test_events_stream_follows_a_run_to_its_end(env):
    gate = threading.Event()
    env.fakes.faults.gates["generate"] = gate
    run_id = env.http.post("/v1/runs", json=SPEC).json()["run_id"]
    got: list[dict] = []
    reader = threading.Thread(target=lambda: got.extend(read_sse(env.http, f"/v1/runs/{run_id}/events")))
    reader.start()
    wait_for(lambda: env.state(run_id) == "running", what="run to run")
    gate.set()
    reader.join(15)
    assert not reader.is_alive(), "the stream must end after the final state"
    data = [json.loads(e["data"]) for e in got]
    states = [d["state"] for d in data if d["type"] in ("created", "state")]
    assert states == ["pending", "starting", "running", "stopping", "succeeded"]
    assert [d["current_step"] for d in data if d["type"] == "step"] == [1, 2, 3]
    assert [e["event"] for e in got] == [d["type"] for d in data]
    # resuming after an event id replays only what came after it
    tail = read_sse(env.http, f"/v1/runs/{run_id}/events", {"Last-Event-ID": got[-3]["id"]})
    assert [e["id"] for e in tail] == [e["id"] for e in got[-2:]]
    is_problem(env.http.get("/v1/runs/nope-1/events"), 404)
    for bad in ("abc", "1-", "-1", "1-2-3", "²-0".encode(), "9" * 41 + "-0"):
        resp = env.http.get(f"/v1/runs/{run_id}/events", headers={"Last-Event-ID": bad})
        assert is_problem(resp, 422)["field"] == "Last-Event-ID", bad


def test_roles_401_without_token_403_for_viewer_changes(env):
    run_id = env.http.post("/v1/runs", json=SPEC).json()["run_id"]
    viewer = {"Authorization": f"Bearer {VIEWER}"}
    reads = [("GET", "/v1/runs"), ("GET", f"/v1/runs/{run_id}"), ("GET", f"/v1/runs/{run_id}/metrics")]
    changes = [
        ("POST", "/v1/runs"),
        ("POST", f"/v1/runs/{run_id}/stop"),
        ("POST", f"/v1/runs/{run_id}/pause"),
        ("POST", f"/v1/runs/{run_id}/resume"),
        ("POST", f"/v1/runs/{run_id}/checkpoint"),
        ("DELETE", f"/v1/runs/{run_id}"),
    ]
    for method, path in reads + changes + [("GET", f"/v1/runs/{run_id}/events")]:
        resp = httpx.request(method, env.server.url + path, json=SPEC)
        assert is_problem(resp, 401) and resp.headers["www-authenticate"] == "Bearer"
    for method, path in reads:
        assert httpx.request(method, env.server.url + path, headers=viewer).status_code == 200
    for method, path in changes:
        resp = httpx.request(method, env.server.url + path, headers=viewer, json=SPEC)
        assert "viewer" in is_problem(resp, 403)["detail"], (method, path)
    assert len(env.http.get("/v1/runs").json()["runs"]) == 1  # the viewer created nothing
    wait_for(lambda: env.state(run_id) == "succeeded", what="run to finish")


def test_engines_of_the_active_or_a_named_run(env):
    assert env.http.get("/v1/engines").json() == {"run_id": None, "engines": []}
    gate = threading.Event()
    env.fakes.faults.gates["generate"] = gate
    run_id = env.http.post("/v1/runs", json=SPEC).json()["run_id"]
    wait_for(lambda: env.state(run_id) == "running", what="run to run")
    viewer = {"Authorization": f"Bearer {VIEWER}"}
    listed = httpx.get(env.server.url + "/v1/engines", headers=viewer).json()
    assert listed == {
        "run_id": run_id,
        "engines": [
            {
                "engine_id": f"{run_id}-engine-{i}",
                "policy_version": 0,
                "healthy": True,
                "state": "serving",
                "in_flight": 0,
            }
            for i in range(2)
        ],
    }
    assert env.http.get("/v1/engines", params={"run_id": run_id}).json() == listed
    assert "nope-1" in is_problem(env.http.get("/v1/engines", params={"run_id": "nope-1"}), 404)["detail"]
    gate.set()
    wait_for(lambda: env.state(run_id) == "succeeded", what="run to finish")
    wait_for(lambda: env.http.get("/v1/engines").json()["run_id"] is None, what="idle")


def test_errors_are_problem_json_and_bodies_are_limited(env):
    is_problem(env.http.get("/v1/nothing-here"), 404)
    is_problem(env.http.put("/v1/runs"), 405)
    big = {**SPEC, "model": "/m" + "x" * (2 * 1024 * 1024)}
    assert "limit" in is_problem(env.http.post("/v1/runs", json=big), 413)["detail"]

    def chunks():
        for _ in range(40):
            yield b" " * 65536

    is_problem(env.http.post("/v1/runs", content=chunks(), headers={"content-type": "application/json"}), 413)
    assert env.http.get("/v1/runs").json()["runs"] == []


def test_openapi_document_is_served_and_complete(env):
    doc = httpx.get(env.server.url + "/openapi.json").json()
    paths = doc["paths"]
    expected = {
        ("/v1/runs", "post"),
        ("/v1/runs", "get"),
        ("/v1/runs/{run_id}", "get"),
        ("/v1/runs/{run_id}", "delete"),
        ("/v1/runs/{run_id}/metrics", "get"),
        ("/v1/runs/{run_id}/events", "get"),
        ("/healthz", "get"),
        ("/readyz", "get"),
        ("/metrics", "get"),
        ("/v1/engines", "get"),
        ("/v1/engines/{engine_id}/drain", "post"),
    } | {(f"/v1/runs/{{run_id}}/{op}", "post") for op in ("stop", "pause", "resume", "checkpoint")}
    assert {(p, m) for p, ops in paths.items() for m in ops} == expected
    body = paths["/v1/runs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["required"] == ["name", "model", "steps"]  # task or data.train: checked by the spec
    assert body["properties"]["sampling"]["properties"]["top_p"] == {"type": "number"}
    assert "application/problem+json" in paths["/v1/runs/{run_id}"]["get"]["responses"]["404"]["content"]
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


def test_delete_removes_the_run_s_checkpoints_unless_asked_to_keep_them(env):
    kept, removed = (env.http.post("/v1/runs", json={**SPEC, "steps": 1}).json()["run_id"] for _ in range(2))
    for run_id in (kept, removed):
        wait_for(lambda r=run_id: env.state(r) == "succeeded", what=f"{run_id} to succeed")
    trainer = env.fakes.trainer
    assert env.http.delete(f"/v1/runs/{kept}", params={"keep_checkpoints": "true"}).status_code == 204
    assert trainer.checkpoints_deleted == []
    env.fakes.faults.raise_in["trainer.delete_checkpoints"] = UnavailableError("trainer unreachable")
    is_problem(env.http.delete(f"/v1/runs/{removed}"), 503)
    assert env.state(removed) == "succeeded"  # nothing deleted when the trainer cannot be reached
    del env.fakes.faults.raise_in["trainer.delete_checkpoints"]
    assert env.http.delete(f"/v1/runs/{removed}").status_code == 204
    assert trainer.checkpoints_deleted == [removed]
    is_problem(env.http.get(f"/v1/runs/{removed}"), 404)


def test_a_checkpoint_taken_between_train_step_and_its_record_shows_no_step_behind(env):
    """The trainer checkpoints step 1 it has trained while the driver has not recorded it yet: the
    checkpoint is recorded once step 1 is, so the run and its checkpoint event agree."""
    publish = env.fakes.faults.gates["publish_weights"] = threading.Event()
    hold = env.fakes.faults.gates["trainer.checkpoint"] = threading.Event()
    run_id = env.http.post("/v1/runs", json={**SPEC, "steps": 2}).json()["run_id"]
    assert env.fakes.faults.entered.setdefault("publish_weights", threading.Event()).wait(30)
    reply = {}
    worker = threading.Thread(
        target=lambda: reply.setdefault("r", env.http.post(f"/v1/runs/{run_id}/checkpoint"))
    )
    worker.start()
    assert env.fakes.faults.entered.setdefault("trainer.checkpoint", threading.Event()).wait(30)
    hold.set()  # the trainer answers: a checkpoint of step 1, which is not recorded yet
    publish.set()
    worker.join(30)
    run = reply["r"].json()
    # the reply is the run as it is when the checkpoint is recorded: never a step behind it (on a
    # loaded machine the run may have gone on by the time the reply is read)
    assert run["current_step"] >= run["checkpoint"]["step"] >= 1, run
    wait_for(lambda: env.state(run_id) == "succeeded", what="run to finish")
    events = [json.loads(e["data"]) for e in read_sse(env.http, f"/v1/runs/{run_id}/events")]
    checkpoints = [e for e in events if e["type"] == "checkpoint"]
    assert checkpoints and checkpoints[0]["checkpoint_step"] == 1, events
    assert all(e["current_step"] >= e["checkpoint_step"] for e in checkpoints), checkpoints
