"""The run's group ledger on a real Redis: states, atomic refusals, atomic appends, the audit."""

from __future__ import annotations

import json

import pytest
import redis

from furlong.core.samples import STREAM_FIELD, Sample, SampleGroup, stream_key
from furlong.core.sampling_mask import RolloutSamplingMask
from furlong.ledger.__main__ import main
from furlong.ledger.group_ledger import GroupLedger, ledger_id, ledger_keys

pytestmark = pytest.mark.integration


@pytest.fixture
def client(redis_url):
    c = redis.Redis.from_url(redis_url)
    c.delete(*ledger_keys("run"), stream_key("run"))  # the server is shared by the session
    yield c
    c.close()


def _sample_group(run_id: str, step: int, prompt_id: str, version: int = 0) -> SampleGroup:
    sample = Sample(
        sample_id=f"{prompt_id}/0",
        prompt_token_ids=[1, 2],
        response_token_ids=[3],
        response_logprobs=[-0.5],
        sampling_support=RolloutSamplingMask.from_lists([[3, 4]], 8),
        reward=1.0,
        policy_version=version,
        finish_reason="eos",
    )
    return SampleGroup(run_id=run_id, step=step, prompt_id=prompt_id, samples=[sample])


def test_ids_are_deterministic_and_checked():
    assert ledger_id(3, "s3-1") == "3/s3-1"
    with pytest.raises(ValueError, match="prompt id"):
        ledger_id(1, "")


def test_a_trained_id_is_refused_before_and_when_marking_again(client):
    ledger = GroupLedger(client, "run")
    assert ledger.claim("1-0", 1, "p0", [0]) == "ok"
    assert ledger.commit_trained(["1/p0"], 1, 1) == []
    assert ledger.checkpoint() == (1, 1)
    # a replay of the same entry after a crash is refused before training
    assert ledger.claim("1-0", 1, "p0", [0]) == "trained"
    # and marking it trained again is refused and counted
    assert ledger.commit_trained(["1/p0"], 2, 2) == ["1/p0"]
    result = ledger.audit()
    assert (result.retrain_refused, result.trained_twice, result.trained) == (1, 1, 1)


def test_reconciling_a_checkpoint_trains_nothing_twice(client):
    ledger = GroupLedger(client, "run")
    ledger.commit_trained(["1/p0"], 1, 1)
    assert ledger.commit_trained(["1/p0"], 1, 1, reconcile=True) == ["1/p0"]
    assert ledger.audit().trained_twice == 0


def test_a_second_entry_for_an_id_is_a_duplicate(client):
    ledger = GroupLedger(client, "run")
    assert ledger.claim("5-0", 2, "p1") == "ok"
    assert ledger.claim("6-0", 2, "p1") == "duplicate:5-0"
    assert ledger.claim("5-0", 2, "p1") == "ok"  # the owner itself may be read again
    assert ledger.audit().duplicates_refused == 1


def test_non_durable_steps_do_not_move_the_checkpoint(client):
    ledger = GroupLedger(client, "run")
    ledger.commit_trained(["2/p0"], 2, 2)
    ledger.commit_trained(["3/p0"], -1, 3)
    ledger.commit_trained(["1/p0"], 1, 1, reconcile=True)  # an older checkpoint never wins
    assert ledger.checkpoint() == (2, 2)


def test_append_writes_and_records_groups_at_once_with_their_versions(client):
    ledger = GroupLedger(client, "run")
    groups = [_sample_group("run", 1, p) for p in ("p0", "p1")]
    written = ledger.append_groups(groups)
    entries = client.xrange(stream_key("run"))
    assert [(e, True) for e, _ in entries] == [(e.encode(), first) for e, first in written]
    assert [SampleGroup.decode(f[STREAM_FIELD]).prompt_id for _, f in entries] == ["p0", "p1"]
    again = ledger.append_groups([_sample_group("run", 1, "p0", version=7)])  # a duplicate
    assert [first for _, first in again] == [False]
    assert ledger.generated_ids(1, ["p0", "p1", "p2"]) == {"p0", "p1"}
    assert client.hget(ledger_keys("run")[1], "1/p0") == written[0][0].encode()  # the first entry owns it
    result = ledger.audit()
    assert result.generated == 2 and result.sample_versions == {0: 2}  # the duplicate's not counted
    with pytest.raises(ValueError, match="belongs to run 'other'"):
        ledger.append_groups([_sample_group("other", 1, "p9")])
    assert ledger.append_groups([]) == []


def test_audit_counts_lost_ids_and_uncommitted_versions(client, capsys, redis_url):
    ledger = GroupLedger(client, "run")
    ledger.submit(1, ["p0", "p1"])
    ledger.submit(2, ["p0", "p1"])
    ledger.submit(2, ["p1"])  # resubmitted after a recovery
    ledger.record_committed(0)
    ledger.claim("1-0", 1, "p0", [0])
    ledger.claim("1-1", 1, "p1", [1])  # drawn with a version never committed
    ledger.commit_trained(["1/p0"], 1, 1)
    result = ledger.audit()
    assert (result.finished_step, result.submitted, result.resubmitted) == (1, 4, 1)
    assert (result.lost, result.lost_ids) == (1, ["1/p1"])
    assert result.uncommitted_sample_versions == [1] and not result.versions_ok
    assert ledger.audit(finished_step=2).lost == 3
    assert main(["run", "--redis-url", redis_url]) == 3  # the CLI fails on a bad audit
    printed = json.loads(capsys.readouterr().out)
    assert printed["lost_ids"] == ["1/p1"]


def test_published_versions_only_grow(client):
    ledger = GroupLedger(client, "run")
    assert ledger.max_version() == -1
    assert ledger.record_published(3) == 3
    assert ledger.record_published(2) == 3
    assert ledger.max_version() == 3
    ledger.delete()
    assert ledger.max_version() == -1


def test_the_checkpoint_result_is_the_newest_step_s_only(client):
    ledger = GroupLedger(client, "run-result")
    assert ledger.checkpoint_result(3) is None
    ledger.record_checkpoint_result(3, {"loss": 0.5, "num_samples": 4})
    assert ledger.checkpoint_result(3) == {"loss": 0.5, "num_samples": 4, "step": 3}
    ledger.record_checkpoint_result(4, {"loss": 0.25})
    assert ledger.checkpoint_result(3) is None and ledger.checkpoint_result(4)["loss"] == 0.25
    with pytest.raises(ValueError, match="step must be >= 1"):
        ledger.record_checkpoint_result(0, {})


def test_groups_drawn_with_too_old_a_version_are_released_and_their_old_entries_refused(client):
    ledger = GroupLedger(client, "run")
    ledger.submit(4, ["p0", "p1", "p2", "p3"])
    old = ledger.append_groups(
        [_sample_group("run", 4, p, version=v) for p, v in (("p0", 2), ("p1", 3), ("p2", 1), ("p3", 1))]
    )
    assert ledger.claim(old[3][0], 4, "p3", [1]) == "ok"
    assert ledger.commit_trained(["4/p3"], 4, 5) == []  # trained: never released
    assert ledger.release_older(4, ["p0", "p1", "p2", "p3", "p9"], min_version=3) == {"p0", "p2"}
    assert ledger.generated_ids(4, ["p0", "p1", "p2", "p3"]) == {"p1", "p3"}
    assert ledger.release_older(4, ["p0", "p1"], min_version=3) == set()  # nothing left to release
    # drawn again: the new entry owns the id, the old one is refused as a duplicate
    ledger.submit(4, ["p0", "p2"])
    new = ledger.append_groups([_sample_group("run", 4, p, version=3) for p in ("p0", "p2")])
    assert [first for _, first in new] == [True, True]
    assert ledger.claim(old[0][0], 4, "p0", [2]) == f"duplicate:{new[0][0]}"
    assert ledger.claim(new[0][0], 4, "p0", [3]) == "ok"
    result = ledger.audit(finished_step=3)
    assert (result.stale_redrawn, result.resubmitted, result.duplicates_refused) == (2, 2, 1)
    assert result.lost == 0 and result.generated == 4
