"""The one status comment a `/rerun-test` run owns: created as "running", finalized in place.

`announce` creates the comment and returns its id; the workflow hands that id to later jobs as an
output (nothing ever searches for the comment). `finalize` validates every input before it makes
any call, checks that the comment is this run's (its marker names the run, it sits on the right
pull request), edits it to passed / failed / cancelled, and confirms the write by the body GitHub
echoes back. It never creates a comment and never retries: a finalizer run again edits the same
comment again, so the pull request keeps exactly one comment per run.
"""

from __future__ import annotations

import logging
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tools.ci.command import check_test_path
from tools.ci.github_api import CommentApi, check_repository
from tools.ci.outcome import JOBS, KNOWN_RESULTS, Outcome, decide_outcome

log = logging.getLogger(__name__)

_SERVER_URL = re.compile(r"https://[a-z0-9](?:[a-z0-9.-]*[a-z0-9])?(?::[0-9]{1,5})?")
_SHA = re.compile(r"[0-9a-f]{40}")
_LOGIN = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})(?:\[bot\])?")


class CommentWriteError(RuntimeError):
    """GitHub did not store what was written, or the comment is not this run's."""


def positive_int(name: str, value: object) -> int:
    """`value` itself when it is an int > 0; booleans, strings and floats are rejected."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def marker(run_id: int) -> str:
    """First line of the comment; it ties the comment to the run that owns it."""
    return f"<!-- furlong-rerun-test run={positive_int('run_id', run_id)} -->"


@dataclass(frozen=True)
class RunContext:
    """Who and what a dispatched `/rerun-test` run is about; validated on construction."""

    server_url: str
    repository: str
    run_id: int
    pr_number: int
    head_sha: str
    suite: str
    requested_by: str

    def __post_init__(self) -> None:
        if not isinstance(self.server_url, str) or not _SERVER_URL.fullmatch(self.server_url):
            raise ValueError(f"server_url must be https://host, got {self.server_url!r}")
        check_repository(self.repository)
        positive_int("run_id", self.run_id)
        positive_int("pr_number", self.pr_number)
        if not isinstance(self.head_sha, str) or not _SHA.fullmatch(self.head_sha):
            raise ValueError(f"head_sha must be 40 lowercase hex digits, got {self.head_sha!r}")
        check_test_path(self.suite)
        if not isinstance(self.requested_by, str) or not _LOGIN.fullmatch(self.requested_by):
            raise ValueError(f"requested_by must be a GitHub login, got {self.requested_by!r}")

    @property
    def run_url(self) -> str:
        return f"{self.server_url}/{self.repository}/actions/runs/{self.run_id}"


@dataclass(frozen=True)
class FinalizerInputs:
    """Everything the finalizer acts on. Construction is the validation; nothing is coerced."""

    run: RunContext
    run_url: str
    comment_id: int
    started_at_s: int
    results: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.run, RunContext):
            raise ValueError(f"run must be a RunContext, got {type(self.run).__name__}")
        if self.run_url != self.run.run_url:
            raise ValueError(f"run_url {self.run_url!r} is not this repository's run {self.run.run_url!r}")
        positive_int("comment_id", self.comment_id)
        positive_int("started_at_s", self.started_at_s)
        if not isinstance(self.results, Mapping) or set(self.results) != set(JOBS):
            got = sorted(self.results) if isinstance(self.results, Mapping) else self.results
            raise ValueError(f"results must name exactly the jobs {list(JOBS)}, got {got!r}")
        for job in JOBS:
            if self.results[job] not in KNOWN_RESULTS:
                raise ValueError(
                    f"result of job {job!r} must be one of {sorted(KNOWN_RESULTS)}, got {self.results[job]!r}"
                )
        object.__setattr__(self, "results", types.MappingProxyType(dict(self.results)))


def format_elapsed(seconds: int) -> str:
    """3725 -> '1h 02m 05s', 192 -> '3m 12s', 7 -> '7s'."""
    if isinstance(seconds, bool) or not isinstance(seconds, int) or seconds < 0:
        raise ValueError(f"elapsed seconds must be a non-negative integer, got {seconds!r}")
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m {secs:02d}s"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"


def running_body(run: RunContext) -> str:
    return "\n".join(
        [
            marker(run.run_id),
            f"**`/rerun-test`: running** suite `{run.suite}` at `{run.head_sha[:12]}` "
            f"(requested by @{run.requested_by})",
            f"Run: {run.run_url}",
        ]
    )


def final_body(run: RunContext, outcome: Outcome, results: Mapping[str, str], elapsed_s: int) -> str:
    if outcome is Outcome.RUNNING:
        raise ValueError("a final body needs a final outcome, got running")
    jobs = " · ".join(f"{job} {results.get(job, 'missing')}" for job in JOBS)
    return "\n".join(
        [
            marker(run.run_id),
            f"**`/rerun-test`: {outcome.value}** suite `{run.suite}` at `{run.head_sha[:12]}` "
            f"in {format_elapsed(elapsed_s)} (requested by @{run.requested_by})",
            f"Jobs: {jobs}",
            f"Run: {run.run_url}",
        ]
    )


def announce(api: CommentApi, run: RunContext, run_attempt: int) -> int:
    """Create the run's status comment as "running"; return its id (confirmed by the echo)."""
    if positive_int("run_attempt", run_attempt) != 1:
        raise ValueError(
            f"run attempt {run_attempt}: a re-run of all jobs would create a second status "
            "comment; use 're-run failed jobs' or comment /rerun-test again"
        )
    body = running_body(run)
    created = api.create_comment(run.repository, run.pr_number, body)
    comment_id = _confirm_echo(created, body, expected_id=None)
    log.info("created status comment %d on #%d: running", comment_id, run.pr_number)
    return comment_id


def finalize(api: CommentApi, inputs: FinalizerInputs, now_s: int) -> Outcome:
    """Edit the run's status comment to its final outcome; return the outcome."""
    if not isinstance(inputs, FinalizerInputs):
        raise ValueError(f"inputs must be FinalizerInputs, got {type(inputs).__name__}")
    elapsed_s = positive_int("now_s", now_s) - inputs.started_at_s
    if elapsed_s < 0:
        raise ValueError(f"now_s {now_s} is before started_at_s {inputs.started_at_s}")
    outcome = decide_outcome(inputs.results)
    body = final_body(inputs.run, outcome, inputs.results, elapsed_s)
    run = inputs.run
    current = api.get_comment(run.repository, inputs.comment_id)
    _check_owned(current, inputs)
    if current.get("body") == body:
        log.info("status comment %d already reads %s", inputs.comment_id, outcome.value)
        return outcome
    updated = api.update_comment(run.repository, inputs.comment_id, body)
    _confirm_echo(updated, body, expected_id=inputs.comment_id)
    log.info("status comment %d on #%d: %s", inputs.comment_id, run.pr_number, outcome.value)
    return outcome


def _check_owned(comment: Any, inputs: FinalizerInputs) -> None:
    run = inputs.run
    if not isinstance(comment, Mapping):
        raise CommentWriteError(f"comment {inputs.comment_id}: answer is not an object")
    if comment.get("id") != inputs.comment_id:
        raise CommentWriteError(f"asked for comment {inputs.comment_id}, got {comment.get('id')!r}")
    issue_url = comment.get("issue_url")
    suffix = f"/repos/{run.repository}/issues/{run.pr_number}"
    if not isinstance(issue_url, str) or not issue_url.endswith(suffix):
        raise CommentWriteError(
            f"comment {inputs.comment_id} belongs to {issue_url!r}, not pull request #{run.pr_number}"
        )
    body = comment.get("body")
    if not isinstance(body, str) or body.split("\n", 1)[0] != marker(run.run_id):
        raise CommentWriteError(f"comment {inputs.comment_id} is not the status comment of run {run.run_id}")


def _confirm_echo(comment: Any, body: str, expected_id: int | None) -> int:
    if not isinstance(comment, Mapping):
        raise CommentWriteError("GitHub answered the write with something that is not a comment")
    comment_id = comment.get("id")
    try:
        positive_int("comment id", comment_id)
    except ValueError as exc:
        raise CommentWriteError(str(exc)) from None
    if expected_id is not None and comment_id != expected_id:
        raise CommentWriteError(f"edited comment {expected_id}, GitHub answered {comment_id}")
    if comment.get("body") != body:
        raise CommentWriteError(f"comment {comment_id}: GitHub echoed a different body than was written")
    return comment_id
