"""A shared-memory bucket whose creator was killed (kill -9) is removed by the next bucket created on
the host; the buckets of live creators, objects not named like buckets and empty objects stay."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from furlong.transfer.shm import SHM_DIR, SharedBuffer, remove_stale

pytestmark = pytest.mark.unit

_CREATOR = """
import sys, time
from furlong.transfer.shm import SharedBuffer
buf = SharedBuffer.create(sys.argv[1], 1 << 20)
print(buf.name, flush=True)
time.sleep(600)
"""


def _creator(prefix: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", _CREATOR, prefix], stdout=subprocess.PIPE, text=True)
    name = proc.stdout.readline().strip()
    assert name.startswith(f"furlong-{prefix}-"), name
    return proc, name


def _exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


def test_a_killed_creators_bucket_is_removed_by_the_next_create():
    dead, dead_name = _creator("stale-dead")
    live, live_name = _creator("stale-live")
    empty = os.path.join(SHM_DIR, "furlong-stale-empty-0123456789ab")
    other = os.path.join(SHM_DIR, "furlong-stale-other")
    for path in (empty, other):
        open(path, "wb").close()
    with open(other, "wb") as f:
        f.write(b"x" * 4096)
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait(30)
        assert _exists(dead_name)  # the kernel does not clean it up
        fresh = SharedBuffer.create("stale-fresh", 4096)
        try:
            assert not _exists(dead_name)
            assert _exists(live_name)  # its creator still holds the lock
            assert os.path.exists(empty) and os.path.exists(other)
            assert fresh.name not in remove_stale()  # our own, locked by this process
            assert _exists(fresh.name)
        finally:
            fresh.close()
        assert not _exists(fresh.name)
    finally:
        live.kill()
        live.wait(30)
        for path in (empty, other):
            os.unlink(path)
    assert live_name in remove_stale()  # the kernel dropped the lock when the process exited


def test_an_opener_does_not_keep_a_bucket_alive():
    """Engines map buckets too; only the creator's lock counts."""
    owner, name = _creator("stale-opened")
    opened = SharedBuffer.open(name, 1 << 20)
    try:
        owner.kill()
        owner.wait(30)
        assert name in remove_stale()
        assert opened.tensor is not None and int(opened.tensor[0]) == 0  # mapping still valid
    finally:
        opened.close()
