"""Which state directory a `furlong` command uses, found the same way from any working directory.

In this order: an explicit `--state-dir`; else the environment variable `FURLONG_STATE_DIR`; else
the nearest directory named `.furlong` in the working directory or above it (as git finds `.git`);
else a new `.furlong` in the working directory. The answer says which rule chose it, so the CLI can
print it: a command run from a sub-folder uses the project's stack instead of silently starting a
second one. Knows nothing about what a state directory holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "FURLONG_STATE_DIR"
DIR_NAME = ".furlong"


@dataclass(frozen=True)
class StateDir:
    path: Path  # absolute
    source: str  # which rule chose it, in words

    def describe(self) -> str:
        return f"state directory {self.path} ({self.source})"


def resolve_state_dir(explicit: Path | None, env: Mapping[str, str], cwd: Path) -> StateDir:
    """The state directory by the rules of the module docstring; relative paths are taken against
    cwd. An empty environment variable counts as unset."""
    cwd = Path(cwd).resolve()
    if explicit is not None:
        return StateDir(_absolute(Path(explicit), cwd), "--state-dir")
    from_env = env.get(ENV_VAR, "")
    if from_env:
        return StateDir(_absolute(Path(from_env), cwd), f"${ENV_VAR}")
    for directory in (cwd, *cwd.parents):
        candidate = directory / DIR_NAME
        if candidate.is_dir():
            where = (
                "the working directory" if directory == cwd else f"found above the working directory {cwd}"
            )
            return StateDir(candidate.resolve(), f"the nearest {DIR_NAME}: {where}")
    return StateDir(cwd / DIR_NAME, f"no {DIR_NAME} in or above the working directory: a new one here")


def _absolute(path: Path, cwd: Path) -> Path:
    return (path if path.is_absolute() else cwd / path).resolve()
