"""A gateway session's calls as one training trajectory: exactly the engine's ids (loss mask 1, their
log-probs and supports) and the ids each next call added (mask 0, placeholders), never a re-tokenised
string; a call that does not extend the trajectory starts it again and is counted as drift."""

from __future__ import annotations

import pytest

from furlong.core.sampling_mask import RolloutSamplingMask
from furlong.rollout.core.agent_sessions import session_trajectory
from furlong.rollout.core.gateway_session import CallRecord, ChoiceRecord

pytestmark = pytest.mark.unit
VOCAB = 50
EOS = 2


def call(prompt, drawn, version=3, finish="stop", n=1):
    support = RolloutSamplingMask.from_lists([[t, t + 1] for t in drawn], VOCAB)
    choice = ChoiceRecord(0, tuple(drawn), tuple(-0.5 for _ in drawn), finish, support)
    return CallRecord("r", "chat.completion", "m", version, 0, 1.0, 1.0, tuple(prompt), (choice,) * n)


def test_calls_that_extend_each_other_become_one_trajectory():
    first = call([10, 11, 12], [20, 21, EOS], version=4)
    second = call([10, 11, 12, 20, 21, EOS, 30, 31], [22, 23], version=5, finish="length")
    t = session_trajectory([first, second], VOCAB, {EOS})
    assert t.prompt_ids == [10, 11, 12]
    assert t.response_ids == [20, 21, EOS, 30, 31, 22, 23]
    assert t.loss_mask == [1, 1, 1, 0, 0, 1, 1]
    assert t.logprobs == [-0.5, -0.5, -0.5, 0.0, 0.0, -0.5, -0.5]
    assert t.support.to_lists()[:3] == [[20, 21], [21, 22], [2, 3]]
    assert t.support.to_lists()[3:5] == [list(range(VOCAB))] * 2  # placeholders: implicit full rows
    assert t.support.implicit is not None and t.support.rows(3, 5).token_ids.size == 0
    assert (t.policy_version, t.finish_reason, t.num_calls, t.drift) == (4, "length", 2, 0)


def test_a_call_that_rewrites_the_history_starts_the_trajectory_again():
    first = call([10, 11], [20, EOS])
    rewritten = call([10, 11, 25, EOS, 30], [22, EOS], version=6)  # 25: the reply re-tokenised
    t = session_trajectory([first, rewritten], VOCAB, {EOS})
    assert t.prompt_ids == [10, 11] and t.response_ids == [25, EOS, 30, 22, EOS]
    assert t.loss_mask == [0, 0, 0, 1, 1] and t.logprobs[:3] == [0.0] * 3
    assert (t.num_calls, t.drift, t.finish_reason) == (1, 1, "eos")


def test_a_call_that_changes_the_first_prompt_fails_the_session():
    with pytest.raises(ValueError, match="does not begin with the first call's prompt"):
        session_trajectory([call([10, 11], [20]), call([12, 11, 20], [21])], VOCAB, {EOS})


@pytest.mark.parametrize(
    "calls, match",
    [
        ([], "no call"),
        ([call([1], [5], n=2)], "2 choices"),
    ],
)
def test_sessions_without_a_trajectory_are_refused(calls, match):
    with pytest.raises(ValueError, match=match):
        session_trajectory(calls, VOCAB, {EOS})


def test_records_keep_supports_out_of_their_json():
    record = call([1, 2], [3])
    assert "support" not in record.to_json()["choices"][0]
    assert record.to_json()["choices"][0]["completion_token_ids"] == [3]
