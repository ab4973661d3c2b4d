"""Where a test path really leads: git tree modes at a commit, and the checked-out working tree.

The gateway asks git for the mode of every prefix of the requested path at the pull request's head
commit before it dispatches anything; the dispatched run checks the checked-out files again with
`lstat`, so a symlink can slip in neither before nor after the dispatch. The rules themselves live
in `command.check_tree_modes`.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

from tools.ci.command import (
    MODE_EXECUTABLE,
    MODE_FILE,
    MODE_SYMLINK,
    MODE_TREE,
    CommandRejected,
    check_test_path,
    check_tree_modes,
    path_prefixes,
)

GIT_TIMEOUT_S = 60


def fetch_commit(repo_dir: Path, commit: str) -> None:
    """Make `commit` available locally (a shallow fetch from `origin`) without checking it out."""
    out = subprocess.run(
        ["git", "fetch", "--no-tags", "--depth=1", "origin", commit],
        cwd=repo_dir,
        capture_output=True,
        text=True,
        timeout=GIT_TIMEOUT_S,
        check=False,
    )
    if out.returncode != 0:
        raise CommandRejected(f"cannot fetch {commit} from origin: {out.stderr.strip()}")


def git_tree_modes(repo_dir: Path, commit: str, path: str) -> dict[str, str | None]:
    """Mode of each prefix of `path` in `commit` (None when git lists no such entry)."""
    modes: dict[str, str | None] = {}
    for prefix in path_prefixes(check_test_path(path)):
        out = subprocess.run(
            ["git", "ls-tree", "-z", commit, "--", prefix],
            cwd=repo_dir,
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            check=False,
        )
        if out.returncode != 0:
            raise CommandRejected(f"git ls-tree {commit} -- {prefix} failed: {out.stderr.strip()}")
        modes[prefix] = None
        for entry in filter(None, out.stdout.split("\0")):
            meta, _, name = entry.partition("\t")
            if name == prefix:
                modes[prefix] = meta.split(" ", 1)[0]
    return modes


def check_git_path(repo_dir: Path, commit: str, path: str) -> None:
    """Raise CommandRejected unless `path` is a plain test file at `commit`."""
    check_tree_modes(path, git_tree_modes(repo_dir, commit, path))


def check_checkout_path(root: Path, path: str) -> Path:
    """Same rules on a working tree: every component exists and none is a symlink."""
    modes: dict[str, str | None] = {}
    for prefix in path_prefixes(check_test_path(path)):
        try:
            info = os.lstat(root / prefix)
        except FileNotFoundError:
            modes[prefix] = None
            continue
        if stat.S_ISLNK(info.st_mode):
            modes[prefix] = MODE_SYMLINK
        elif stat.S_ISDIR(info.st_mode):
            modes[prefix] = MODE_TREE
        elif stat.S_ISREG(info.st_mode):
            modes[prefix] = MODE_EXECUTABLE if info.st_mode & stat.S_IXUSR else MODE_FILE
        else:
            modes[prefix] = f"special:{stat.S_IFMT(info.st_mode):o}"
    check_tree_modes(path, modes)
    return root / path
