"""The trainer's stream consumer against a real Redis: ack semantics, replay after a crash, and
rejection of malformed entries without dropping anything else."""

import pytest
import redis

from furlong.core.samples import STREAM_FIELD, Sample, SampleGroup, stream_key
from furlong.core.sampling_mask import RolloutSamplingMask
from furlong.trainer.sample_reader import SampleReader, rejected_key

pytestmark = pytest.mark.integration


def make_group(run_id: str, prompt_id: str, reward: float = 1.0) -> SampleGroup:
    support = RolloutSamplingMask.from_lists([[3, 4], [2]], vocab_size=8)
    sample = Sample(
        sample_id=f"{prompt_id}/0",
        prompt_token_ids=[1, 5],
        response_token_ids=[4, 2],
        response_logprobs=[-0.7, 0.0],
        sampling_support=support,
        reward=reward,
        policy_version=0,
        finish_reason="eos",
    )
    return SampleGroup(run_id=run_id, step=1, prompt_id=prompt_id, samples=[sample])


def test_reads_in_order_and_acks(redis_url):
    client = redis.Redis.from_url(redis_url)
    reader = SampleReader(client, "r1", "trainer-0")
    for i in range(3):
        client.xadd(stream_key("r1"), {STREAM_FIELD: make_group("r1", f"p{i}").encode()})
    batch = reader.read(2, timeout_s=5)
    assert [g.prompt_id for g in batch.groups] == ["p0", "p1"]
    assert reader.ack(batch.entry_ids) == 2
    batch2 = reader.read(1, timeout_s=5)
    assert [g.prompt_id for g in batch2.groups] == ["p2"]
    pending = client.xpending(stream_key("r1"), "trainers")
    assert pending["pending"] == 1


def test_unacked_entries_are_replayed_after_restart(redis_url):
    client = redis.Redis.from_url(redis_url)
    first = SampleReader(client, "r2", "trainer-0")
    for i in range(2):
        client.xadd(stream_key("r2"), {STREAM_FIELD: make_group("r2", f"p{i}").encode()})
    first.read(2, timeout_s=5)  # crash before ack
    restarted = SampleReader(client, "r2", "trainer-0")
    client.xadd(stream_key("r2"), {STREAM_FIELD: make_group("r2", "p2").encode()})
    batch = restarted.read(3, timeout_s=5)
    assert [g.prompt_id for g in batch.groups] == ["p0", "p1", "p2"]


def test_malformed_entry_is_rejected_and_others_kept(redis_url):
    client = redis.Redis.from_url(redis_url)
    reader = SampleReader(client, "r3", "trainer-0")
    client.xadd(stream_key("r3"), {STREAM_FIELD: make_group("r3", "p0").encode()})
    bad_id = client.xadd(stream_key("r3"), {STREAM_FIELD: b'{"run_id": "r3", "step": 1}'})
    client.xadd(stream_key("r3"), {STREAM_FIELD: make_group("other-run", "px").encode()})
    client.xadd(stream_key("r3"), {STREAM_FIELD: make_group("r3", "p1").encode()})
    batch = reader.read(2, timeout_s=5)
    assert [g.prompt_id for g in batch.groups] == ["p0", "p1"]
    assert batch.num_rejected == 2
    rejected = client.xrange(rejected_key("r3"))
    assert len(rejected) == 2
    assert rejected[0][1][b"entry_id"] == bad_id
    assert b"prompt_id" in rejected[0][1][b"reason"]
    assert b"other-run" in rejected[1][1][b"reason"]


def test_timeout_names_the_shortfall(redis_url):
    client = redis.Redis.from_url(redis_url)
    reader = SampleReader(client, "r4", "trainer-0")
    client.xadd(stream_key("r4"), {STREAM_FIELD: make_group("r4", "p0").encode()})
    with pytest.raises(TimeoutError, match="1 of 2 sample groups"):
        reader.read(2, timeout_s=0.3)


def test_entries_read_by_a_failed_call_are_read_again(redis_url):
    client = redis.Redis.from_url(redis_url)
    reader = SampleReader(client, "r5", "trainer-0")
    for i in range(3):
        client.xadd(stream_key("r5"), {STREAM_FIELD: make_group("r5", f"p{i}").encode()})
    with pytest.raises(TimeoutError):
        reader.read(4, timeout_s=0.3)
    batch = reader.read(3, timeout_s=5)
    assert [g.prompt_id for g in batch.groups] == ["p0", "p1", "p2"]
    client.xadd(stream_key("r5"), {STREAM_FIELD: make_group("r5", "p3").encode()})
    reader.ack(batch.entry_ids)
    assert [g.prompt_id for g in reader.read(1, timeout_s=5).groups] == ["p3"]


def test_a_step_reads_only_its_own_groups_and_later_steps_wait_for_theirs(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.delete(stream_key("r-ahead"))
    reader = SampleReader(client, "r-ahead", "trainer-0")

    def write(step: int, prompt_id: str) -> None:
        group = make_group("r-ahead", prompt_id)
        group = SampleGroup(run_id=group.run_id, step=step, prompt_id=prompt_id, samples=group.samples)
        client.xadd(stream_key("r-ahead"), {STREAM_FIELD: group.encode()})

    # asynchronous mode after a recovery: step 3 was generated before the rest of step 2
    for step, prompt_id in ((2, "a"), (3, "b"), (3, "c"), (2, "d"), (4, "e")):
        write(step, prompt_id)
    step2 = reader.read(2, timeout_s=5, only_step=2)
    assert [(g.step, g.prompt_id) for g in step2.groups] == [(2, "a"), (2, "d")]
    reader.ack(step2.entry_ids)
    step3 = reader.read(2, timeout_s=5, only_step=3)
    assert [(g.step, g.prompt_id) for g in step3.groups] == [(3, "b"), (3, "c")]
    reader.ack(step3.entry_ids)
    with pytest.raises(TimeoutError, match="0 of 1 sample groups"):
        reader.read(1, timeout_s=0.3, only_step=3)  # step 4's group is not step 3's
    # a restarted trainer finds the later step's group pending
    restarted = SampleReader(client, "r-ahead", "trainer-0")
    step4 = restarted.read(1, timeout_s=5, only_step=4)
    assert [(g.step, g.prompt_id) for g in step4.groups] == [(4, "e")]
    # without only_step the next groups are read whatever their step
    write(9, "f")
    assert [g.prompt_id for g in reader.read(2, timeout_s=5).groups] == ["e", "f"]
