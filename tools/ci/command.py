"""The `/rerun-test <path>` pull-request command: its grammar and the test-path rules.

A comment is a command only when, after trailing whitespace is removed, it is exactly one line:
`/rerun-test`, one space, and a path. The path must name a test module `tests/.../test_*.py` with
plain components (letters, digits, `_`, `-`, `.`; no component starting with `.`), no `..`
anywhere, and must not pass through a symlink or a submodule in the tree that will be tested. This
module decides from text and from git tree modes; it does not read files or talk to GitHub.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

COMMAND = "/rerun-test"
MAX_PATH_CHARS = 200

_COMPONENT = r"[A-Za-z0-9_-][A-Za-z0-9_.-]*"
_TEST_PATH = re.compile(rf"tests/(?:{_COMPONENT}/)*test_[A-Za-z0-9_]+\.py")
_COMMAND_LINE = re.compile(rf"{re.escape(COMMAND)} (\S+)")

# git tree entry modes (`git ls-tree`): a directory, a regular file, an executable file.
MODE_TREE = "040000"
MODE_FILE = "100644"
MODE_EXECUTABLE = "100755"
MODE_SYMLINK = "120000"
MODE_SUBMODULE = "160000"


class CommandRejected(ValueError):
    """A `/rerun-test` attempt that must not run; the message says why, for the reply comment."""


@dataclass(frozen=True)
class RerunCommand:
    test_path: str

    def __post_init__(self) -> None:
        check_test_path(self.test_path)


def is_command_attempt(body: str) -> bool:
    """True when the comment starts with the command word (so a rejection deserves a reply)."""
    return isinstance(body, str) and body.startswith(COMMAND)


def parse_command(body: str) -> RerunCommand:
    """Parse a comment body that is a command attempt; raise CommandRejected on anything else."""
    if not isinstance(body, str):
        raise CommandRejected(f"comment body must be text, got {type(body).__name__}")
    text = body.rstrip(" \t\r\n")
    match = _COMMAND_LINE.fullmatch(text)
    if match is None:
        raise CommandRejected(
            f"expected exactly `{COMMAND} tests/<dir>/test_<name>.py` on one line, got {text[:120]!r}"
        )
    return RerunCommand(test_path=match.group(1))


def check_test_path(path: object) -> str:
    """Return `path` when it is an acceptable test module path, else raise CommandRejected."""
    if not isinstance(path, str):
        raise CommandRejected(f"test path must be text, got {type(path).__name__}")
    if len(path) > MAX_PATH_CHARS:
        raise CommandRejected(f"test path longer than {MAX_PATH_CHARS} characters: {path[:60]!r}...")
    if ".." in path:
        raise CommandRejected(f"test path must not contain '..': {path!r}")
    if _TEST_PATH.fullmatch(path) is None:
        raise CommandRejected(f"test path must match tests/.../test_*.py with plain names: {path!r}")
    return path


def path_prefixes(path: str) -> list[str]:
    """`tests/a/test_b.py` -> [`tests`, `tests/a`, `tests/a/test_b.py`]."""
    parts = path.split("/")
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def check_tree_modes(path: str, modes: Mapping[str, str | None]) -> None:
    """Check the git modes of every prefix of `path` (None: absent from the tree).

    Every directory on the way must be a real tree and the module a regular file: a symlink or a
    submodule anywhere on the path, or a missing entry, is rejected.
    """
    prefixes = path_prefixes(check_test_path(path))
    for prefix in prefixes:
        mode = modes.get(prefix)
        if mode is None:
            raise CommandRejected(f"{prefix!r} does not exist at the pull request's head")
        if mode == MODE_SYMLINK:
            raise CommandRejected(f"{prefix!r} is a symlink; name the real test file")
        if mode == MODE_SUBMODULE:
            raise CommandRejected(f"{prefix!r} is a submodule; name a test file of this repository")
        expected = (MODE_FILE, MODE_EXECUTABLE) if prefix == prefixes[-1] else (MODE_TREE,)
        if mode not in expected:
            kind = "a regular file" if prefix == prefixes[-1] else "a directory"
            raise CommandRejected(f"{prefix!r} has git mode {mode}, expected {kind}")
