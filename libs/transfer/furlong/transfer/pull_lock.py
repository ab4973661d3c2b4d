"""Take turns: engines on one host pull a source's round one at a time.

Two engine processes copying out of the same host-memory bucket at once (NIXL READs over CMA, or
copies out of the shared-memory bucket) get no more in total than one after the other: measured
here, two concurrent 256 MiB READs ran at 3-5 GB/s each, one alone at 8-10 GB/s. Taking turns
finishes each engine's pull in about half the time and lets one engine verify the round it just
pulled while the next one pulls (the whole switch came out about the same on a 2-core host; see
docs/weight-broker.md). So a receiver holds an
advisory lock file (`flock`, released by the kernel if the holder dies) while it pulls from a
host-memory source. One lock per host, not per source: pulls from different sources share the
same memory bandwidth. The lock lives in /dev/shm (else the temp directory), so it only ever
orders processes that share that directory. It is only a scheduling aid: a receiver that cannot
get it within `TransferConfig.pull_lock_wait_s` pulls anyway, and does not wait for it again for
the next minute (a stopped holder costs the others one wait, not one per round); an unusable lock
directory disables it.
Knows nothing about versions, rounds or checksums.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import tempfile
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)

_POLL_MIN_S = 200e-6
_POLL_MAX_S = 2e-3
BYPASS_S = 60.0  # after a missed deadline, pull without waiting for the lock for this long


def lock_directory() -> str:
    return (
        "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    )


LOCK_FILE = "furlong-pull.lock"


class PullLock:
    """The host's lock file; `held(deadline)` waits for it (polling, so a deadline holds). One
    per receiver, used from its thread."""

    def __init__(self, directory: str | None = None) -> None:
        self.path = os.path.join(directory or lock_directory(), LOCK_FILE)
        self._fd: int | None = None
        self._bypass_until = 0.0
        try:
            self._fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
        except OSError as exc:
            log.warning("pull lock %s unusable (%s); pulls are not serialised", self.path, exc)

    @contextlib.contextmanager
    def held(self, deadline: float) -> Iterator[bool]:
        """Hold the lock inside the block (yields whether it was taken). Past `deadline`
        (time.monotonic()) the block runs without it."""
        acquired = self._acquire(deadline)
        try:
            yield acquired
        finally:
            if acquired:
                assert self._fd is not None  # only an open lock file is acquired
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _acquire(self, deadline: float) -> bool:
        if self._fd is None:
            return False
        bypassing = time.monotonic() < self._bypass_until  # one try, no wait
        pause = _POLL_MIN_S
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    log.warning("pull lock %s: %s; pulling without it", self.path, exc)
                    return False
            if bypassing:
                return False
            if time.monotonic() >= deadline:
                log.warning(
                    "pull lock %s still held by another engine after the wait allowed; "
                    "pulling without it (and without waiting for it for %.0f s)",
                    self.path,
                    BYPASS_S,
                )
                self._bypass_until = time.monotonic() + BYPASS_S
                return False
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
