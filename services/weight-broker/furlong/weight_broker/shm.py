"""POSIX shared-memory byte buffers (/dev/shm objects) as host uint8 tensors: the publisher creates
one per staging bucket, engines on the same host map it read-only and copy out of it.

Uses os/mmap directly rather than multiprocessing.shared_memory, whose resource tracker unlinks
objects it merely opened when the opening process exits. Knows nothing about versions.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import uuid

import torch

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


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
        path = _path(name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size_bytes)
            elif os.fstat(fd).st_size < size_bytes:
                raise ValueError(f"shared buffer {name!r} holds {os.fstat(fd).st_size} bytes, "
                                 f"fewer than {size_bytes}")
            self._map = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            if create:
                os.unlink(path)
            raise
        os.close(fd)
        self.tensor: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)

    @classmethod
    def create(cls, prefix: str, size_bytes: int) -> "SharedBuffer":
        """A new object named <prefix>-<random>, zero-filled."""
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", prefix)[:100]
        return cls(f"furlong-{safe}-{uuid.uuid4().hex[:12]}", size_bytes, create=True)

    @classmethod
    def open(cls, name: str, size_bytes: int) -> "SharedBuffer":
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
