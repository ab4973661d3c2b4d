"""The gateway inside the rollout service (`--gateway-port`): its models are the configured runs,
sampled by the run's own engine, and every reply carries the policy version the engine serves at
that moment (a new version delivered by the run's weight receiver shows in the next reply)."""

from __future__ import annotations

import openai
import pytest
import redis
from gateway_models import write_random_dir

from furlong.core.checkpoint import load_policy, unique_state
from furlong.core.settings import RolloutSettings
from furlong.rollout.__main__ import start_gateway
from furlong.rollout.core.service import RolloutService
from furlong.rollout.core.types import RolloutRunConfig
from furlong.rollout.run_records import redis_records

pytestmark = pytest.mark.integration


class Receiver:
    def __init__(self, apply):
        self.apply = apply

    def start(self):
        pass

    def close(self):
        pass


def test_runs_are_served_with_their_policy_version(redis_url, tmp_path):
    model_dir = write_random_dir(tmp_path / "policy")
    receivers: dict[str, Receiver] = {}

    def receiver(run_id, engine_id, apply):
        receivers[engine_id] = Receiver(apply)
        return receivers[engine_id]

    client = redis.Redis.from_url(redis_url)
    service = RolloutService(redis_records(client), receiver)
    gateway = start_gateway(service, "127.0.0.1", 0)
    try:
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as c:
            assert c.models.list().data == []
            with pytest.raises(openai.NotFoundError, match="run-g"):
                c.chat.completions.create(model="run-g", messages=[{"role": "user", "content": "hi"}])
            service.configure_run(
                RolloutRunConfig(
                    run_id="run-g",
                    model_dir=str(model_dir),
                    reward="addition_exact_match",
                    seed=0,
                    rollout=RolloutSettings(num_engines=1),
                )
            )
            assert [m.id for m in c.models.list().data] == ["run-g"]
            kw = dict(
                model="run-g", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
            )
            first = c.chat.completions.create(**kw)
            assert first.model_extra["furlong"]["policy_version"] == 0
            assert first.system_fingerprint == "furlong-policy-0"
            model, _ = load_policy(model_dir)
            receivers["run-g-engine-0"].apply(1, unique_state(model))
            second = c.chat.completions.create(**kw)
            assert second.model_extra["furlong"]["policy_version"] == 1
            assert second.choices[0].message.content == first.choices[0].message.content  # same weights
            service.end_run("run-g")
            assert c.models.list().data == []
    finally:
        gateway.stop(5.0)
        service.close()
        client.close()
