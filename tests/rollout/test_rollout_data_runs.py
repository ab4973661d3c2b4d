"""Runs on dataset rows in the rollout service over a real checkpoint and Redis: a step draws the
rows its number assigns (a repeated step the same ones), chats are rendered with the model's chat
template, groups are scored as they complete, and a reward that fails or times out is an
infrastructure failure: counted (Prometheus and the result), its group left out of the step or
resampled, never a 0."""

from __future__ import annotations

import pytest
import redis
import rollout_user_rewards
import torch
from data_files import addition_rows, write_jsonl
from prometheus_client import CollectorRegistry
from rollout_models import write_checkpoint

from furlong.core.data_order import DataOrder
from furlong.core.samples import STREAM_FIELD, SampleGroup, stream_key
from furlong.core.settings import DataSettings, RewardSettings, RolloutSettings
from furlong.core.settings.reward import ExactMatchReward, PythonReward
from furlong.core.task_data import DataRow, RowError
from furlong.core.tokenizer import char_tokenizer
from furlong.ledger.group_ledger import GroupLedger
from furlong.rollout.core.data_source import render_row
from furlong.rollout.core.sampler import SamplingConfig
from furlong.rollout.core.service import RolloutService
from furlong.rollout.core.types import GenerateRequest, RolloutRunConfig
from furlong.rollout.metrics import REWARD_FAILURES_TOTAL, RolloutMetrics
from furlong.rollout.rewards import RewardError
from furlong.rollout.run_records import redis_records
from furlong.rollout.run_reward import build_run_reward

pytestmark = pytest.mark.integration
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=4, seed=3)


@pytest.fixture
def checkpoint(tmp_path):
    return str(write_checkpoint(tmp_path / "policy", seed=21))


@pytest.fixture
def red(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def groups_of(client, run_id):
    return [SampleGroup.decode(f[STREAM_FIELD]) for _, f in client.xrange(stream_key(run_id))]


def config(run_id, model_dir, path, reward: RewardSettings, **rollout) -> RolloutRunConfig:
    return RolloutRunConfig(
        run_id=run_id,
        model_dir=model_dir,
        seed=4,
        data=DataSettings(train=str(path)),
        reward_config=reward,
        rollout=RolloutSettings(**rollout),
    )


def step(run_id, number, groups=2, n=2, timeout_s=30.0):
    return GenerateRequest(
        run_id=run_id,
        step=number,
        samples_per_prompt=n,
        sampling=SAMPLING,
        num_groups=groups,
        timeout_s=timeout_s,
    )


EXACT = RewardSettings(exact_match=ExactMatchReward(weight=1.0))


def test_steps_draw_their_rows_and_a_repeated_step_the_same(red, checkpoint, tmp_path):
    rows = addition_rows(5)
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    service = RolloutService(redis_records(red), None, run_rewards=build_run_reward)
    try:
        service.configure_run(config("data-a", checkpoint, path, EXACT))
        order = DataOrder(5, seed=4)
        for number in (1, 2, 3):
            result = service.generate(step("data-a", number))
            assert result.num_groups == 2 and result.num_reward_failures == 0
        written = groups_of(red, "data-a")
        expected = [ref.prompt_id for number in (1, 2, 3) for ref in order.step_rows(number, 2)]
        assert [g.prompt_id for g in written] == expected
        for g in written:  # the row's prompt, scored against the row's answer
            row = rows[int(g.prompt_id.split("-r")[1])]
            assert all(s.reward == float(s.response_text.strip() == row["answer"]) for s in g.samples)
        again = service.generate(step("data-a", 2))  # a step repeated after a crash: same rows
        assert again.num_groups_resumed == 2 and again.num_samples == 0
        assert len(groups_of(red, "data-a")) == 6
        audit = GroupLedger(red, "data-a").audit().to_dict()
        assert audit["submitted"] == 6 and audit["generated"] == 6  # the read position, by step
    finally:
        service.close()


def test_a_malformed_row_fails_configure_naming_file_line_and_field(red, checkpoint, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "1+x=", "answer": "3"}\n')
    service = RolloutService(redis_records(red), None, run_rewards=build_run_reward)
    try:  # 'x' is outside the tiny tokenizer's alphabet: the row cannot be encoded
        with pytest.raises(RowError, match=r"bad.jsonl line 2: .*character 'x'"):
            service.configure_run(config("data-bad", checkpoint, path, EXACT))
        assert service.run_ids() == []
    finally:
        service.close()


def test_chat_rows_are_rendered_with_the_chat_template():
    template = (
        "{% for m in messages %}{{ m['content'] }}={% endfor %}{% if tools %}{{ tools | length }}{% endif %}"
    )
    tok = char_tokenizer("0123456789+=", chat_template=template)
    row = DataRow(index=0, answer="5", messages=({"role": "user", "content": "2+3"},))
    text, ids = render_row(tok, row)
    assert text == "2+3=" and ids == tok.encode("2+3=", add_bos=False)
    tools = ({"type": "function", "function": {"name": "calc"}},)
    assert render_row(tok, DataRow(index=0, answer="", messages=row.messages, tools=tools))[0] == "2+3=1"
    plain = char_tokenizer("0123456789+=")
    with pytest.raises(ValueError, match="no chat template"):
        render_row(plain, row)
    assert render_row(plain, DataRow(index=0, answer="", prompt="1+1="))[1] == plain.encode("1+1=")


def test_a_reward_timeout_is_an_infrastructure_failure_and_its_group_is_left_out(red, checkpoint, tmp_path):
    rows = addition_rows(4)
    rows[1]["metadata"] = {"index": 1, "hang": 1}
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    registry = CollectorRegistry()
    service = RolloutService(
        redis_records(red), None, run_rewards=build_run_reward, observer=RolloutMetrics(registry)
    )
    reward = RewardSettings(
        python=PythonReward(weight=1.0, function="rollout_user_rewards:hangs_on_flagged"), timeout_s=1.0
    )
    rollout_user_rewards.RELEASE.clear()
    try:
        service.configure_run(config("data-hang", checkpoint, path, reward))
        result = service.generate(step("data-hang", 1, groups=4))
        written = groups_of(red, "data-hang")
        hung = "e0-r1"
        assert hung in [r.prompt_id for r in DataOrder(4, seed=4).step_rows(1, 4)]
        assert hung not in [g.prompt_id for g in written]  # left out, not scored 0
        assert len(written) == 3 and result.num_groups == 3 and result.num_reward_failures == 1
        assert all(s.reward == 1.0 for g in written for s in g.samples)
        assert (
            registry.get_sample_value(REWARD_FAILURES_TOTAL, {"run_id": "data-hang", "kind": "timeout"}) == 1
        )
        assert registry.get_sample_value(REWARD_FAILURES_TOTAL, {"run_id": "data-hang", "kind": "error"}) == 0
        audit = GroupLedger(red, "data-hang").audit().to_dict()
        assert audit["cut"] == 1  # the ledger records it drawn and cut
    finally:
        rollout_user_rewards.RELEASE.set()
        service.close()


def test_a_failed_reward_is_resampled_when_the_spec_says_so(red, checkpoint, tmp_path):
    rows = addition_rows(3)
    rows[0]["metadata"] = {"index": 0, "flaky": 1}
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    rollout_user_rewards.CALLS.clear()
    reward = RewardSettings(
        python=PythonReward(weight=1.0, function="rollout_user_rewards:fails_first_time"),
        on_failure="resample",
        max_resamples=2,
    )
    registry = CollectorRegistry()
    service = RolloutService(
        redis_records(red), None, run_rewards=build_run_reward, observer=RolloutMetrics(registry)
    )
    try:
        service.configure_run(config("data-flaky", checkpoint, path, reward))
        result = service.generate(step("data-flaky", 1, groups=3))
        written = groups_of(red, "data-flaky")
        assert sorted(g.prompt_id for g in written) == ["e0-r0", "e0-r1", "e0-r2"]  # resampled, kept
        assert result.num_reward_failures == 1 and result.num_groups == 3
        assert (
            registry.get_sample_value(REWARD_FAILURES_TOTAL, {"run_id": "data-flaky", "kind": "error"}) == 1
        )
    finally:
        service.close()


def test_when_every_group_fails_the_request_fails_and_writes_nothing(red, checkpoint, tmp_path):
    rows = [{**r, "metadata": {"index": i, "hang": 1}} for i, r in enumerate(addition_rows(2))]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    reward = RewardSettings(
        python=PythonReward(weight=1.0, function="rollout_user_rewards:hangs_on_flagged"), timeout_s=0.5
    )
    rollout_user_rewards.RELEASE.clear()
    service = RolloutService(redis_records(red), None, run_rewards=build_run_reward)
    try:
        service.configure_run(config("data-allfail", checkpoint, path, reward))
        with pytest.raises(RewardError, match=r"did not finish within 0.5 s .*every group's reward failed"):
            service.generate(step("data-allfail", 1))
        assert groups_of(red, "data-allfail") == []
    finally:
        rollout_user_rewards.RELEASE.set()
        service.close()


class GatedEngines:
    """An EngineSet double whose second half of the rows is generated only once a reward has been
    computed for the first half: if scoring waited for the whole generation, it would deadlock."""

    engine_ids = ["gated-0"]
    max_positions = None

    def __init__(self, scored) -> None:
        self.scored = scored

    def policy_version(self) -> int:
        return 0

    def wait_for_version(self, min_version: int, timeout_s: float) -> bool:
        return True

    def generate(self, request_id, rows, sampling, seed_of, enough=None):
        from furlong.core.sampling_mask import RolloutSamplingMask
        from furlong.rollout.core.engine import Generation

        def gen(sid):
            return Generation(
                token_ids=[3],
                logprobs=[-0.5],
                support=RolloutSamplingMask.full(1, 15),
                finish_reason="length",
                text="1",
                policy_version=0,
            )

        half = len(rows) // 2
        out = {sid: gen(sid) for sid, _ in rows[:half]}
        assert enough is not None
        enough(out)  # results so far, as an engine reports them
        assert self.scored.wait(20), "the first groups were not scored while generation went on"
        out.update({sid: gen(sid) for sid, _ in rows[half:]})
        return out

    def status(self):
        return []

    def drain(self, engine_id):
        raise NotImplementedError

    def close(self) -> None:
        pass


def test_groups_are_scored_while_the_others_are_still_generated(red, tmp_path):
    import threading

    from rollout_models import tokenizer

    scored = threading.Event()

    class Marking:
        name = "marking"

        def __call__(self, response_text, prompt):
            scored.set()
            return 1.0

        def close(self):
            pass

    path = write_jsonl(tmp_path / "rows.jsonl", addition_rows(4))
    service = RolloutService(
        redis_records(red),
        None,
        policy_loader=lambda model_dir: (torch.nn.Linear(1, 1), tokenizer()),  # engines are fakes
        engines=lambda *args: GatedEngines(scored),
        run_rewards=lambda settings: Marking(),
    )
    try:
        service.configure_run(config("data-gated", "/unused/model", path, EXACT))
        result = service.generate(step("data-gated", 1, groups=4))
        assert result.num_groups == 4 and scored.is_set()
    finally:
        service.close()
