"""POSIX shared-memory byte buffers (/dev/shm objects) as host uint8 tensors: the publisher creates
one per staging bucket, engines on the same host map it read-only and copy out of it.

Uses os/mmap directly rather than multiprocessing.shared_memory, whose resource tracker unlinks
objects it merely opened when the opening process exits. Knows nothing about versions.

An object outlives a creator that is killed (kill -9, OOM) and holds its memory until someone
unlinks it. So the creator holds an advisory `flock` on its object for as long as it lives (the
kernel drops it when the process dies, whatever its PID namespace), and every `create` first
removes the objects of this module's naming scheme whose lock nobody holds.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import uuid

import torch

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_CREATED = re.compile(r"^furlong-[A-Za-z0-9._-]*-[0-9a-f]{12}$")  # names `create` makes


def _path(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"shared-memory name {name!r} is not 1-200 of [A-Za-z0-9._-]")
    return os.path.join(SHM_DIR, name)


class SharedBuffer:
    """A mapped shared-memory object. `tensor` is a 1-D uint8 view of all of it; it must not be
    used after close(). The creator unlinks the object on close; openers only unmap."""

    def __init__(self, name: str, size_bytes: int, *, create: bool) -> None:
        if size_bytes < 1:
            raise ValueError(f"shared buffer {name!r}: size_bytes {size_bytes} < 1")
        self.name = name
        self.size_bytes = size_bytes
        self._owner = create
        self._lock_fd: int | None = None
        path = _path(name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                # Locked before it has a size (`remove_stale` leaves empty objects alone, and
                # lets go of them at once).
                fcntl.flock(fd, fcntl.LOCK_EX)
                os.ftruncate(fd, size_bytes)
            elif os.fstat(fd).st_size < size_bytes:
                raise ValueError(
                    f"shared buffer {name!r} holds {os.fstat(fd).st_size} bytes, fewer than {size_bytes}"
                )
            self._map = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            if create:
                os.unlink(path)
            raise
        if create:
            self._lock_fd = fd  # held open (and locked) until close()
        else:
            os.close(fd)
        self.tensor: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)

    @classmethod
    def create(cls, prefix: str, size_bytes: int) -> SharedBuffer:
        """A new object named furlong-<prefix>-<random>, zero-filled. Objects left by creators
        that died are removed first (see remove_stale)."""
        remove_stale()
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", prefix)[:100]
        return cls(f"furlong-{safe}-{uuid.uuid4().hex[:12]}", size_bytes, create=True)

    @classmethod
    def open(cls, name: str, size_bytes: int) -> SharedBuffer:
        """Map an existing object; FileNotFoundError if there is none (another host)."""
        return cls(name, size_bytes, create=False)

    def close(self) -> None:
        """Unmap (and unlink, for the creator); idempotent. Every view of `tensor` must be gone."""
        if self.tensor is None:
            return
        self.tensor = None
        try:
            self._map.close()
        except BufferError:
            log.warning("shared buffer %s still has views; leaving it mapped", self.name)
        if self._owner:
            try:
                os.unlink(_path(self.name))
            except FileNotFoundError:
                pass
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def remove_stale(directory: str = SHM_DIR) -> list[str]:
    """Unlink the objects `SharedBuffer.create` made in directory whose creator is gone (nobody
    holds their lock); returns their names. Empty objects are left alone: their creator may not
    have locked them yet. Processes that still map a removed object keep their mapping."""
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(directory) if _CREATED.match(n)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue  # gone meanwhile, or not ours to touch
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            size = os.fstat(fd).st_size
            if size == 0:
                continue
            os.unlink(path)
            removed.append(name)
            log.warning(
                "removed shared-memory object %s (%d bytes) left by a process that exited", name, size
            )
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.ENOENT):
                log.warning("could not check shared-memory object %s: %s", name, exc)
        finally:
            os.close(fd)
    return removed
