"""Where the agent harness runs its sessions, in the rollout service over a real checkpoint and
real Redis: each agent session (one per sample) is placed on the least-loaded of the run's two
engines as it starts, every call of the session goes to that engine, and the session is forgotten
when it ends."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import redis
from data_files import addition_rows, write_jsonl
from tool_chat import write_tool_model

from furlong.core.settings import AgentSettings, DataSettings, RolloutSettings
from furlong.rollout.agents import AgentHarness
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.service import RolloutService
from furlong.rollout.core.types import GenerateRequest, RolloutRunConfig
from furlong.rollout.run_records import redis_records

pytestmark = pytest.mark.integration


class RecordingModels:
    """The run's model as the service hands it to the agent harness (a `ModelCatalog`); keeps the
    engine of every session placed, every session closed, and the engine of every call made."""

    def __init__(self, inner):
        self._inner = inner
        self._lock = threading.Lock()
        self.placed: dict[str, str] = {}
        self.closed: list[str] = []
        self.calls: Counter[str] = Counter()

    def names(self):
        return self._inner.names()

    def get(self, name, session_id=None):
        model = self._inner.get(name, session_id)
        if session_id is not None:
            with self._lock:
                self.placed[session_id] = model.engine.name
        return CountedModel(model, self)

    def close_session(self, session_id):
        with self._lock:
            self.closed.append(session_id)
        self._inner.close_session(session_id)


class CountedModel:
    def __init__(self, inner, models):
        self._inner = inner
        self._models = models
        self.name, self.tokenizer = inner.name, inner.tokenizer
        self.max_positions, self.max_rows = inner.max_positions, inner.max_rows

    def policy_version(self):
        return self._inner.policy_version()

    def generate(self, prompt_ids, sampling, num_top_logprobs, on_token=None):
        with self._models._lock:
            self._models.calls[self._inner.engine.name] += 1
        return self._inner.generate(prompt_ids, sampling, num_top_logprobs, on_token)


def test_each_agent_session_stays_on_the_engine_it_was_placed_on(redis_url, tmp_path):
    model_dir = write_tool_model(tmp_path / "policy")
    train = write_jsonl(tmp_path / "train.jsonl", addition_rows(4))
    recorded: list[RecordingModels] = []

    def harness(settings, run_id, models):
        recorded.append(RecordingModels(models))
        return AgentHarness(settings, run_id, recorded[-1])

    client = redis.Redis.from_url(redis_url)
    service = RolloutService(redis_records(client), None, run_agents=harness)
    try:
        info = service.configure_run(
            RolloutRunConfig(
                run_id="agents-2",
                model_dir=str(model_dir),
                seed=3,
                data=DataSettings(train=str(train), shuffle=False),
                agent=AgentSettings(function="agent_programs:two_turn_chat", concurrency=8),
                rollout=RolloutSettings(num_engines=2),
            )
        )
        result = service.generate(
            GenerateRequest(
                run_id="agents-2",
                step=1,
                samples_per_prompt=4,
                sampling=SamplingConfig(temperature=1.0, max_new_tokens=6, seed=1),
                num_groups=2,
                timeout_s=60.0,
            )
        )
        assert result.num_samples == 8 and result.num_reward_failures == 0
    finally:
        service.close()
        client.close()
    models = recorded[0]
    assert len(models.placed) == 8
    # All eight start at once, with nothing in flight: the one with fewer sessions, in turn.
    assert Counter(models.placed.values()) == {e: 4 for e in info.engine_ids}
    assert sorted(models.closed) == sorted(models.placed)  # every session forgotten at its end
    # two calls per session (the agent's two turns), each on its session's engine
    assert models.calls == {e: 8 for e in info.engine_ids}
