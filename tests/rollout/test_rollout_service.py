"""RolloutService over real checkpoints and a real Redis: groups on the run's stream, versions gating,
rewards, request validation, run lifecycle. Weight receivers are test doubles that record the apply
function, so versions can be delivered without a broker."""

from __future__ import annotations

import threading

import pytest
import redis
from rollout_models import tiny_model, tokenizer, write_checkpoint

from furlong.core.checkpoint import unique_state
from furlong.core.errors import ConflictError, NotFoundError
from furlong.core.samples import STREAM_FIELD, SampleGroup, stream_key
from furlong.core.tasks import exact_match_reward
from furlong.rollout.client import InProcessRolloutClient
from furlong.rollout.core.sampler import SamplingConfig
from furlong.rollout.core.service import RolloutService
from furlong.rollout.core.types import Prompt
from furlong.rollout.rewards import RewardError

pytestmark = pytest.mark.integration

PROMPTS = [Prompt("p0", "12+7=", "19"), Prompt("p1", "3+4=", "7"), Prompt("p2", "50+50=", "100")]
SAMPLING = SamplingConfig(temperature=1.0, top_p=0.95, max_new_tokens=6, seed=3)


class RecordingReceiver:
    def __init__(self, engine_id, apply, fail_start=False):
        self.engine_id, self.apply, self.fail_start = engine_id, apply, fail_start
        self.started = self.closed = False

    def start(self):
        if self.fail_start:
            raise ConnectionError(f"{self.engine_id}: broker unreachable")
        self.started = True

    def close(self):
        self.closed = True


class Receivers:
    def __init__(self, fail_engine: str | None = None):
        self.made: dict[str, RecordingReceiver] = {}
        self.fail_engine = fail_engine

    def __call__(self, run_id, engine_id, apply):
        self.made[engine_id] = RecordingReceiver(engine_id, apply, fail_start=engine_id == self.fail_engine)
        return self.made[engine_id]


@pytest.fixture
def checkpoint(tmp_path):
    return str(write_checkpoint(tmp_path / "policy", seed=21))


@pytest.fixture
def redis_client(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def read_groups(client, run_id):
    return [SampleGroup.decode(fields[STREAM_FIELD]) for _, fields in client.xrange(stream_key(run_id))]


def test_generate_writes_one_decodable_group_per_prompt(redis_client, checkpoint):
    receivers = Receivers()
    service = RolloutService(redis_client, receivers)
    info = service.configure_run("run-a", checkpoint, "addition_exact_match", num_engines=2, seed=5)
    assert info.engine_ids == ["run-a-engine-0", "run-a-engine-1"] and info.policy_version == 0
    assert all(r.started for r in receivers.made.values()) and sorted(receivers.made) == info.engine_ids

    result = service.generate("run-a", 4, PROMPTS, 4, SAMPLING, min_policy_version=0, timeout_s=5.0)
    groups = read_groups(redis_client, "run-a")
    assert [g.prompt_id for g in groups] == ["p0", "p1", "p2"]
    assert result.num_groups == 3 and result.num_samples == 12 and result.policy_version == 0
    assert result.step == 4 and result.run_id == "run-a" and result.generate_seconds > 0
    tok = tokenizer()
    rewards, num_tokens = [], 0
    for prompt, group in zip(PROMPTS, groups):
        assert group.run_id == "run-a" and group.step == 4
        assert [s.sample_id for s in group.samples] == [f"{prompt.prompt_id}/{i}" for i in range(4)]
        for s in group.samples:
            assert s.prompt_token_ids == tok.encode(prompt.text)
            assert s.response_text == tok.decode(s.response_token_ids)
            assert s.reward == exact_match_reward(s.response_text, prompt.answer)
            assert s.policy_version == 0 and s.finish_reason in ("eos", "length")
            assert len(s.response_logprobs) == s.sampling_support.num_rows == len(s.response_token_ids)
            rewards.append(s.reward)
            num_tokens += len(s.response_token_ids)
    assert result.num_tokens == num_tokens
    assert result.reward_mean == pytest.approx(sum(rewards) / len(rewards))

    # Same run seed, request and weights: same samples.
    service.generate("run-a", 5, PROMPTS, 4, SAMPLING, min_policy_version=0, timeout_s=5.0)
    again = read_groups(redis_client, "run-a")[3:]
    assert [[s.response_token_ids for s in g.samples] for g in again] == [
        [s.response_token_ids for s in g.samples] for g in groups
    ]
    status = service.status("run-a")
    assert [(e.engine_id, e.policy_version, e.healthy) for e in status.engines] == [
        ("run-a-engine-0", 0, True),
        ("run-a-engine-1", 0, True),
    ]

    service.end_run("run-a")
    assert all(r.closed for r in receivers.made.values())
    with pytest.raises(NotFoundError, match="run-a"):
        service.status("run-a")


def test_versions_from_receivers_gate_generation(redis_client, checkpoint):
    receivers = Receivers()
    service = RolloutService(redis_client, receivers)
    service.configure_run("run-v", checkpoint, "addition_exact_match", num_engines=2, seed=0)
    with pytest.raises(TimeoutError, match="min_policy_version 1"):
        service.generate("run-v", 0, PROMPTS, 2, SAMPLING, min_policy_version=1, timeout_s=0.2)
    assert read_groups(redis_client, "run-v") == []

    new_state = unique_state(tiny_model(99))
    receivers.made["run-v-engine-0"].apply(1, new_state)
    with pytest.raises(TimeoutError, match="'run-v-engine-1': 0"):
        service.generate("run-v", 0, PROMPTS, 2, SAMPLING, min_policy_version=1, timeout_s=0.2)

    later = threading.Timer(0.2, receivers.made["run-v-engine-1"].apply, args=(1, new_state))
    later.start()
    result = service.generate("run-v", 1, PROMPTS, 2, SAMPLING, min_policy_version=1, timeout_s=10.0)
    later.join()
    assert result.policy_version == 1
    assert {s.policy_version for g in read_groups(redis_client, "run-v") for s in g.samples} == {1}
    assert [e.policy_version for e in service.status("run-v").engines] == [1, 1]


def test_failing_reward_fails_the_request_and_writes_nothing(redis_client, checkpoint):
    def broken(response_text, answer):
        raise KeyError(answer)

    service = RolloutService(redis_client, None, rewards={"broken": broken, "nan": lambda r, a: float("nan")})
    service.configure_run("run-r", checkpoint, "broken", num_engines=1, seed=0)
    with pytest.raises(RewardError, match=r"reward 'broken' failed on prompt 'p0' sample 'p0/0': KeyError"):
        service.generate("run-r", 0, PROMPTS, 2, SAMPLING, min_policy_version=0, timeout_s=1.0)
    service.configure_run("run-n", checkpoint, "nan", num_engines=1, seed=0)
    with pytest.raises(RewardError, match="returned nan"):
        service.generate("run-n", 0, PROMPTS, 2, SAMPLING, min_policy_version=0, timeout_s=1.0)
    assert read_groups(redis_client, "run-r") == [] and read_groups(redis_client, "run-n") == []
    with pytest.raises(ValueError, match="unknown reward 'addition_exact_match'; known rewards: broken, nan"):
        service.configure_run("run-x", checkpoint, "addition_exact_match", num_engines=1, seed=0)


def test_request_validation_names_the_field(redis_client, checkpoint):
    service = RolloutService(redis_client, None)
    client = InProcessRolloutClient(service)
    client.configure_run("run-q", checkpoint, "addition_exact_match", num_engines=1, seed=0)
    good = dict(
        run_id="run-q",
        step=0,
        prompts=PROMPTS,
        samples_per_prompt=2,
        sampling=SAMPLING,
        min_policy_version=0,
        timeout_s=1.0,
    )
    bad = [
        (dict(step=-1), "step"),
        (dict(prompts=[]), "prompts must not be empty"),
        (dict(prompts=[PROMPTS[0], PROMPTS[0]]), r"prompts\[1\].prompt_id 'p0' is not unique"),
        (dict(prompts=[Prompt("", "1+1=", "2")]), r"prompts\[0\].prompt_id"),
        (dict(prompts=[Prompt("a", "", "2")]), r"prompts\[0\].text"),
        (dict(prompts=[Prompt("a", "1+x=", "2")]), "prompt 'a': character 'x'"),
        (dict(samples_per_prompt=0), "samples_per_prompt"),
        (dict(min_policy_version=-1), "min_policy_version"),
        (dict(timeout_s=0.0), "timeout_s"),
        (dict(sampling=SamplingConfig(max_new_tokens=500)), "max_position_embeddings"),
    ]
    for change, pattern in bad:
        with pytest.raises(ValueError, match=pattern):
            client.generate(**{**good, **change})
    with pytest.raises(NotFoundError, match="'nope'"):
        client.generate(**{**good, "run_id": "nope"})
    for args, pattern in [
        (("", checkpoint, "addition_exact_match", 1, 0), "run_id"),
        (("run-z", checkpoint, "addition_exact_match", 0, 0), "num_engines"),
        (("run-z", checkpoint, "addition_exact_match", 1, -3), "seed"),
        (("run-z", "/nonexistent/dir", "addition_exact_match", 1, 0), "/nonexistent/dir"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            client.configure_run(*args)
    assert read_groups(redis_client, "run-q") == []
    assert service.run_ids() == ["run-q"]


def test_configure_is_idempotent_and_conflicts_on_other_arguments(redis_client, checkpoint):
    service = RolloutService(redis_client, None)
    first = service.configure_run("run-c", checkpoint, "addition_exact_match", 1, 7)
    assert service.configure_run("run-c", checkpoint, "addition_exact_match", 1, 7) == first
    with pytest.raises(ConflictError, match="run-c is already configured"):
        service.configure_run("run-c", checkpoint, "addition_exact_match", 2, 7)
    service.end_run("run-c")
    with pytest.raises(NotFoundError):
        service.end_run("run-c")


def test_receiver_start_failure_leaves_no_run(redis_client, checkpoint):
    receivers = Receivers(fail_engine="run-f-engine-1")
    service = RolloutService(redis_client, receivers)
    with pytest.raises(ConnectionError, match="broker unreachable"):
        service.configure_run("run-f", checkpoint, "addition_exact_match", 2, 0)
    assert receivers.made["run-f-engine-0"].closed and receivers.made["run-f-engine-1"].closed
    assert service.run_ids() == []


def test_unreachable_redis_is_unavailable(checkpoint):
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from furlong.core.errors import UnavailableError
    from furlong.rpc.ports import free_port

    client = redis.Redis(
        host="127.0.0.1", port=free_port(), socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0)
    )
    service = RolloutService(client, None)
    service.configure_run("run-u", checkpoint, "addition_exact_match", 1, 0)
    # the request's ledger is the first thing written, before any engine is touched
    with pytest.raises(UnavailableError, match="ledger: cannot number run-u/0: .*Connection refused"):
        service.generate("run-u", 0, PROMPTS, 1, SAMPLING, min_policy_version=0, timeout_s=1.0)
