"""The gateway inside the rollout service (`--gateway-port`): its models are the configured runs,
sampled by the run's own engine, and every reply carries the policy version the engine serves at
that moment (a new version delivered by the run's weight receiver shows in the next reply). On a
run of two engines a session's calls stay on the engine of its first call; new sessions and calls
without one go to the least-loaded engine; a drained engine's sessions move, a deleted session is
placed afresh."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis
from gateway_models import write_random_dir

from furlong.core.checkpoint import load_policy, unique_state
from furlong.core.settings import RolloutSettings
from furlong.rollout.__main__ import start_gateway
from furlong.rollout.core.sampling import SamplingConfig
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


@contextlib.contextmanager
def service_with_gateway(redis_url: str) -> Iterator[tuple[RolloutService, Any, dict[str, Receiver]]]:
    """A rollout service whose engines' receivers are `Receiver`s (by engine id), with its gateway."""
    receivers: dict[str, Receiver] = {}

    def receiver(run_id, engine_id, apply, prepare=None):
        receivers[engine_id] = Receiver(apply)
        return receivers[engine_id]

    client = redis.Redis.from_url(redis_url)
    service = RolloutService(redis_records(client), receiver)
    gateway = start_gateway(service, "127.0.0.1", 0)
    try:
        yield service, gateway, receivers
    finally:
        gateway.stop(5.0)
        service.close()
        client.close()


def test_runs_are_served_with_their_policy_version(redis_url, tmp_path):
    model_dir = write_random_dir(tmp_path / "policy")
    with service_with_gateway(redis_url) as (service, gateway, receivers):
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


def test_sessions_stay_on_their_engine_and_new_ones_go_least_loaded(redis_url, tmp_path):
    model_dir = write_random_dir(tmp_path / "policy")
    e0, e1 = "run-s-engine-0", "run-s-engine-1"
    with service_with_gateway(redis_url) as (service, gateway, receivers):
        service.configure_run(
            RolloutRunConfig(
                run_id="run-s",
                model_dir=str(model_dir),
                reward="addition_exact_match",
                seed=0,
                rollout=RolloutSettings(num_engines=2),
            )
        )
        # Engine 1 alone serves version 1 (the same weights): a reply's version names its engine.
        model, _ = load_policy(model_dir)
        receivers[e1].apply(1, unique_state(model))
        engine_of_version = {0: e0, 1: e1}
        kw = dict(model="run-s", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0)

        def served(session: str | None) -> str:
            base = f"{gateway.url}/v1" if session is None else f"{gateway.url}/sessions/{session}/v1"
            with openai.OpenAI(base_url=base, api_key="unused", max_retries=0) as c:
                reply = c.chat.completions.create(**kw)
            return engine_of_version[reply.model_extra["furlong"]["policy_version"]]

        assert served("a") == e0  # nothing in flight, no session bound: the first engine
        assert served("b") == e1  # as idle, but engine 0 holds a session
        assert [served("a"), served("b"), served("a"), served("b")] == [e0, e1, e0, e1]
        assert served(None) == e0  # no session: least-loaded, nothing bound

        # Calls in flight come first: while a call of session a runs on engine 0, a new session
        # goes to engine 1 (sessions bound alone would say engine 0: one each).
        started, release = threading.Event(), threading.Event()

        def hold(row, token_id, score):
            started.set()
            assert release.wait(30)

        running = service.served_engine("run-s", "a")
        prompt = [running.tokenizer.encode("hi")]
        greedy = SamplingConfig(temperature=0.0, max_new_tokens=2)
        call = threading.Thread(target=lambda: running.generate(prompt, greedy, None, hold))
        call.start()
        try:
            assert started.wait(30)
            in_flight = {s.engine_id: s.in_flight for s in service.status("run-s").engines}
            assert in_flight == {e0: 1, e1: 0}
            assert service.served_engine("run-s", "c").engine.name == e1
        finally:
            release.set()
            call.join(30)
        assert {s.engine_id: s.in_flight for s in service.status("run-s").engines} == {e0: 0, e1: 0}

        # A deleted session is forgotten: sessions bound are a on engine 0, b and c on engine 1;
        # without b, its next call is placed afresh and ties (a, c) go to engine 0.
        assert httpx.delete(f"{gateway.url}/sessions/b").status_code == 200
        assert [served("b"), served("b")] == [e0, e0]

        # A drained engine's sessions move to a serving engine and stay there.
        service.drain_engine("run-s", e0)
        assert [served("a"), served("b"), served("a"), served(None)] == [e1, e1, e1, e1]
