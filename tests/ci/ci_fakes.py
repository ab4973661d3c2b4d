"""In-memory double of the GitHub REST API (CommentApi, RepoApi, UpstreamApi) that records calls."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from tools.ci.github_api import GitHubApiError

WRITE_METHODS = ("create_comment", "update_comment", "dispatch_workflow")


class FakeGitHub:
    """Stores comments per repository; every call is appended to `calls` as (method, *args)."""

    def __init__(self, api_url: str = "https://api.github.com") -> None:
        self.api_url = api_url
        self.calls: list[tuple[Any, ...]] = []
        self.comments: dict[int, dict[str, Any]] = {}
        self.permissions: dict[tuple[str, str], str] = {}
        self.pulls: dict[tuple[str, int], dict[str, Any]] = {}
        self.branches: dict[tuple[str, str], str] = {}
        self.commits: set[tuple[str, str]] = set()
        self.dispatches: list[tuple[str, str, str, dict[str, str]]] = []
        self.next_comment_id = 9001
        # When set, what GitHub "stores" for a write: f(body_sent) -> body_stored.
        self.store_transform: Callable[[str], str] | None = None

    # CommentApi
    def get_comment(self, repository: str, comment_id: int) -> dict[str, Any]:
        self.calls.append(("get_comment", repository, comment_id))
        if comment_id not in self.comments:
            raise GitHubApiError("GET", f"/repos/{repository}/issues/comments/{comment_id}", 404, "")
        return copy.deepcopy(self.comments[comment_id])

    def create_comment(self, repository: str, issue_number: int, body: str) -> dict[str, Any]:
        self.calls.append(("create_comment", repository, issue_number, body))
        comment_id = self.next_comment_id
        self.next_comment_id += 1
        self.comments[comment_id] = {
            "id": comment_id,
            "body": self._stored(body),
            "issue_url": f"{self.api_url}/repos/{repository}/issues/{issue_number}",
            "html_url": f"https://github.com/{repository}/pull/{issue_number}#issuecomment-{comment_id}",
        }
        return copy.deepcopy(self.comments[comment_id])

    def update_comment(self, repository: str, comment_id: int, body: str) -> dict[str, Any]:
        self.calls.append(("update_comment", repository, comment_id, body))
        if comment_id not in self.comments:
            raise GitHubApiError("PATCH", f"/repos/{repository}/issues/comments/{comment_id}", 404, "")
        self.comments[comment_id]["body"] = self._stored(body)
        return copy.deepcopy(self.comments[comment_id])

    # RepoApi
    def collaborator_permission(self, repository: str, user: str) -> str:
        self.calls.append(("collaborator_permission", repository, user))
        return self.permissions.get((repository, user), "none")

    def pull_request(self, repository: str, number: int) -> dict[str, Any]:
        self.calls.append(("pull_request", repository, number))
        if (repository, number) not in self.pulls:
            raise GitHubApiError("GET", f"/repos/{repository}/pulls/{number}", 404, "")
        return copy.deepcopy(self.pulls[(repository, number)])

    def dispatch_workflow(
        self, repository: str, workflow_file: str, ref: str, inputs: dict[str, str]
    ) -> None:
        self.calls.append(("dispatch_workflow", repository, workflow_file, ref, dict(inputs)))
        self.dispatches.append((repository, workflow_file, ref, dict(inputs)))

    # UpstreamApi
    def branch_head_sha(self, repository: str, branch: str) -> str:
        self.calls.append(("branch_head_sha", repository, branch))
        if (repository, branch) not in self.branches:
            raise GitHubApiError("GET", f"/repos/{repository}/branches/{branch}", 404, "")
        return self.branches[(repository, branch)]

    def commit_sha(self, repository: str, ref: str) -> str:
        self.calls.append(("commit_sha", repository, ref))
        if (repository, ref) not in self.commits:
            raise GitHubApiError("GET", f"/repos/{repository}/commits/{ref}", 422, "")
        return ref

    # helpers for assertions
    def writes(self) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] in WRITE_METHODS]

    def comments_on(self, repository: str, issue_number: int) -> list[dict[str, Any]]:
        suffix = f"/repos/{repository}/issues/{issue_number}"
        return [c for c in self.comments.values() if c["issue_url"].endswith(suffix)]

    def _stored(self, body: str) -> str:
        return self.store_transform(body) if self.store_transform else body


def pull(
    repository: str,
    number: int,
    head_sha: str,
    *,
    head_repo: str | None = None,
    state: str = "open",
    body: str | None = None,
    author: str = "alice",
) -> dict[str, Any]:
    """A pull request as GitHub's REST API shapes it (only the fields CI reads)."""
    return {
        "number": number,
        "state": state,
        "body": body,
        "user": {"login": author},
        "head": {"sha": head_sha, "repo": {"full_name": head_repo or repository}},
        "base": {"repo": {"full_name": repository}},
    }
