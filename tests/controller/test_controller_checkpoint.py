"""`POST /v1/runs/{id}/checkpoint` against the real trainer: the controller drives a run through the
real trainer, rollout and weight-broker servicers on loopback gRPC (tiny model, real Redis), takes a
checkpoint over REST mid-run, and the trainer's checkpoint directory holds that step."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import redis
from polling import wait_until
from tiny_policy import write_tiny_checkpoint

from furlong import rpc
from furlong.controller.auth import ApiTokens
from furlong.controller.config import DriverTimeouts
from furlong.controller.run_store import RunStore
from furlong.controller.server import HttpServer, build_controller
from furlong.controller.services import BROKER_SERVICE, ROLLOUT_SERVICE, TRAINER_SERVICE, connect
from furlong.rollout.core.service import RolloutService
from furlong.rollout.receivers import broker_receiver_factory
from furlong.rollout.run_records import redis_records
from furlong.rollout.server import RolloutServicer
from furlong.trainer.server import register as register_trainer
from furlong.trainer.service import TrainerService
from furlong.trainer.train_checkpoint import MANIFEST
from furlong.weight_broker.client import InProcessBrokerClient
from furlong.weight_broker.core import BrokerCore
from furlong.weight_broker.server import WeightBrokerServicer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ADMIN = "admin-token-0123456789abcdef"
VIEWER = "viewer-token-0123456789abcdef"


@pytest.fixture
def services(tmp_path, redis_url):
    """Trainer (with a checkpoint directory), rollout and broker servicers, each on its own gRPC
    server on 127.0.0.1; trainer and rollout share the broker core in process."""
    client = redis.Redis.from_url(redis_url)
    core = BrokerCore()
    broker = InProcessBrokerClient(core)
    rollout = RolloutService(redis_records(client), broker_receiver_factory(broker))
    trainer = TrainerService(
        client, broker, consumer_name="trainer-0", checkpoint_root=tmp_path / "checkpoints"
    )
    servers = {
        "trainer": rpc.start_server([register_trainer(trainer)], [TRAINER_SERVICE]),
        "rollout": rpc.start_server([RolloutServicer(rollout).add_to_server], [ROLLOUT_SERVICE]),
        "broker": rpc.start_server([WeightBrokerServicer(core).add_to_server], [BROKER_SERVICE]),
    }
    yield {name: f"127.0.0.1:{s.port}" for name, s in servers.items()}
    for server in servers.values():
        server.stop(0.5)
    trainer.close()
    rollout.close()
    broker.close()
    core.shutdown()
    client.close()


def test_checkpoint_mid_run_is_written_by_the_trainer(services, tmp_path, redis_url):
    model = write_tiny_checkpoint(tmp_path / "model")
    store = RunStore.from_url(redis_url)
    timeouts = DriverTimeouts(end_s=10.0)
    clients = connect(services["trainer"], services["rollout"], services["broker"], timeouts)
    controller = build_controller(
        store, clients, ApiTokens(admin=(ADMIN,), viewer=(VIEWER,)), lambda: {"redis": True}, timeouts
    )
    server = HttpServer(controller.app).start()
    http = httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {ADMIN}"})
    try:
        spec = {
            "name": "ckpt",
            "model": str(model),
            "task": "addition",
            "steps": 200,
            "seed": 0,
            "prompts_per_step": 2,
            "samples_per_prompt": 2,
            "sampling": {"temperature": 1.0, "max_new_tokens": 4},
            "algorithm": {"name": "grpo", "learning_rate": 0.001, "micro_batch_size": 8},
        }
        run_id = http.post("/v1/runs", json=spec).json()["run_id"]

        def stepped() -> bool:
            run = http.get(f"/v1/runs/{run_id}").json()
            assert run["state"] in ("pending", "starting", "running"), run["reason"]
            return run["current_step"] >= 1

        wait_until(stepped, timeout_s=120, what="the run to complete a step")
        viewer = {"Authorization": f"Bearer {VIEWER}"}
        assert http.post(f"/v1/runs/{run_id}/checkpoint", headers=viewer).status_code == 403

        # paused, so the trainer's own per-step checkpoints cannot overwrite this one before the
        # manifest is read
        assert http.post(f"/v1/runs/{run_id}/pause").status_code == 200
        wait_until(
            lambda: http.get(f"/v1/runs/{run_id}").json()["state"] == "paused",
            timeout_s=120,
            what="the run to pause",
        )
        taken = http.post(f"/v1/runs/{run_id}/checkpoint")
        assert taken.status_code == 200, taken.text
        checkpoint = taken.json()["checkpoint"]
        assert checkpoint["step"] >= 1 and checkpoint["policy_version"] >= 1
        assert checkpoint["path"] == str(tmp_path / "checkpoints" / run_id / f"step-{checkpoint['step']}")
        manifest = json.loads((Path(checkpoint["path"]) / MANIFEST).read_text())
        assert manifest["step"] == checkpoint["step"], manifest

        assert http.post(f"/v1/runs/{run_id}/stop").status_code == 200
        wait_until(
            lambda: http.get(f"/v1/runs/{run_id}").json()["state"] == "cancelled",
            timeout_s=120,
            what="the run to be cancelled",
        )
        after = http.post(f"/v1/runs/{run_id}/checkpoint")
        assert after.status_code == 409 and "cancelled" in after.json()["detail"]
        assert http.get(f"/v1/runs/{run_id}").json()["checkpoint"] == checkpoint
    finally:
        http.close()
        controller.close(30)
        server.stop()
        clients.close()
        store.close()
