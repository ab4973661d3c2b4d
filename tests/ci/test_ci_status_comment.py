"""The status comment: created once, finalized in place, every input validated before any write."""

from __future__ import annotations

import pytest
from ci_fakes import FakeGitHub

from tools.ci.github_api import GitHubApiError
from tools.ci.outcome import Outcome
from tools.ci.status_comment import (
    CommentWriteError,
    FinalizerInputs,
    RunContext,
    announce,
    final_body,
    finalize,
    format_elapsed,
    marker,
    running_body,
)

pytestmark = pytest.mark.unit

REPO = "furlong-ai/furlong"
SHA = "0123456789abcdef0123456789abcdef01234567"
RUN = {
    "server_url": "https://github.com",
    "repository": REPO,
    "run_id": 555,
    "pr_number": 42,
    "head_sha": SHA,
    "suite": "tests/core/test_weights.py",
    "requested_by": "alice",
}
RUN_URL = f"https://github.com/{REPO}/actions/runs/555"
OK = {"announce": "success", "resolve": "success", "test": "success"}
STARTED = 1_700_000_000


def make_inputs(comment_id, run=None, **overrides) -> FinalizerInputs:
    fields = {"run_url": RUN_URL, "comment_id": comment_id, "started_at_s": STARTED, "results": OK}
    fields.update(overrides)
    return FinalizerInputs(run=RunContext(**{**RUN, **(run or {})}), **fields)


def announced() -> tuple[FakeGitHub, int]:
    api = FakeGitHub()
    comment_id = announce(api, RunContext(**RUN), run_attempt=1)
    return api, comment_id


def test_announce_creates_one_running_comment_linking_the_run():
    api, comment_id = announced()
    assert [c[0] for c in api.calls] == ["create_comment"]
    assert api.calls[0][1:3] == (REPO, 42)
    (comment,) = api.comments_on(REPO, 42)
    assert comment["id"] == comment_id == 9001
    lines = comment["body"].split("\n")
    assert lines[0] == "<!-- furlong-rerun-test run=555 -->"
    assert "running" in lines[1] and "`tests/core/test_weights.py`" in lines[1]
    assert "`0123456789ab`" in lines[1] and "@alice" in lines[1]
    assert lines[2] == f"Run: {RUN_URL}"


def test_announce_refuses_a_second_attempt_without_writing():
    api = FakeGitHub()
    with pytest.raises(ValueError, match="second status comment"):
        announce(api, RunContext(**RUN), run_attempt=2)
    assert api.calls == []


def test_announce_confirms_the_echoed_body():
    api = FakeGitHub()
    api.store_transform = lambda body: body.replace("\n", "\r\n")
    with pytest.raises(CommentWriteError, match="different body"):
        announce(api, RunContext(**RUN), run_attempt=1)
    assert len(api.writes()) == 1  # no retry


def test_finalizer_run_twice_leaves_one_comment_with_the_final_body():
    api, comment_id = announced()
    inputs = make_inputs(comment_id)
    assert finalize(api, inputs, now_s=STARTED + 192) is Outcome.PASSED
    assert finalize(api, inputs, now_s=STARTED + 250) is Outcome.PASSED
    (comment,) = api.comments_on(REPO, 42)
    assert comment["body"] == final_body(inputs.run, Outcome.PASSED, OK, 250)
    assert "**`/rerun-test`: passed**" in comment["body"] and "in 4m 10s" in comment["body"]
    methods = [c[0] for c in api.calls]
    assert methods == [
        "create_comment",
        "get_comment",
        "update_comment",
        "get_comment",
        "update_comment",
    ]
    assert {c[2] for c in api.calls if c[0] == "update_comment"} == {comment_id}


def test_finalizer_rerun_with_identical_body_does_not_write():
    api, comment_id = announced()
    inputs = make_inputs(comment_id)
    finalize(api, inputs, now_s=STARTED + 10)
    finalize(api, inputs, now_s=STARTED + 10)
    assert [c[0] for c in api.writes()] == ["create_comment", "update_comment"]
    assert len(api.comments_on(REPO, 42)) == 1


def test_rerun_of_failed_jobs_turns_the_same_comment_from_failed_to_passed():
    api, comment_id = announced()
    failed = {**OK, "test": "failure"}
    assert finalize(api, make_inputs(comment_id, results=failed), STARTED + 60) is Outcome.FAILED
    assert "**`/rerun-test`: failed**" in api.comments[comment_id]["body"]
    assert "test failure" in api.comments[comment_id]["body"]
    assert finalize(api, make_inputs(comment_id), STARTED + 900) is Outcome.PASSED
    (comment,) = api.comments_on(REPO, 42)
    assert "**`/rerun-test`: passed**" in comment["body"] and "in 15m 00s" in comment["body"]


def test_cancelled_run_reads_cancelled():
    api, comment_id = announced()
    results = {"announce": "success", "resolve": "cancelled", "test": "skipped"}
    assert finalize(api, make_inputs(comment_id, results=results), STARTED + 5) is Outcome.CANCELLED
    assert "**`/rerun-test`: cancelled**" in api.comments[comment_id]["body"]


BAD_RUN = [
    {"run_id": True},
    {"run_id": "555"},
    {"run_id": 0},
    {"run_id": -555},
    {"run_id": 555.0},
    {"pr_number": True},
    {"pr_number": "42"},
    {"pr_number": 0},
    {"pr_number": None},
    {"server_url": "http://github.com"},
    {"server_url": "https://github.com/"},
    {"server_url": "https://user@github.com"},
    {"server_url": ""},
    {"repository": "furlong"},
    {"repository": "a/b/c"},
    {"repository": "../furlong"},
    {"repository": "furlong-ai/.."},
    {"repository": ""},
    {"repository": 7},
    {"head_sha": SHA[:12]},
    {"head_sha": SHA.upper()},
    {"head_sha": SHA + "0"},
    {"head_sha": None},
    {"suite": "tests/../x/test_a.py"},
    {"suite": "tests/core/weights.py"},
    {"suite": ""},
    {"requested_by": ""},
    {"requested_by": "al ice"},
    {"requested_by": "@alice"},
    {"requested_by": "-alice"},
    {"requested_by": None},
]
BAD_FIELDS = [
    {"comment_id": True},
    {"comment_id": False},
    {"comment_id": "9001"},
    {"comment_id": 0},
    {"comment_id": -9001},
    {"comment_id": 9001.0},
    {"comment_id": None},
    {"started_at_s": True},
    {"started_at_s": str(STARTED)},
    {"started_at_s": 0},
    {"run_url": "https://github.com/other/repo/actions/runs/555"},
    {"run_url": f"http://github.com/{REPO}/actions/runs/555"},
    {"run_url": f"https://github.com.evil.example/{REPO}/actions/runs/555"},
    {"run_url": f"https://github.com/{REPO}/actions/runs/556"},
    {"run_url": RUN_URL + "/"},
    {"run_url": RUN_URL + "/attempts/2"},
    {"run_url": RUN_URL + "?x=1"},
    {"run_url": ""},
    {"run_url": None},
    {"results": {**OK, "test": "neutral"}},
    {"results": {**OK, "test": ""}},
    {"results": {**OK, "test": "Success"}},
    {"results": {**OK, "test": None}},
    {"results": {**OK, "test": True}},
    {"results": {"announce": "success", "resolve": "success"}},
    {"results": {**OK, "lint": "success"}},
    {"results": None},
    {"results": "success"},
]


@pytest.mark.parametrize(
    "bad", BAD_RUN + BAD_FIELDS, ids=lambda b: f"{next(iter(b))}={next(iter(b.values()))!r}"
)
def test_invalid_finalizer_input_is_rejected_before_any_call(bad):
    api, comment_id = announced()
    api.calls.clear()
    run = {k: v for k, v in bad.items() if k in RUN}
    fields = {k: v for k, v in bad.items() if k not in RUN}
    with pytest.raises(ValueError):
        inputs = make_inputs(fields.pop("comment_id", comment_id), run=run, **fields)
        finalize(api, inputs, now_s=STARTED + 1)
    assert api.calls == []
    assert "running" in api.comments[comment_id]["body"]


@pytest.mark.parametrize("now_s", [STARTED - 1, True, 0, "1700000100"])
def test_invalid_clock_is_rejected_before_any_call(now_s):
    api, comment_id = announced()
    api.calls.clear()
    with pytest.raises(ValueError):
        finalize(api, make_inputs(comment_id), now_s=now_s)
    assert api.calls == []


def test_comment_of_another_run_is_not_edited():
    api, comment_id = announced()
    api.comments[comment_id]["body"] = marker(777) + "\nsomething else"
    with pytest.raises(CommentWriteError, match="not the status comment of run 555"):
        finalize(api, make_inputs(comment_id), STARTED + 1)
    assert [c[0] for c in api.writes()] == ["create_comment"]


def test_comment_on_another_pull_request_is_not_edited():
    api, comment_id = announced()
    api.comments[comment_id]["issue_url"] = f"https://api.github.com/repos/{REPO}/issues/43"
    with pytest.raises(CommentWriteError, match="not pull request #42"):
        finalize(api, make_inputs(comment_id), STARTED + 1)
    assert [c[0] for c in api.writes()] == ["create_comment"]


def test_missing_comment_raises_without_creating_one():
    api = FakeGitHub()
    with pytest.raises(GitHubApiError):
        finalize(api, make_inputs(4242), STARTED + 1)
    assert api.writes() == []
    assert api.comments == {}


def test_write_not_echoed_is_an_error_and_not_retried():
    api, comment_id = announced()
    api.store_transform = lambda body: body + "\n(edited)"
    with pytest.raises(CommentWriteError, match="different body"):
        finalize(api, make_inputs(comment_id), STARTED + 1)
    assert [c[0] for c in api.writes()] == ["create_comment", "update_comment"]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (7, "7s"), (60, "1m 00s"), (192, "3m 12s"), (3725, "1h 02m 05s")],
)
def test_format_elapsed(seconds, text):
    assert format_elapsed(seconds) == text


def test_bodies_start_with_the_marker_and_name_the_suite():
    run = RunContext(**RUN)
    for body in (running_body(run), final_body(run, Outcome.FAILED, OK, 3)):
        assert body.split("\n")[0] == marker(555)
        assert "tests/core/test_weights.py" in body and RUN_URL in body
    with pytest.raises(ValueError):
        final_body(run, Outcome.RUNNING, OK, 3)
