"""The /rerun-test grammar, the test-path rules, and the symlink checks on real git trees."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tools.ci.command import (
    CommandRejected,
    check_test_path,
    check_tree_modes,
    is_command_attempt,
    parse_command,
)
from tools.ci.tree_paths import check_checkout_path, check_git_path, git_tree_modes

pytestmark = pytest.mark.unit

ACCEPTED = [
    ("/rerun-test tests/core/test_weights.py", "tests/core/test_weights.py"),
    ("/rerun-test tests/test_top.py", "tests/test_top.py"),
    ("/rerun-test tests/a/b-c/d_e/test_x9.py", "tests/a/b-c/d_e/test_x9.py"),
    ("/rerun-test tests/core/test_weights.py\n", "tests/core/test_weights.py"),
    ("/rerun-test tests/core/test_weights.py\r\n", "tests/core/test_weights.py"),
    ("/rerun-test tests/core/test_weights.py  \n\n", "tests/core/test_weights.py"),
    ("/rerun-test tests/v1.2/test_x.py", "tests/v1.2/test_x.py"),
]

REJECTED = [
    "/rerun-test",
    "/rerun-test ",
    "/rerun-test  tests/core/test_weights.py",  # two spaces
    "/rerun-test\ttests/core/test_weights.py",
    " /rerun-test tests/core/test_weights.py",  # leading space
    "/rerun-tests tests/core/test_weights.py",
    "/rerun-test tests/core/test_weights.py extra",
    "/rerun-test tests/core/test_weights.py\nsecond line",
    "/rerun-test tests/core/test_a.py tests/core/test_b.py",
    "/rerun-test tests/../tests/core/test_weights.py",
    "/rerun-test tests/core/../test_x.py",
    "/rerun-test tests/core/..test_x.py",
    "/rerun-test tests/core/weights.py",  # not test_*
    "/rerun-test tests/core/test_weights.pyc",
    "/rerun-test tests/core/test_weights.py::test_one",
    "/rerun-test tests/core/test_weights.py[1]",
    "/rerun-test src/tests/test_x.py",
    "/rerun-test /tests/core/test_x.py",
    "/rerun-test tests//test_x.py",
    "/rerun-test tests/.hidden/test_x.py",
    "/rerun-test tests/core/test_$(id).py",
    "/rerun-test tests/core/test_x.py;rm",
    "/rerun-test tests/core/tést_x.py",
    "/rerun-test ./tests/core/test_x.py",
    "/rerun-test tests/core/test_x.py -k slow",
    "/rerun-test tests/" + "a/" * 100 + "test_x.py",
]


@pytest.mark.parametrize(("body", "path"), ACCEPTED)
def test_accepted_commands(body, path):
    assert is_command_attempt(body)
    assert parse_command(body).test_path == path


@pytest.mark.parametrize("body", REJECTED)
def test_rejected_commands(body):
    with pytest.raises(CommandRejected):
        parse_command(body)


@pytest.mark.parametrize(
    ("body", "attempt"),
    [
        ("/rerun-test x", True),
        ("please /rerun-test x", False),
        ("/RERUN-TEST x", False),
        ("", False),
    ],
)
def test_command_attempt_detection(body, attempt):
    assert is_command_attempt(body) is attempt


@pytest.mark.parametrize("value", [None, 3, b"tests/core/test_x.py", ["tests/core/test_x.py"]])
def test_non_text_paths_are_rejected(value):
    with pytest.raises(CommandRejected):
        check_test_path(value)


FILE, EXE, TREE, LINK, SUB = "100644", "100755", "040000", "120000", "160000"
PATH = "tests/core/test_x.py"


@pytest.mark.parametrize(
    ("modes", "ok"),
    [
        ({"tests": TREE, "tests/core": TREE, PATH: FILE}, True),
        ({"tests": TREE, "tests/core": TREE, PATH: EXE}, True),
        ({"tests": TREE, "tests/core": TREE, PATH: LINK}, False),
        ({"tests": TREE, "tests/core": LINK, PATH: FILE}, False),
        ({"tests": LINK, "tests/core": TREE, PATH: FILE}, False),
        ({"tests": TREE, "tests/core": SUB, PATH: FILE}, False),
        ({"tests": TREE, "tests/core": TREE, PATH: TREE}, False),
        ({"tests": TREE, "tests/core": FILE, PATH: FILE}, False),
        ({"tests": TREE, "tests/core": TREE}, False),
        ({"tests": TREE, "tests/core": TREE, PATH: None}, False),
        ({}, False),
    ],
)
def test_tree_mode_table(modes, ok):
    if ok:
        check_tree_modes(PATH, modes)
    else:
        with pytest.raises(CommandRejected):
            check_tree_modes(PATH, modes)


def _git(repo: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.invalid",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.invalid",
    }
    out = subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True)
    return out.stdout.strip()


@pytest.fixture
def tree_repo(tmp_path: Path) -> tuple[Path, str]:
    """A git repo with a real test file, a symlinked file and a symlinked directory."""
    repo = tmp_path / "repo"
    (repo / "tests" / "core").mkdir(parents=True)
    (repo / "tests" / "core" / "test_real.py").write_text("def test_ok():\n    assert True\n")
    (repo / "tests" / "core" / "test_link.py").symlink_to("test_real.py")
    (repo / "tests" / "linked").symlink_to("core")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "tree")
    return repo, _git(repo, "rev-parse", "HEAD")


def test_git_tree_accepts_a_real_file(tree_repo):
    repo, sha = tree_repo
    modes = git_tree_modes(repo, sha, "tests/core/test_real.py")
    assert modes == {"tests": TREE, "tests/core": TREE, "tests/core/test_real.py": FILE}
    check_git_path(repo, sha, "tests/core/test_real.py")


@pytest.mark.parametrize(
    "path", ["tests/core/test_link.py", "tests/linked/test_real.py", "tests/core/test_missing.py"]
)
def test_git_tree_rejects_symlinks_and_missing_files(tree_repo, path):
    repo, sha = tree_repo
    with pytest.raises(CommandRejected):
        check_git_path(repo, sha, path)


def test_git_tree_mode_of_symlink_is_reported(tree_repo):
    repo, sha = tree_repo
    assert git_tree_modes(repo, sha, "tests/core/test_link.py")["tests/core/test_link.py"] == LINK
    assert git_tree_modes(repo, sha, "tests/linked/test_real.py")["tests/linked"] == LINK


def test_checkout_check_matches_git(tree_repo):
    repo, _ = tree_repo
    assert check_checkout_path(repo, "tests/core/test_real.py") == repo / "tests/core/test_real.py"
    for bad in ("tests/core/test_link.py", "tests/linked/test_real.py", "tests/core/test_gone.py"):
        with pytest.raises(CommandRejected):
            check_checkout_path(repo, bad)
