"""The `/rerun-test` gateway: decide whether a pull-request comment may start a run, then start it.

Checks, in this order, each one refusing with a reason: the exact command grammar (no API call
before it passes), write access of the comment's author, an open pull request whose head lives in
this same repository, and a test path that is a plain file (no symlink, no submodule) at the head
commit. Only then is the fixed workflow `rerun-test.yml` dispatched on the default branch with the
head SHA as data; the pull request's code never runs here. A refusal is answered with a reply
comment and raised, so the gateway job fails visibly too; so is a GitHub error on the way.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from tools.ci.command import CommandRejected, RerunCommand, parse_command
from tools.ci.github_api import CommentApi, GitHubApiError, RepoApi, check_repository
from tools.ci.status_comment import positive_int

log = logging.getLogger(__name__)

RERUN_WORKFLOW = "rerun-test.yml"
# The legacy `permission` field reports `maintain` as `write` and `triage` as `read`.
WRITE_PERMISSIONS = frozenset({"admin", "write"})
_SHA = re.compile(r"[0-9a-f]{40}")
_BRANCH = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._/-]{0,199}")

PathCheck = Callable[[str, str], None]  # (head_sha, test_path) -> None or CommandRejected


@dataclass(frozen=True)
class CommentEvent:
    """The parts of an `issue_comment` event the gateway uses."""

    repository: str
    pr_number: int
    author: str
    body: str
    default_branch: str

    def __post_init__(self) -> None:
        check_repository(self.repository)
        positive_int("pr_number", self.pr_number)
        if not isinstance(self.author, str) or not self.author:
            raise ValueError(f"author must be a login, got {self.author!r}")
        if not isinstance(self.default_branch, str) or not _BRANCH.fullmatch(self.default_branch):
            raise ValueError(f"default_branch must be a branch name, got {self.default_branch!r}")


@dataclass(frozen=True)
class Dispatch:
    workflow_file: str
    ref: str
    inputs: Mapping[str, str]

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", MappingProxyType(dict(self.inputs)))


def plan_dispatch(event: CommentEvent, api: RepoApi, check_path: PathCheck) -> Dispatch:
    """Every check of the module docstring; raise CommandRejected at the first that fails."""
    command: RerunCommand = parse_command(event.body)
    permission = api.collaborator_permission(event.repository, event.author)
    if permission not in WRITE_PERMISSIONS:
        raise CommandRejected(f"@{event.author} has {permission!r} access; /rerun-test needs write access")
    pr: Mapping[str, Any] = api.pull_request(event.repository, event.pr_number)
    if pr.get("state") != "open":
        raise CommandRejected(f"pull request #{event.pr_number} is {pr.get('state')!r}, not open")
    head = pr.get("head") or {}
    head_repo = (head.get("repo") or {}).get("full_name")
    base_repo = ((pr.get("base") or {}).get("repo") or {}).get("full_name")
    if head_repo != event.repository or base_repo != event.repository:
        raise CommandRejected(
            f"pull request #{event.pr_number} comes from {head_repo!r}; /rerun-test runs only "
            f"for branches of {event.repository}"
        )
    head_sha = head.get("sha")
    if not isinstance(head_sha, str) or not _SHA.fullmatch(head_sha):
        raise CommandRejected(f"pull request #{event.pr_number} has no usable head SHA: {head_sha!r}")
    check_path(head_sha, command.test_path)
    return Dispatch(
        workflow_file=RERUN_WORKFLOW,
        ref=event.default_branch,
        inputs={
            "pr_number": str(event.pr_number),
            "head_sha": head_sha,
            "test_path": command.test_path,
            "requested_by": event.author,
        },
    )


def reply_body(verdict: str, reason: Exception) -> str:
    """The reply; the reason sits in a code block so echoed text cannot mention or format."""
    text = str(reason).replace("`", "'")
    return f"`/rerun-test` {verdict}:\n```\n{text}\n```"


def handle(
    event: CommentEvent, repo_api: RepoApi, comment_api: CommentApi, check_path: PathCheck
) -> Dispatch:
    """Dispatch the run; on a refusal or a GitHub error reply with the reason, then re-raise."""
    try:
        dispatch = plan_dispatch(event, repo_api, check_path)
    except (CommandRejected, GitHubApiError) as exc:
        verdict = "rejected" if isinstance(exc, CommandRejected) else "could not be checked"
        log.error("/rerun-test on #%d by @%s %s: %s", event.pr_number, event.author, verdict, exc)
        comment_api.create_comment(event.repository, event.pr_number, reply_body(verdict, exc))
        raise
    try:
        repo_api.dispatch_workflow(
            event.repository, dispatch.workflow_file, dispatch.ref, dict(dispatch.inputs)
        )
    except GitHubApiError as exc:
        log.error("dispatching %s failed: %s", dispatch.workflow_file, exc)
        comment_api.create_comment(
            event.repository, event.pr_number, reply_body("could not start the run", exc)
        )
        raise
    log.info(
        "dispatched %s on %s for #%d: %s at %s",
        dispatch.workflow_file,
        dispatch.ref,
        event.pr_number,
        dispatch.inputs["test_path"],
        dispatch.inputs["head_sha"],
    )
    return dispatch
