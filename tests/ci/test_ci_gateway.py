"""The /rerun-test gateway: who may run what, and what it dispatches."""

from __future__ import annotations

import pytest
from ci_fakes import FakeGitHub, pull

from tools.ci.command import CommandRejected
from tools.ci.gateway import RERUN_WORKFLOW, CommentEvent, handle, plan_dispatch
from tools.ci.github_api import GitHubApiError

pytestmark = pytest.mark.unit

REPO = "furlong-ai/furlong"
SHA = "0123456789abcdef0123456789abcdef01234567"
BODY = "/rerun-test tests/core/test_weights.py"


class PathChecks:
    """Records the (sha, path) pairs checked; rejects the paths in `bad`."""

    def __init__(self, bad: tuple[str, ...] = ()) -> None:
        self.bad = bad
        self.checked: list[tuple[str, str]] = []

    def __call__(self, sha: str, path: str) -> None:
        self.checked.append((sha, path))
        if path in self.bad:
            raise CommandRejected(f"{path!r} is a symlink; name the real test file")


def setup(permission: str = "write", **pull_kwargs) -> FakeGitHub:
    api = FakeGitHub()
    api.permissions[(REPO, "alice")] = permission
    api.pulls[(REPO, 42)] = pull(REPO, 42, SHA, **pull_kwargs)
    return api


def event(body: str = BODY, author: str = "alice") -> CommentEvent:
    return CommentEvent(REPO, 42, author, body, "main")


@pytest.mark.parametrize("permission", ["admin", "write"])
def test_writer_on_same_repo_pr_dispatches_fixed_workflow_with_head_sha(permission):
    api, checks = setup(permission), PathChecks()
    dispatch = handle(event(), api, api, checks)
    assert api.dispatches == [
        (
            REPO,
            RERUN_WORKFLOW,
            "main",
            {
                "pr_number": "42",
                "head_sha": SHA,
                "test_path": "tests/core/test_weights.py",
                "requested_by": "alice",
            },
        )
    ]
    assert dispatch.ref == "main" and dispatch.workflow_file == "rerun-test.yml"
    assert checks.checked == [(SHA, "tests/core/test_weights.py")]
    assert api.comments == {}  # the dispatched run owns the only comment


@pytest.mark.parametrize(
    ("api_kwargs", "body", "calls_before_reject", "reason"),
    [
        ({}, "/rerun-test tests/core/../x/test_a.py", [], "'..'"),
        ({}, "/rerun-test tests/core/test_weights.py -k x", [], "exactly"),
        ({"permission": "read"}, BODY, ["collaborator_permission"], "write access"),
        ({"permission": "triage"}, BODY, ["collaborator_permission"], "write access"),
        ({"permission": "none"}, BODY, ["collaborator_permission"], "write access"),
        (
            {"head_repo": "mallory/furlong"},
            BODY,
            ["collaborator_permission", "pull_request"],
            "mallory/furlong",
        ),
        ({"state": "closed"}, BODY, ["collaborator_permission", "pull_request"], "not open"),
    ],
)
def test_rejections_reply_and_dispatch_nothing(api_kwargs, body, calls_before_reject, reason):
    api, checks = setup(**api_kwargs), PathChecks()
    with pytest.raises(CommandRejected, match=reason):
        handle(event(body), api, api, checks)
    assert [c[0] for c in api.calls] == calls_before_reject + ["create_comment"]
    assert api.dispatches == [] and checks.checked == []
    (reply,) = api.comments.values()
    assert reply["body"].startswith("`/rerun-test` rejected:\n```\n") and reason in reply["body"]


def test_symlinked_test_path_is_rejected_after_the_tree_check():
    api, checks = setup(), PathChecks(bad=("tests/core/test_weights.py",))
    with pytest.raises(CommandRejected, match="symlink"):
        handle(event(), api, api, checks)
    assert checks.checked == [(SHA, "tests/core/test_weights.py")]
    assert api.dispatches == []


def test_missing_head_repo_and_bad_head_sha_are_rejected():
    api = setup()
    api.pulls[(REPO, 42)]["head"]["repo"] = None  # the fork was deleted
    with pytest.raises(CommandRejected):
        plan_dispatch(event(), api, PathChecks())
    api = setup()
    api.pulls[(REPO, 42)]["head"]["sha"] = "HEAD"
    with pytest.raises(CommandRejected, match="head SHA"):
        plan_dispatch(event(), api, PathChecks())


def test_reply_cannot_mention_or_break_out_of_its_code_block():
    api = setup()
    with pytest.raises(CommandRejected):
        handle(event("/rerun-test @everyone ```"), api, api, PathChecks())
    (reply,) = api.comments.values()
    assert reply["body"].count("```") == 2 and "'''" in reply["body"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"repository": "nope"},
        {"pr_number": 0},
        {"pr_number": "42"},
        {"author": ""},
        {"default_branch": ""},
        {"default_branch": "-x"},
    ],
)
def test_event_validation(kwargs):
    fields = {
        "repository": REPO,
        "pr_number": 42,
        "author": "alice",
        "body": BODY,
        "default_branch": "main",
        **kwargs,
    }
    with pytest.raises(ValueError):
        CommentEvent(**fields)


def test_github_errors_are_answered_and_raised():
    api = setup()
    del api.pulls[(REPO, 42)]  # the pull request lookup fails (404)
    with pytest.raises(GitHubApiError):
        handle(event(), api, api, PathChecks())
    (reply,) = api.comments.values()
    assert reply["body"].startswith("`/rerun-test` could not be checked:")
    assert api.dispatches == []


def test_failed_dispatch_is_answered_and_raised():
    api = setup()

    def refuse(*args):
        raise GitHubApiError("POST", "/dispatches", 422, "workflow not found")

    api.dispatch_workflow = refuse
    with pytest.raises(GitHubApiError):
        handle(event(), api, api, PathChecks())
    (reply,) = api.comments.values()
    assert reply["body"].startswith("`/rerun-test` could not start the run:")
    assert "workflow not found" in reply["body"]
