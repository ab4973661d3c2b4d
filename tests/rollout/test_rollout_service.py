"""RolloutService over real checkpoints and a real Redis: groups on the run's stream, versions gating,
rewards, request validation, run lifecycle, and runs with a task (prompts drawn by rollout,
over-sampled, recorded in the group ledger; a repeated step writes only what is missing). Weight
receivers are test doubles that record the apply function, so versions can be delivered without a
broker."""

from __future__ import annotations

import threading

import pytest
import redis
from rollout_models import tiny_model, tokenizer, write_checkpoint

from furlong.core.checkpoint import unique_state
from furlong.core.errors import ConflictError, NotFoundError, UnavailableError
from furlong.core.samples import STREAM_FIELD, SampleGroup, stream_key
from furlong.core.settings import RolloutSettings
from furlong.core.tasks import exact_match_reward, get_task
from furlong.ledger.group_ledger import GroupLedger, ledger_keys
from furlong.rollout.client import InProcessRolloutClient
from furlong.rollout.core.sampler import SamplingConfig
from furlong.rollout.core.service import RolloutService
from furlong.rollout.core.types import GenerateRequest, Prompt, RolloutRunConfig, RunRecords
from furlong.rollout.rewards import RewardError
from furlong.rollout.run_records import redis_records
from furlong.rollout.sample_ledger import RedisSampleLedger

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


def run_config(run_id, model_dir, reward="addition_exact_match", num_engines=1, seed=0, **fields):
    return RolloutRunConfig(
        run_id=run_id,
        model_dir=model_dir,
        reward=reward,
        seed=seed,
        rollout=RolloutSettings(num_engines=num_engines),
        **fields,
    )


def request(run_id, step, samples_per_prompt=2, prompts=PROMPTS, **fields):
    fields = {"sampling": SAMPLING, "min_policy_version": 0, "timeout_s": 5.0, **fields}
    return GenerateRequest(
        run_id=run_id, step=step, samples_per_prompt=samples_per_prompt, prompts=tuple(prompts), **fields
    )


def test_generate_writes_one_decodable_group_per_prompt(redis_client, checkpoint):
    receivers = Receivers()
    service = RolloutService(redis_records(redis_client), receivers)
    info = service.configure_run(run_config("run-a", checkpoint, num_engines=2, seed=5))
    assert info.engine_ids == ["run-a-engine-0", "run-a-engine-1"] and info.policy_version == 0
    assert all(r.started for r in receivers.made.values()) and sorted(receivers.made) == info.engine_ids

    result = service.generate(request("run-a", 4, samples_per_prompt=4))
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
    service.generate(request("run-a", 5, samples_per_prompt=4))
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
    service = RolloutService(redis_records(redis_client), receivers)
    service.configure_run(run_config("run-v", checkpoint, num_engines=2))
    with pytest.raises(TimeoutError, match="min_policy_version 1"):
        service.generate(request("run-v", 0, min_policy_version=1, timeout_s=0.2))
    assert read_groups(redis_client, "run-v") == []

    new_state = unique_state(tiny_model(99))
    receivers.made["run-v-engine-0"].apply(1, new_state)
    with pytest.raises(TimeoutError, match="'run-v-engine-1': 0"):
        service.generate(request("run-v", 0, min_policy_version=1, timeout_s=0.2))

    later = threading.Timer(0.2, receivers.made["run-v-engine-1"].apply, args=(1, new_state))
    later.start()
    result = service.generate(request("run-v", 1, min_policy_version=1, timeout_s=10.0))
    later.join()
    assert result.policy_version == 1
    assert {s.policy_version for g in read_groups(redis_client, "run-v") for s in g.samples} == {1}
    assert [e.policy_version for e in service.status("run-v").engines] == [1, 1]


def test_failing_reward_fails_the_request_and_writes_nothing(redis_client, checkpoint):
    def broken(response_text, answer):
        raise KeyError(answer)

    service = RolloutService(
        redis_records(redis_client), None, rewards={"broken": broken, "nan": lambda r, a: float("nan")}
    )
    service.configure_run(run_config("run-r", checkpoint, reward="broken"))
    with pytest.raises(RewardError, match=r"reward 'broken' failed on prompt 'p0' sample 'p0/0': KeyError"):
        service.generate(request("run-r", 0, timeout_s=1.0))
    service.configure_run(run_config("run-n", checkpoint, reward="nan"))
    with pytest.raises(RewardError, match="returned nan"):
        service.generate(request("run-n", 0, timeout_s=1.0))
    assert read_groups(redis_client, "run-r") == [] and read_groups(redis_client, "run-n") == []
    with pytest.raises(ValueError, match="unknown reward 'addition_exact_match'; known rewards: broken, nan"):
        service.configure_run(run_config("run-x", checkpoint))


def test_request_validation_names_the_field(redis_client, checkpoint):
    service = RolloutService(redis_records(redis_client), None)
    client = InProcessRolloutClient(service)
    client.configure_run(run_config("run-q", checkpoint))
    bad = [
        (dict(step=-1), "step"),
        (dict(prompts=[]), "run run-q has no task: a Generate request must carry its prompts"),
        (dict(prompts=[PROMPTS[0], PROMPTS[0]]), r"prompts\[1\].prompt_id 'p0' is not unique"),
        (dict(prompts=[Prompt("", "1+1=", "2")]), r"prompts\[0\].prompt_id"),
        (dict(prompts=[Prompt("a", "", "2")]), r"prompts\[0\].text"),
        (dict(prompts=[Prompt("a", "1+x=", "2")]), "prompt 'a': .*character 'x' at position 2"),
        (dict(samples_per_prompt=0), "samples_per_prompt"),
        (dict(min_policy_version=-1), "min_policy_version"),
        (dict(timeout_s=0.0), "timeout_s"),
        (dict(num_groups=-1), r"num_groups must be an integer \[0, 3\], got -1"),
        (dict(num_groups=4), r"num_groups must be an integer \[0, 3\], got 4"),
        (dict(sampling=SamplingConfig(max_new_tokens=500)), "max_position_embeddings"),
    ]
    for change, pattern in bad:
        with pytest.raises(ValueError, match=pattern):
            client.generate(request("run-q", **{"step": 0, "timeout_s": 1.0, **change}))
    with pytest.raises(NotFoundError, match="'nope'"):
        client.generate(request("nope", 0, timeout_s=1.0))
    for fields, pattern in [
        (dict(run_id=""), "run_id"),
        (dict(num_engines=0), r"^num_engines: must be an integer in \[1, 64\], got 0"),
        (dict(seed=-3), "seed"),
        (dict(model_dir="/nonexistent/dir"), "/nonexistent/dir"),
        (dict(reward="", task=""), "a run needs a task or a reward"),
        (dict(task="subtraction"), "unknown task 'subtraction'; known tasks: addition"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            client.configure_run(run_config(**{"run_id": "run-z", "model_dir": checkpoint, **fields}))
    assert read_groups(redis_client, "run-q") == []
    assert service.run_ids() == ["run-q"]


def test_configure_is_idempotent_and_conflicts_on_other_arguments(redis_client, checkpoint):
    service = RolloutService(redis_records(redis_client), None)
    first = service.configure_run(run_config("run-c", checkpoint, seed=7))
    assert service.configure_run(run_config("run-c", checkpoint, seed=7)) == first
    with pytest.raises(ConflictError, match="run-c is already configured"):
        service.configure_run(run_config("run-c", checkpoint, num_engines=2, seed=7))
    service.end_run("run-c")
    with pytest.raises(NotFoundError):
        service.end_run("run-c")


def test_receiver_start_failure_leaves_no_run(redis_client, checkpoint):
    receivers = Receivers(fail_engine="run-f-engine-1")
    service = RolloutService(redis_records(redis_client), receivers)
    with pytest.raises(ConnectionError, match="broker unreachable"):
        service.configure_run(run_config("run-f", checkpoint, num_engines=2))
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
    service = RolloutService(redis_records(client), None)
    service.configure_run(run_config("run-u", checkpoint))
    # the request's ledger is the first thing written, before any engine is touched
    with pytest.raises(UnavailableError, match="ledger: cannot number run-u/0: .*Connection refused"):
        service.generate(request("run-u", 0, samples_per_prompt=1, timeout_s=1.0))


def task_config(run_id, model_dir, **rollout):
    return RolloutRunConfig(
        run_id=run_id, model_dir=model_dir, seed=3, task="addition", rollout=RolloutSettings(**rollout)
    )


def ledger_ids(client, run_id, part):
    """The ledger ids in one hash of the run's group ledger ("submitted" or "generated")."""
    key = {"submitted": ledger_keys(run_id)[0], "generated": ledger_keys(run_id)[1]}[part]
    return sorted(k.decode() for k in client.hkeys(key))


def test_task_run_draws_over_sampled_prompts_and_writes_the_groups_it_needs(redis_client, checkpoint):
    service = RolloutService(redis_records(redis_client), None)
    service.configure_run(task_config("run-t", checkpoint, num_engines=2, over_sampling=1.5))
    result = service.generate(request("run-t", 2, prompts=(), num_groups=4))

    drawn = {p.prompt_id: p for p in get_task("addition").prompts(3, 2, 6)}
    groups = read_groups(redis_client, "run-t")
    kept = [g.prompt_id for g in groups]
    assert len(kept) == 4 and set(kept) < set(drawn)
    assert kept == [p for p in drawn if p in kept]  # written in the order they were drawn
    assert (result.num_groups, result.num_samples, result.num_groups_surplus) == (4, 8, 2)
    assert result.num_groups_resumed == 0 and result.request_id == "run-t/2/1"
    tok = tokenizer()
    for group in groups:
        assert group.step == 2 and [s.sample_id for s in group.samples] == [
            f"{group.prompt_id}/{i}" for i in (0, 1)
        ]
        for s in group.samples:  # the task's prompts, scored by the task's reward
            assert s.prompt_token_ids == tok.encode(drawn[group.prompt_id].text)
            assert s.reward == exact_match_reward(s.response_text, drawn[group.prompt_id].answer)

    # 6 submitted: the 4 written are generated, the other 2 are cut (they leave `submitted`).
    ledger = GroupLedger(redis_client, "run-t")
    audit = ledger.audit(finished_step=2)
    assert (audit.submitted, audit.generated, audit.cut, audit.resubmitted) == (4, 4, 2, 0)
    assert ledger_ids(redis_client, "run-t", "submitted") == sorted(f"2/{p}" for p in kept)
    assert ledger_ids(redis_client, "run-t", "generated") == sorted(f"2/{p}" for p in kept)
    assert audit.lost_ids == sorted(f"2/{p}" for p in kept)  # untrained yet; the cut ones are not lost
    counts = service.status("run-t").ledger
    assert (counts.done, counts.surplus, counts.pending, counts.in_flight) == (8, 4, 0, 0)

    # The same step again (a controller retrying after a crash): everything it needs is written.
    again = service.generate(request("run-t", 2, prompts=(), num_groups=4))
    assert (again.num_groups, again.num_groups_resumed, again.num_samples, again.num_tokens) == (4, 4, 0, 0)
    assert again.request_id == ""
    assert [g.prompt_id for g in read_groups(redis_client, "run-t")] == kept
    assert ledger.audit(finished_step=2) == audit

    with pytest.raises(ValueError, match=r"num_groups must be an integer \[1, 16384\], got 0"):
        service.generate(request("run-t", 3, prompts=()))
    assert len(read_groups(redis_client, "run-t")) == 4


class CutFailsOnce:
    """The run's group ledger, with the connection lost at the first `cut`: an attempt at a step that
    wrote its groups and crashed before recording the rest cut."""

    def __init__(self, ledger):
        self._ledger, self.failed = ledger, False

    def generated_ids(self, step, prompt_ids):
        return self._ledger.generated_ids(step, prompt_ids)

    def submit(self, step, prompt_ids):
        self._ledger.submit(step, prompt_ids)

    def cut(self, step, prompt_ids):
        if not self.failed:
            self.failed = True
            raise UnavailableError("redis (sample ledger): connection lost")
        self._ledger.cut(step, prompt_ids)

    def append_groups(self, groups):
        return self._ledger.append_groups(groups)


def test_a_step_repeated_after_a_crash_cuts_what_the_crash_left_submitted(redis_client, checkpoint):
    def records(run_id):
        groups = CutFailsOnce(GroupLedger(redis_client, run_id))
        return RunRecords(samples=RedisSampleLedger(redis_client, scope=run_id), groups=groups)

    service = RolloutService(records, None)
    service.configure_run(task_config("run-k", checkpoint, over_sampling=1.5))
    with pytest.raises(UnavailableError, match="connection lost"):
        service.generate(request("run-k", 0, prompts=(), num_groups=2))
    kept = [g.prompt_id for g in read_groups(redis_client, "run-k")]
    assert len(kept) == 2 and len(ledger_ids(redis_client, "run-k", "submitted")) == 3

    again = service.generate(request("run-k", 0, prompts=(), num_groups=2))
    assert (again.num_groups, again.num_groups_resumed, again.num_samples) == (2, 2, 0)
    assert [g.prompt_id for g in read_groups(redis_client, "run-k")] == kept
    audit = GroupLedger(redis_client, "run-k").audit(finished_step=0)
    assert (audit.submitted, audit.generated, audit.cut) == (2, 2, 1)
    assert audit.lost_ids == sorted(f"0/{p}" for p in kept)


def test_asynchronous_mode_draws_again_the_groups_an_earlier_attempt_drew_with_too_old_a_version(
    redis_client, checkpoint
):
    receivers = Receivers()
    service = RolloutService(redis_records(redis_client), receivers)
    service.configure_run(task_config("run-redraw", checkpoint, max_staleness=1))
    first = service.generate(request("run-redraw", 3, prompts=(), num_groups=2))  # drawn with version 0
    assert first.num_groups == 2 and first.policy_version == 0
    # a recovery: the engines now serve version 2; a group drawn with 0 is too old for this request
    receivers.made["run-redraw-engine-0"].apply(2, unique_state(tiny_model(5)))
    again = service.generate(request("run-redraw", 3, prompts=(), num_groups=2, min_policy_version=2))
    assert (again.num_groups, again.num_groups_resumed, again.num_samples) == (2, 0, 4)
    assert again.policy_version == 2
    groups = read_groups(redis_client, "run-redraw")
    assert [g.prompt_id for g in groups[2:]] == [g.prompt_id for g in groups[:2]]
    assert {s.policy_version for g in groups[2:] for s in g.samples} == {2}
    ledger = GroupLedger(redis_client, "run-redraw")
    entries = [e.decode() for e, _ in redis_client.xrange(stream_key("run-redraw"))]
    for group, old, new in zip(groups[:2], entries[:2], entries[2:]):
        # the new entry owns the id; the trainer refuses the old one as a duplicate
        assert ledger.claim(old, 3, group.prompt_id, [0]) == f"duplicate:{new}"
    audit = ledger.audit(finished_step=2)
    assert (audit.stale_redrawn, audit.resubmitted, audit.generated) == (2, 2, 2)
    # groups recent enough are kept
    kept = service.generate(request("run-redraw", 3, prompts=(), num_groups=2, min_policy_version=2))
    assert (kept.num_groups_resumed, kept.num_samples) == (2, 0)


def test_a_synchronous_run_keeps_the_groups_an_earlier_attempt_drew(redis_client, checkpoint):
    receivers = Receivers()
    service = RolloutService(redis_records(redis_client), receivers)
    service.configure_run(task_config("run-keep", checkpoint))
    service.generate(request("run-keep", 3, prompts=(), num_groups=2))
    receivers.made["run-keep-engine-0"].apply(2, unique_state(tiny_model(5)))
    again = service.generate(request("run-keep", 3, prompts=(), num_groups=2, min_policy_version=2))
    assert (again.num_groups, again.num_groups_resumed, again.num_samples) == (2, 2, 0)
    assert GroupLedger(redis_client, "run-keep").audit().stale_redrawn == 0
