"""Multi-turn runs in the rollout service over a real checkpoint, real Redis and real environment
worker processes: every sample's token ids are exactly the engine's ids of each assistant turn
followed by the chat template's ids of the environment's answer, turn by turn (each turn is
generated from the ids so far, never from re-tokenised text); the loss mask covers exactly the
engine's ids, and the trainer's micro-batch trains on those ids under that mask. An environment
that crashes or hangs is an infrastructure failure: counted, its group left out."""

from __future__ import annotations

import pytest
import redis
import torch
from data_files import write_jsonl
from prometheus_client import CollectorRegistry
from rollout_environments import COUNT_TOOL, TURN_REWARD, TURNS, tool_answer
from tool_chat import write_tool_model

from furlong.core.checkpoint import load_policy
from furlong.core.samples import STREAM_FIELD, SampleGroup, stream_key
from furlong.core.settings import DataSettings, EnvironmentSettings
from furlong.rollout.core.engine_set import in_process_factory
from furlong.rollout.core.sampler import SamplingConfig
from furlong.rollout.core.sampling import SupportBound
from furlong.rollout.core.service import RolloutService
from furlong.rollout.core.types import GenerateRequest, NullObserver, RolloutRunConfig
from furlong.rollout.environment_workers import environment_pool
from furlong.rollout.metrics import ENVIRONMENT_FAILURES_TOTAL, RolloutMetrics
from furlong.rollout.rewards import RewardError
from furlong.rollout.run_records import redis_records
from furlong.trainer.core.batch import Row, build_micro_batch

pytestmark = pytest.mark.integration
ENV = "rollout_environments:CountingEnvironment"
PER_TURN = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tool_model(tmp_path_factory.mktemp("tool-model") / "policy")


@pytest.fixture
def red(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


class RecordingEngines:
    """The run's real engines; every generate call's rows and results are kept (the engine's ids)."""

    def __init__(self, inner):
        self._inner = inner
        self.calls: list[tuple[str, dict[str, list[int]], int, dict]] = []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def generate(self, request_id, rows, sampling, seed_of, enough=None):
        out = self._inner.generate(request_id, rows, sampling, seed_of, enough)
        self.calls.append(
            (request_id, {sid: list(ids) for sid, ids in rows}, sampling.max_new_tokens, dict(out))
        )
        return out


def service_with(red, registry=None):
    spies: list[RecordingEngines] = []
    make = in_process_factory(
        max_batch_size=64, support_bound=SupportBound(), receiver_factory=None, observer=NullObserver()
    )

    def engines(*args):
        spies.append(RecordingEngines(make(*args)))
        return spies[-1]

    observer = RolloutMetrics(registry) if registry is not None else None
    service = RolloutService(
        redis_records(red), None, engines=engines, observer=observer, run_environments=environment_pool
    )
    return service, spies


def rows(modes=("", "")):
    return [
        {
            "messages": [{"role": "user", "content": f"the quick brown fox {i}"}],
            "answer": "",
            "metadata": {"mode": mode},
        }
        for i, mode in enumerate(modes)
    ]


def run_config(run_id, model_dir, path, **environment):
    settings = dict(
        name=ENV, max_turns=4, max_tokens_per_turn=PER_TURN, max_episode_tokens=64, timeout_s=60.0
    )
    settings.update(environment)
    return RolloutRunConfig(
        run_id=run_id,
        model_dir=str(model_dir),
        seed=5,
        data=DataSettings(train=str(path), shuffle=False),
        environment=EnvironmentSettings(**settings),
    )


def step(run_id, groups=2, n=3):
    return GenerateRequest(
        run_id=run_id,
        step=1,
        samples_per_prompt=n,
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=PER_TURN, seed=9),
        num_groups=groups,
        timeout_s=60.0,
    )


def groups_of(client, run_id):
    return [SampleGroup.decode(f[STREAM_FIELD]) for _, f in client.xrange(stream_key(run_id))]


def test_trained_ids_are_the_engine_ids_and_the_template_ids_turn_by_turn(red, model_dir, tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", rows())
    _, tokenizer = load_policy(model_dir)
    hf = tokenizer.hf
    service, spies = service_with(red)
    try:
        service.configure_run(run_config("env-exact", model_dir, path))
        result = service.generate(step("env-exact"))
        assert result.num_groups == 2 and result.num_samples == 6 and result.num_reward_failures == 0
        written = groups_of(red, "env-exact")
    finally:
        service.close()
    calls = spies[0].calls
    turns_seen = 0
    for group in written:
        index = int(group.prompt_id.split("-r")[1])
        messages = rows()[index]["messages"]
        prompt_text = hf.apply_chat_template(
            messages, tools=[COUNT_TOOL], add_generation_prompt=True, tokenize=False
        )
        prompt = tokenizer.encode(prompt_text, add_bos=False)
        for s in group.samples:
            assert s.prompt_token_ids == prompt
            mine = [(rid, ctx[s.sample_id], g[s.sample_id]) for rid, ctx, _, g in calls if s.sample_id in ctx]
            assert [rid.rsplit("/", 1)[-1] for rid, _, _ in mine][1:] == [
                f"t{t}" for t in range(1, len(mine))
            ]
            expected, mask, logprobs = [], [], []
            for turn, (_, context, g) in enumerate(mine):
                assert context == prompt + expected  # each turn continues from the ids so far
                expected += g.token_ids
                mask += [1] * len(g.token_ids)
                logprobs += g.logprobs
                if turn + 1 < len(mine):  # the environment answered and the episode went on
                    assert g.finish_reason == "eos" and g.token_ids[-1] == tokenizer.eos_id
                    answer = (
                        "\n<|im_start|>user\n<tool_response>\n"
                        + tool_answer(turn + 1, g.text)
                        + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
                    )
                    env_ids = tokenizer.encode(answer, add_bos=False)
                    expected += env_ids
                    mask += [0] * len(env_ids)
                    logprobs += [0.0] * len(env_ids)
            assert s.response_token_ids == expected
            assert s.loss_mask == mask
            assert [lp for lp, m in zip(s.response_logprobs, mask) if m] == [
                lp for lp, m in zip(logprobs, mask) if m
            ]
            assert s.reward == pytest.approx(TURN_REWARD * len(mine))
            last = mine[-1][2]
            done = len(mine) == TURNS and last.finish_reason == "eos"
            assert s.finish_reason == (
                "eos" if done else last.finish_reason if last.finish_reason != "eos" else "length"
            )
            turns_seen = max(turns_seen, len(mine))
            # The trainer's micro-batch: exactly these ids, trained under exactly this mask.
            mb = build_micro_batch([Row(s, torch.ones(len(s.response_token_ids)))])
            assert mb.targets.tolist() == expected
            assert mb.loss_mask.tolist() == [float(m) for m in mask]
            assert mb.input_ids[0].tolist() == (prompt + expected)[:-1]
            assert mb.num_policy_tokens == sum(mask) and (sum(mask) < len(expected)) == (len(mine) > 1)
    assert turns_seen >= 2  # at least one episode had an environment turn in the middle


def test_a_crashed_or_hung_environment_fails_its_group_only(red, model_dir, tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", rows(("", "crash", "hang")))
    registry = CollectorRegistry()
    service, _ = service_with(red, registry)
    try:
        service.configure_run(run_config("env-fail", model_dir, path, timeout_s=5.0, num_workers=3))
        result = service.generate(step("env-fail", groups=3, n=2))
        written = groups_of(red, "env-fail")
        assert [g.prompt_id for g in written] == ["e0-r0"] and result.num_reward_failures == 2
        value = registry.get_sample_value
        assert value(ENVIRONMENT_FAILURES_TOTAL, {"run_id": "env-fail", "kind": "error"}) == 1
        assert value(ENVIRONMENT_FAILURES_TOTAL, {"run_id": "env-fail", "kind": "timeout"}) == 1
    finally:
        service.close()


def test_every_group_failing_writes_nothing_and_bad_names_are_refused(red, model_dir, tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", rows(("hang_reset",)))
    service, _ = service_with(red)
    try:
        service.configure_run(run_config("env-none", model_dir, path, timeout_s=3.0))
        with pytest.raises(RewardError, match="did not answer reset within 3 s"):
            service.generate(step("env-none", groups=1, n=2))
        assert groups_of(red, "env-none") == []
        service.configure_run(run_config("env-bad", model_dir, path, name="rollout_environments:Missing"))
        with pytest.raises(RewardError, match="has no class 'Missing'"):
            service.generate(step("env-bad", groups=1, n=2))
    finally:
        service.close()
