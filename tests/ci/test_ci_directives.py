"""Dependency directives: which lines count, input beats body, refs pinned to commits."""

from __future__ import annotations

import pytest
from ci_fakes import FakeGitHub, pull

from tools.ci.directives import (
    UPSTREAMS,
    DependencyRef,
    DirectiveError,
    RefKind,
    Source,
    choose,
    describe,
    outputs,
    parse_body,
    parse_ref,
    pin,
)
from tools.ci.github_api import GitHubApiError

pytestmark = pytest.mark.unit

SHA_A = "a" * 40
SHA_B = "0123456789abcdef0123456789abcdef01234567"
PR = DependencyRef(RefKind.PULL, "123")
BRANCH = DependencyRef(RefKind.BRANCH, "feature/weights-v2")
COMMIT = DependencyRef(RefKind.COMMIT, SHA_B)

BODIES = [
    # (body, expected {key: ref})
    (None, {}),
    ("", {}),
    ("Fixes the thing.", {}),
    ("ci-sglang-pr: #123", {"sglang": PR}),
    ("ci-sglang-pr:#123", {"sglang": PR}),
    ("ci-sglang-pr:   #123   ", {"sglang": PR}),
    ("ci-sglang-pr:\t#123", {"sglang": PR}),
    ("Intro\r\nci-megatron-pr: feature/weights-v2\r\nOutro", {"megatron": BRANCH}),
    (f"ci-megatron-pr: {SHA_B}", {"megatron": COMMIT}),
    (f"ci-megatron-pr: {SHA_B.upper()}", {"megatron": COMMIT}),
    (f"ci-sglang-pr: #123\nci-megatron-pr: {SHA_B}", {"sglang": PR, "megatron": COMMIT}),
    ("ci-sglang-pr: #123\nci-sglang-pr: #123", {"sglang": PR}),  # repeated, same ref
    # not anchored: ignored
    (" ci-sglang-pr: #123", {}),
    ("- ci-sglang-pr: #123", {}),
    ("> ci-sglang-pr: #123", {}),
    ("please set ci-sglang-pr: #123", {}),
    ("`ci-sglang-pr: #123`", {}),
    ("<!-- ci-sglang-pr: #123 -->", {}),
    ("<!--\nci-sglang-pr: #123\n-->", {}),
    ("text\n<!-- template\nci-sglang-pr: #1\n", {}),  # unterminated comment hides the rest
    ("```\nci-sglang-pr: #123\n```", {}),
    (
        "~~~yaml\nci-sglang-pr: #123\n~~~\nci-megatron-pr: #7",
        {"megatron": DependencyRef(RefKind.PULL, "7")},
    ),
    # bare keys: ignored
    ("ci-sglang-pr:", {}),
    ("ci-sglang-pr:   ", {}),
    ("ci-sglang-pr:\nci-megatron-pr: #123", {"megatron": PR}),
    ("ci-sglang-pr", {}),
    ("ci-unknown-pr:", {}),
]

BAD_BODIES = [
    "ci-sglang-pr: #123\nci-sglang-pr: #124",  # conflict
    "ci-sglang-pr: #123 please",
    "ci-sglang-pr: #0",
    "ci-sglang-pr: #-1",
    "ci-sglang-pr: #12a",
    "ci-sglang-pr: 123",  # abbreviated-SHA-looking digits
    "ci-sglang-pr: abc1234",  # abbreviated SHA
    "ci-sglang-pr: ../../etc",
    "ci-sglang-pr: -rf",
    "ci-sglang-pr: feature/",
    "ci-sglang-pr: feature.lock",
    "ci-sglang-pr: a..b",
    "ci-sglang-pr: $(whoami)",
    "ci-sglang-pr: main;rm",
    "ci-vllm-pr: #1",  # unknown dependency
    "ci-megatron-lm-pr: #1",  # misspelt dependency
    "CI-SGLANG-PR: #1",  # keys are lowercase
    "Ci-sglang-pr: #1",
]


@pytest.mark.parametrize(("body", "expected"), BODIES)
def test_body_directives(body, expected):
    assert parse_body(body) == expected


@pytest.mark.parametrize("body", BAD_BODIES)
def test_bad_body_directives_fail(body):
    with pytest.raises(DirectiveError):
        parse_body(body)


@pytest.mark.parametrize(
    ("text", "ref"),
    [
        ("#1", DependencyRef(RefKind.PULL, "1")),
        ("#4567", DependencyRef(RefKind.PULL, "4567")),
        ("main", DependencyRef(RefKind.BRANCH, "main")),
        ("core_r0.16.0", DependencyRef(RefKind.BRANCH, "core_r0.16.0")),
        ("user/fix-rope", DependencyRef(RefKind.BRANCH, "user/fix-rope")),
        ("abc", DependencyRef(RefKind.BRANCH, "abc")),  # too short to be a SHA
        (SHA_B, COMMIT),
    ],
)
def test_ref_forms(text, ref):
    assert parse_ref(text) == ref


def test_input_beats_body_and_names_who():
    body = "ci-sglang-pr: #123\nci-megatron-pr: main"
    chosen = choose(body, {"sglang": "feature/weights-v2", "megatron": ""}, "bob", "carol")
    assert chosen["sglang"].ref == BRANCH
    assert (chosen["sglang"].source, chosen["sglang"].named_by) == (Source.INPUT, "carol")
    assert chosen["megatron"].ref == DependencyRef(RefKind.BRANCH, "main")
    assert (chosen["megatron"].source, chosen["megatron"].named_by) == (Source.BODY, "bob")


def test_inputs_alone_and_blank_inputs():
    assert choose(None, {"sglang": "", "megatron": "  "}, None, "carol") == {}
    chosen = choose(None, {"megatron": f" {SHA_B} "}, None, "carol")
    assert list(chosen) == ["megatron"] and chosen["megatron"].ref == COMMIT


def test_bad_input_fails_even_when_body_is_fine():
    with pytest.raises(DirectiveError):
        choose("ci-sglang-pr: #1", {"sglang": "#x"}, "bob", "carol")
    with pytest.raises(DirectiveError):
        choose(None, {"vllm": "#1"}, None, "carol")


def test_body_directive_needs_an_author():
    with pytest.raises(DirectiveError):
        choose("ci-sglang-pr: #1", {}, None, "carol")


def upstream_api() -> FakeGitHub:
    api = FakeGitHub()
    api.pulls[("sgl-project/sglang", 123)] = pull("sgl-project/sglang", 123, SHA_A, head_repo="x/sglang")
    api.branches[("NVIDIA/Megatron-LM", "feature/weights-v2")] = SHA_B
    api.commits.add(("NVIDIA/Megatron-LM", SHA_B))
    return api


def test_pin_resolves_every_form_and_outputs_strings():
    api = upstream_api()
    chosen = choose("ci-sglang-pr: #123\nci-megatron-pr: feature/weights-v2", {}, "bob", "carol")
    pinned = pin(chosen, api)
    assert {k: p.sha for k, p in pinned.items()} == {"sglang": SHA_A, "megatron": SHA_B}
    assert outputs(pinned) == {
        "override_sglang": "true",
        "sglang_sha": SHA_A,
        "override_megatron": "true",
        "megatron_sha": SHA_B,
    }
    lines = describe(pinned)
    assert lines[0] == (
        f"sglang: ci-sglang-pr #123 named by @bob in the pull request body -> sgl-project/sglang@{SHA_A}"
    )
    assert "feature/weights-v2 named by @bob" in lines[1]
    commit_only = pin(choose(None, {"megatron": SHA_B}, None, "carol"), api)
    assert commit_only["megatron"].sha == SHA_B


def test_nothing_named_keeps_the_baseline():
    assert outputs({}) == {
        "override_sglang": "false",
        "sglang_sha": "",
        "override_megatron": "false",
        "megatron_sha": "",
    }
    assert describe({}) == [f"{k}: image baseline (not named)" for k in UPSTREAMS]


def test_pin_fails_closed_on_unknown_refs():
    api = upstream_api()
    for body in ("ci-sglang-pr: #999", "ci-megatron-pr: gone", "ci-megatron-pr: " + SHA_A):
        with pytest.raises(GitHubApiError):
            pin(choose(body, {}, "bob", "carol"), api)
    api.pulls[("sgl-project/sglang", 5)] = pull("sgl-project/sglang", 5, "not-a-sha")
    with pytest.raises(DirectiveError):
        pin(choose("ci-sglang-pr: #5", {}, "bob", "carol"), api)
