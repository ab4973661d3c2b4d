"""Dependency directives: which upstream dependencies a run replaces, and with which commit.

A pull request body may carry lines `ci-sglang-pr: <ref>` and `ci-megatron-pr: <ref>`; a manual
workflow dispatch may give the same as inputs, and an input beats the body for its dependency.
`<ref>` is `#N` (that upstream pull request's head), a branch name, or a full 40-digit commit SHA.

Rules, all fail-closed:
- Only anchored lines count: the key starts in column 0 and the line holds nothing but the key and
  one ref. Indented, quoted or listed lines, lines inside HTML comments and fenced code blocks do
  not count. A bare key (nothing after the colon) is ignored.
- An anchored `ci-<name>-pr:` line with an unknown name or upper-case letters, an unreadable ref,
  or two different refs for one dependency is an error, never a silent fallback to the baseline.
- Dependencies nobody names keep the runner image's baseline.

Pinning a ref to a commit asks GitHub through `UpstreamApi`; everything else here is pure.
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass

from tools.ci.github_api import UpstreamApi

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Upstream:
    key: str
    repository: str
    distribution: str

    @property
    def directive(self) -> str:
        return f"ci-{self.key}-pr"


UPSTREAMS: dict[str, Upstream] = {
    "sglang": Upstream("sglang", "sgl-project/sglang", "sglang"),
    "megatron": Upstream("megatron", "NVIDIA/Megatron-LM", "megatron-core"),
}

_LINE = re.compile(r"ci-([a-z0-9][a-z0-9-]*)-pr:(.*)", re.IGNORECASE)
_PULL = re.compile(r"#([1-9][0-9]{0,9})")
_SHA = re.compile(r"[0-9a-fA-F]{40}")
_SHORT_SHA = re.compile(r"[0-9a-fA-F]{7,39}")
_BRANCH = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._/-]{0,199}")
_HTML_COMMENT = re.compile(r"<!--.*?(?:-->|\Z)", re.DOTALL)
_FENCE = re.compile(r"\s{0,3}(```|~~~)")


class DirectiveError(ValueError):
    """A directive that cannot be honoured; the run must fail before claiming a GPU runner."""


class RefKind(enum.Enum):
    PULL = "pull"
    BRANCH = "branch"
    COMMIT = "commit"


class Source(enum.Enum):
    INPUT = "workflow-dispatch input"
    BODY = "pull request body"


@dataclass(frozen=True)
class DependencyRef:
    kind: RefKind
    value: str  # the PR number, the branch name, or the lowercase SHA

    def __str__(self) -> str:
        return f"#{self.value}" if self.kind is RefKind.PULL else self.value


@dataclass(frozen=True)
class Directive:
    upstream: Upstream
    ref: DependencyRef
    source: Source
    named_by: str


@dataclass(frozen=True)
class PinnedOverride:
    directive: Directive
    sha: str


def parse_ref(text: str) -> DependencyRef:
    """`#123`, a branch name, or a 40-hex SHA; raise DirectiveError on anything else."""
    if (match := _PULL.fullmatch(text)) is not None:
        return DependencyRef(RefKind.PULL, match.group(1))
    if _SHA.fullmatch(text):
        return DependencyRef(RefKind.COMMIT, text.lower())
    if text.isdigit():
        raise DirectiveError(f"ref {text!r} is a bare number; write '#{text}' for a pull request")
    if _SHORT_SHA.fullmatch(text):
        raise DirectiveError(f"ref {text!r} looks like an abbreviated SHA; give all 40 hex digits")
    branch_ok = (
        _BRANCH.fullmatch(text) is not None
        and ".." not in text
        and "//" not in text
        and "/." not in text
        and not text.endswith(("/", ".", ".lock"))
    )
    if not branch_ok:
        raise DirectiveError(f"ref {text!r} is not '#N', a branch name or a 40-digit commit SHA")
    return DependencyRef(RefKind.BRANCH, text)


def active_lines(body: str) -> list[str]:
    """The body's lines that can carry directives: outside HTML comments and code fences."""
    lines: list[str] = []
    in_fence = False
    for line in _HTML_COMMENT.sub("", body).splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            lines.append(line)
    return lines


def parse_body(body: str | None) -> dict[str, DependencyRef]:
    """Directives in a pull request body, by upstream key."""
    found: dict[str, DependencyRef] = {}
    if body is None:
        return found
    if not isinstance(body, str):
        raise DirectiveError(f"pull request body must be text, got {type(body).__name__}")
    for line in active_lines(body):
        match = _LINE.fullmatch(line.rstrip(" \t"))
        if match is None:
            continue
        key, value = match.group(1), match.group(2).strip(" \t")
        if not value:
            log.info("ignoring bare directive line %r", line)
            continue
        written = line[: match.end(1) + len("-pr:")]
        if written != written.lower():
            raise DirectiveError(f"directive keys are lowercase, got {written!r}")
        if key not in UPSTREAMS:
            raise DirectiveError(
                f"unknown directive 'ci-{key}-pr' (known: "
                f"{', '.join(u.directive for u in UPSTREAMS.values())})"
            )
        ref = parse_ref(value)
        if key in found and found[key] != ref:
            raise DirectiveError(f"conflicting refs for ci-{key}-pr: {found[key]} and {ref}")
        found[key] = ref
    return found


def choose(
    body: str | None, inputs: Mapping[str, str], pr_author: str | None, actor: str
) -> dict[str, Directive]:
    """Merge dispatch inputs (by upstream key; '' means not given) over body directives."""
    unknown = set(inputs) - set(UPSTREAMS)
    if unknown:
        raise DirectiveError(f"unknown dependency inputs: {sorted(unknown)}")
    from_body = parse_body(body)
    chosen: dict[str, Directive] = {}
    for key, upstream in UPSTREAMS.items():
        text = inputs.get(key, "")
        if not isinstance(text, str):
            raise DirectiveError(f"input for {key} must be text, got {type(text).__name__}")
        if text.strip():
            chosen[key] = Directive(upstream, parse_ref(text.strip()), Source.INPUT, actor)
            if key in from_body:
                log.info("%s: input %s beats body %s", key, chosen[key].ref, from_body[key])
        elif key in from_body:
            if not pr_author:
                raise DirectiveError(f"{upstream.directive} in a body without a known author")
            chosen[key] = Directive(upstream, from_body[key], Source.BODY, pr_author)
    return chosen


def pin(directives: Mapping[str, Directive], api: UpstreamApi) -> dict[str, PinnedOverride]:
    """Resolve every chosen ref to the commit it names now."""
    pinned: dict[str, PinnedOverride] = {}
    for key, directive in directives.items():
        repo, ref = directive.upstream.repository, directive.ref
        if ref.kind is RefKind.PULL:
            sha = (api.pull_request(repo, int(ref.value)).get("head") or {}).get("sha")
        elif ref.kind is RefKind.BRANCH:
            sha = api.branch_head_sha(repo, ref.value)
        else:
            sha = api.commit_sha(repo, ref.value)
            if sha != ref.value:
                raise DirectiveError(f"{repo} answered {sha!r} for commit {ref.value}")
        if not isinstance(sha, str) or _SHA.fullmatch(sha) is None or sha != sha.lower():
            raise DirectiveError(f"{repo} gave no commit SHA for {ref}: {sha!r}")
        pinned[key] = PinnedOverride(directive, sha)
    return pinned


def outputs(pinned: Mapping[str, PinnedOverride]) -> dict[str, str]:
    """Job outputs, strings as GitHub keeps them: `override_<key>` and `<key>_sha` per upstream."""
    result: dict[str, str] = {}
    for key in UPSTREAMS:
        result[f"override_{key}"] = "true" if key in pinned else "false"
        result[f"{key}_sha"] = pinned[key].sha if key in pinned else ""
    return result


def describe(pinned: Mapping[str, PinnedOverride]) -> list[str]:
    """One line per upstream saying who named what, or that it keeps the baseline."""
    lines = []
    for key, upstream in UPSTREAMS.items():
        if key not in pinned:
            lines.append(f"{key}: image baseline (not named)")
            continue
        d = pinned[key].directive
        lines.append(
            f"{key}: {upstream.directive} {d.ref} named by @{d.named_by} in the {d.source.value}"
            f" -> {upstream.repository}@{pinned[key].sha}"
        )
    return lines
