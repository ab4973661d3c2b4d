"""One Redis per state directory: the redis-server binary is chosen once, recorded, and reused.

Redis 7 keeps its append-only file as `appendonlydir/`, Redis 6 as `appendonly.aof`: two versions
on one data directory each read their own files and show two different histories. So the first
start of a stack records the binary it chose (`STATE_DIR/redis/redis-server.json`: path and
version) and every later start runs that one, whatever is first on PATH (a venv activated or
not). A binary asked for explicitly (`--redis-server`) of another version than the recorded one is
refused with a `RedisBinaryError` naming both; so is a recorded binary that is gone or has changed
version, and a first start on data whose format the chosen binary does not write. Knows nothing
about processes other than asking a binary its version.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from furlong.controller.redis_server import find_redis_server

log = logging.getLogger(__name__)

RECORD_FILE = "redis-server.json"
_VERSION = re.compile(r"\bv=(\d+)\.(\d+)\.(\d+)")
_AOF_DIR, _AOF_FILE = "appendonlydir", "appendonly.aof"  # Redis >= 7, Redis < 7


class RedisBinaryError(RuntimeError):
    """The state directory's Redis data cannot be served by the binary at hand."""


@dataclass(frozen=True)
class RedisBinary:
    path: str
    version: str  # "7.0.15"

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])

    def describe(self) -> str:
        return f"redis-server {self.version} ({self.path})"


def binary_version(path: str) -> str:
    """The version `path --version` reports; RedisBinaryError when it is no redis-server."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RedisBinaryError(f"cannot run {path} --version: {exc}") from None
    found = _VERSION.search(out.stdout)
    if out.returncode != 0 or found is None:
        raise RedisBinaryError(f"{path} --version did not report a redis-server version: {out.stdout!r}")
    return ".".join(found.groups())


def data_format_major(data_dir: Path) -> int | None:
    """7 when data_dir holds Redis 7's append-only directory, 6 for an older append-only file,
    None when it holds no data yet."""
    if (data_dir / _AOF_DIR).is_dir():
        return 7
    if (data_dir / _AOF_FILE).is_file():
        return 6
    return None


def _same_format(binary_major: int, data_major: int) -> bool:
    return (binary_major >= 7) == (data_major >= 7)


def choose_redis_binary(
    data_dir: Path, requested: str | None = None, find: Callable[[], str] = find_redis_server
) -> RedisBinary:
    """The binary to run on data_dir (see the module docstring); the first choice is recorded."""
    record = data_dir / RECORD_FILE
    if record.is_file():
        recorded = RedisBinary(**json.loads(record.read_text()))
        if requested is not None:
            asked = RedisBinary(requested, binary_version(requested))
            if asked.version != recorded.version:
                raise RedisBinaryError(
                    f"{data_dir} holds the data of {recorded.describe()}, recorded when this state "
                    f"directory was first used; refusing {asked.describe()}: another version reads "
                    "other files and would show another history. Drop --redis-server, or use another "
                    "--state-dir"
                )
        if not os.access(recorded.path, os.X_OK):
            raise RedisBinaryError(
                f"{data_dir} holds the data of {recorded.describe()}, which is no longer there; "
                f"install it again, or remove {record} to choose another binary of the same version"
            )
        now = binary_version(recorded.path)
        if now != recorded.version:
            raise RedisBinaryError(
                f"{recorded.path} is now redis-server {now}, but {data_dir} holds the data of "
                f"version {recorded.version}; reinstall it, or remove {record} if the new version "
                "reads the same files"
            )
        return recorded
    chosen = RedisBinary(requested or find(), "")
    chosen = RedisBinary(chosen.path, binary_version(chosen.path))
    data_major = data_format_major(data_dir)
    if data_major is not None and not _same_format(chosen.major, data_major):
        kind = f"{_AOF_DIR}/ (Redis 7 or later)" if data_major >= 7 else f"{_AOF_FILE} (Redis 6 or older)"
        raise RedisBinaryError(
            f"{data_dir} holds data in {kind} but {chosen.describe()} writes the other format; "
            "start with a binary of the version that wrote it (--redis-server PATH)"
        )
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = record.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(chosen), indent=2) + "\n")
    os.replace(tmp, record)
    log.info("recorded %s for %s", chosen.describe(), data_dir)
    return chosen
