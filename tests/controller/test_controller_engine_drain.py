"""`POST /v1/engines/{engine_id}/drain` through the controller's REST API to a real rollout service
over gRPC (`furlong.v1.Rollout/DrainEngine`): admin only, unknown run or engine is 404
problem+json, the drained engine is reported as drained by `GET /v1/engines` and takes no new work.
Real uvicorn and gRPC on 127.0.0.1, real Redis; the trainer and broker behind the run machinery are
the usual fakes (draining does not involve them)."""

from __future__ import annotations

import time

import httpx
import pytest
import redis
from controller_fakes import fake_stack
from tiny_policy import rollout_run, write_tiny_checkpoint

from furlong.controller.auth import ApiTokens
from furlong.controller.run_store import RunStore
from furlong.controller.server import HttpServer, build_controller
from furlong.core.errors import UnavailableError
from furlong.core.samples import STREAM_FIELD, SampleGroup, stream_key
from furlong.rollout.client import GrpcRolloutClient
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.service import RolloutService
from furlong.rollout.core.types import GenerateRequest, Prompt
from furlong.rollout.run_records import redis_records
from furlong.rollout.server import SERVICE_NAME, RolloutServicer
from furlong.rpc import start_server

pytestmark = pytest.mark.integration

ADMIN = "admin-token-0123456789abcdef"
VIEWER = "viewer-token-0123456789abcdef"
RUN = "drain-run"


def problem(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/problem+json"
    body = resp.json()
    assert body["status"] == status and body["detail"]
    return body


@pytest.fixture
def stack(redis_url, tmp_path):
    red = redis.Redis.from_url(redis_url)
    service = RolloutService(redis_records(red), None, max_batch_size=8)
    grpc_server = start_server([RolloutServicer(service).add_to_server], [SERVICE_NAME])
    engines = GrpcRolloutClient(f"127.0.0.1:{grpc_server.port}")
    fakes = fake_stack()
    store = RunStore.from_url(redis_url)
    controller = build_controller(
        store,
        fakes.services,
        ApiTokens(admin=(ADMIN,), viewer=(VIEWER,)),
        lambda: {"redis": True},
        engines=engines,
    )
    http = HttpServer(controller.app).start()
    checkpoint = str(write_tiny_checkpoint(tmp_path / "policy"))
    try:
        yield service, http.url, checkpoint, red
    finally:
        controller.close(10)
        http.stop()
        engines.close()
        grpc_server.stop(grace_s=1.0)
        service.close()
        store.close()
        red.close()


def test_drain_an_engine_over_rest(stack):
    service, url, checkpoint, red = stack
    service.configure_run(rollout_run(RUN, checkpoint, num_engines=2, seed=5))
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30.0)
    viewer = {"Authorization": f"Bearer {VIEWER}"}
    target = f"/v1/engines/{RUN}-engine-1/drain"

    assert httpx.post(url + target, params={"run_id": RUN}).status_code == 401
    assert (
        "viewer" in problem(httpx.post(url + target, params={"run_id": RUN}, headers=viewer), 403)["detail"]
    )
    assert [e.state.value for e in service.status(RUN).engines] == ["serving", "serving"]

    drained = admin.post(target, params={"run_id": RUN})
    assert drained.status_code == 200, drained.text
    assert drained.json() == {
        "engine_id": f"{RUN}-engine-1",
        "policy_version": 0,
        "healthy": True,
        "state": "drained",
        "in_flight": 0,
    }  # nothing was in flight
    assert admin.post(target, params={"run_id": RUN}).json()["state"] == "drained"  # idempotent
    listed = httpx.get(url + "/v1/engines", params={"run_id": RUN}, headers=viewer).json()
    assert [(e["engine_id"], e["state"]) for e in listed["engines"]] == [
        (f"{RUN}-engine-0", "serving"),
        (f"{RUN}-engine-1", "drained"),
    ]

    assert "nope" in problem(admin.post("/v1/engines/nope/drain", params={"run_id": RUN}), 404)["detail"]
    assert "other-run" in problem(admin.post(target, params={"run_id": "other-run"}), 404)["detail"]
    assert "no run is being executed" in problem(admin.post(target), 404)["detail"]

    # The drained engine takes no new work: every row goes to engine 0, so the samples are those of
    # a run with engine 0 alone (share 0 of a request samples with the same seed either way).
    prompts = tuple(Prompt(f"q{i}", f"{i}+{i}=", str(2 * i)) for i in range(3))
    sampling = SamplingConfig(temperature=1.0, top_k=8, max_new_tokens=6, seed=3)

    def generate(run_id: str):
        return service.generate(
            GenerateRequest(
                run_id=run_id,
                step=0,
                samples_per_prompt=2,
                sampling=sampling,
                timeout_s=30.0,
                prompts=prompts,
            )
        )

    result = generate(RUN)
    service.configure_run(rollout_run("solo", checkpoint, seed=5))
    solo = generate("solo")
    assert result.num_samples == solo.num_samples == 6

    def responses(run_id: str) -> list[list[int]]:
        groups = [SampleGroup.decode(f[STREAM_FIELD]) for _, f in red.xrange(stream_key(run_id))]
        return [s.response_token_ids for g in groups for s in g.samples]

    assert responses(RUN) == responses("solo")
    states = service.status(RUN)
    assert [e.in_flight for e in states.engines] == [0, 0]
    assert states.ledger.done == 6 and states.ledger.pending == states.ledger.in_flight == 0
    admin.close()


def test_draining_the_last_serving_engine_is_refused_with_409_naming_why(stack):
    service, url, checkpoint, _ = stack
    service.configure_run(rollout_run(RUN, checkpoint, num_engines=2, seed=5))
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30.0)
    try:
        first = admin.post(f"/v1/engines/{RUN}-engine-0/drain", params={"run_id": RUN})
        assert first.status_code == 200 and first.json()["state"] == "drained"
        refused = problem(admin.post(f"/v1/engines/{RUN}-engine-1/drain", params={"run_id": RUN}), 409)
        assert f"{RUN}-engine-1 is the last serving engine of run {RUN}" in refused["detail"]
        assert [e.state.value for e in service.status(RUN).engines] == ["drained", "serving"]
    finally:
        admin.close()


def test_a_drained_engine_stays_drained_after_a_recovery(redis_url):
    """A recovery starts fresh engines (all serving); the controller drains again the ones drained
    through REST before, so draining an engine survives a service restart."""
    fakes = fake_stack()
    store = RunStore.from_url(redis_url)
    controller = build_controller(store, fakes.services, ApiTokens(admin=(ADMIN,)), lambda: {"redis": True})
    http = HttpServer(controller.app).start()
    admin = httpx.Client(base_url=http.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30.0)
    drains: list[str] = []
    failed: list[int] = []
    real_drain, real_train_step = fakes.rollout.drain_engine, fakes.trainer.train_step

    def drain(run_id, engine_id):
        drains.append(engine_id)
        return real_drain(run_id, engine_id)

    def train_step(request):
        if request.step == 1 and not drains:
            reply = admin.post(
                f"/v1/engines/{request.run_id}-engine-1/drain", params={"run_id": request.run_id}
            )
            assert reply.status_code == 200 and reply.json()["state"] == "drained", reply.text
        if request.step == 2 and not failed:
            failed.append(request.step)
            fakes.trainer.runs.pop(request.run_id)  # the trainer "restarted": it forgot the run
            raise UnavailableError("trainer went away")
        return real_train_step(request)

    fakes.rollout.drain_engine, fakes.trainer.train_step = drain, train_step
    try:
        spec = {"name": "drained", "model": "/models/tiny", "task": "addition", "steps": 3, "seed": 7}
        created = admin.post("/v1/runs", json=spec)
        assert created.status_code == 201, created.text
        run_id = created.json()["run_id"]
        deadline = time.monotonic() + 60
        while admin.get(f"/v1/runs/{run_id}").json()["state"] not in ("succeeded", "failed"):
            assert time.monotonic() < deadline, "the run did not finish"
            time.sleep(0.05)
        assert admin.get(f"/v1/runs/{run_id}").json()["state"] == "succeeded"
        assert len(fakes.rollout.configured) == 1 and [c.step for c in fakes.rollout.generate_calls][:3] == [
            1,
            2,
            1,
        ]
        assert drains == [f"{run_id}-engine-1"] * 2  # through REST, then again after the recovery
        states = [(e.engine_id, e.state.value) for e in fakes.rollout.status(run_id).engines]
        assert states == [(f"{run_id}-engine-0", "serving"), (f"{run_id}-engine-1", "drained")]
        assert store.drained_engines(run_id) == [f"{run_id}-engine-1"]
        assert admin.delete(f"/v1/runs/{run_id}").status_code == 204
        assert store.drained_engines(run_id) == []
    finally:
        admin.close()
        controller.close(10)
        http.stop()
        store.close()
