"""Checksums of byte ranges, hashed block by block so that they run on several threads and can be
taken while the bytes are copied.

The checksum of a range of `size` bytes (CHECKSUM_ALGORITHM): cut it into consecutive blocks of
BLOCK_BYTES (8 MiB; the last one may be shorter), take the xxh3-128 digest of each block, and take
xxh3-128 of the concatenated 16-byte block digests (hex). Blocks are independent, so:

- `range_checksum` hashes a range's blocks on up to `workers` threads (xxhash releases the GIL);
- `copy_checksum` copies a range into its destination and hashes each piece right after copying
  it, while it is still in the CPU cache (COPY_CHUNK_BYTES at a time), so checking what arrived
  costs no second pass over memory; blocks are split between threads the same way.

A range is given as segments: (offset within the range, 1-D uint8 host tensor). Segments are
sorted and do not overlap; bytes no segment covers are zeros (the padding between tensors in a
staged round). Knows nothing about layouts, rounds or transports.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

CHECKSUM_ALGORITHM = "xxh3-128/8MiB-blocks"
BLOCK_BYTES = 8 << 20
COPY_CHUNK_BYTES = 512 << 10  # copied then hashed while still in the (1 MiB per core) L2 cache
_ZEROS = memoryview(bytes(BLOCK_BYTES))

Segment = tuple[int, torch.Tensor]  # (offset, bytes)
CopySegment = tuple[int, torch.Tensor, torch.Tensor]  # (offset, source bytes, destination bytes)


def default_workers() -> int:
    """Threads for hashing: every core, at most four."""
    return max(1, min(4, os.cpu_count() or 1))


_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    """One pool per size and process: a forked child gets its own (the parent's threads are not
    there)."""
    key = (os.getpid(), workers)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = ThreadPoolExecutor(workers, thread_name_prefix="checksum")
        return pool


def _check_bytes(what: str, tensor: torch.Tensor) -> None:
    if (
        tensor.dtype != torch.uint8
        or tensor.dim() != 1
        or not tensor.is_contiguous()
        or tensor.device.type != "cpu"
    ):
        raise ValueError(
            f"{what} must be a contiguous 1-D uint8 host tensor, got {tensor.dtype} "
            f"{tuple(tensor.shape)} on {tensor.device}"
        )


def _check_segments(size_bytes: int, offsets: Sequence[int], lengths: Sequence[int]) -> None:
    if size_bytes < 0:
        raise ValueError(f"range size_bytes {size_bytes} < 0")
    end = 0
    for offset, length in zip(offsets, lengths):
        if offset < end or offset + length > size_bytes:
            raise ValueError(
                f"segment [{offset}, {offset + length}) overlaps the previous one or "
                f"lies outside the {size_bytes}-byte range"
            )
        end = offset + length


def _parts(
    lo: int, hi: int, offsets: Sequence[int], lengths: Sequence[int]
) -> Iterator[tuple[int, int, int, int]]:
    """(segment index or -1 for zeros, start within the segment, range offset, length) covering
    [lo, hi) in order."""
    cursor = lo
    index = max(0, bisect.bisect_right(offsets, lo) - 1)
    while cursor < hi:
        if index < len(offsets) and offsets[index] + lengths[index] <= cursor:
            index += 1
            continue
        if index >= len(offsets) or offsets[index] >= hi:
            yield -1, 0, cursor, hi - cursor
            return
        if offsets[index] > cursor:
            yield -1, 0, cursor, offsets[index] - cursor
            cursor = offsets[index]
        end = min(hi, offsets[index] + lengths[index])
        yield index, cursor - offsets[index], cursor, end - cursor
        cursor = end
        index += 1


class RangeHasher:
    """The checksum of a `size_bytes` range made of `segments` (zeros between them), block by
    block: `block_digest(k)` may be called from any thread, in any order, as soon as block k's
    bytes are in place (a lane that fills a range block by block hashes each block right after it
    arrived); `combine` makes the range checksum of all block digests in order."""

    def __init__(self, size_bytes: int, segments: Sequence[Segment]) -> None:
        for _, data in segments:
            _check_bytes("segment", data)
        self.size_bytes = size_bytes
        self._offsets = [offset for offset, _ in segments]
        self._lengths = [data.numel() for _, data in segments]
        _check_segments(size_bytes, self._offsets, self._lengths)
        self._views = [data.numpy().data for _, data in segments]

    @property
    def num_blocks(self) -> int:
        return (self.size_bytes + BLOCK_BYTES - 1) // BLOCK_BYTES

    def _block_parts(self, k: int) -> Iterator[tuple[int, int, int]]:
        """(segment index or -1 for zeros, start within the segment, length) covering block k."""
        lo = k * BLOCK_BYTES
        for index, start, _, length in _parts(
            lo, min(self.size_bytes, lo + BLOCK_BYTES), self._offsets, self._lengths
        ):
            yield index, start, length

    def segment_parts(self, k: int) -> list[tuple[int, int, int]]:
        """(segment index, start within the segment, length) of the segment bytes in block k, in
        order (the zeros between segments left out)."""
        return [part for part in self._block_parts(k) if part[0] >= 0 and part[2]]

    def block_digest(self, k: int) -> bytes:
        hasher = xxhash.xxh3_128()
        for index, start, length in self._block_parts(k):
            view = _ZEROS if index < 0 else self._views[index][start:]
            hasher.update(view[:length])
        return hasher.digest()

    @staticmethod
    def combine(digests: Sequence[bytes]) -> str:
        return xxhash.xxh3_128(b"".join(digests)).hexdigest()


def _combine(hasher: RangeHasher, block_digest: Callable[[int], bytes], workers: int | None) -> str:
    blocks = range(hasher.num_blocks)
    workers = default_workers() if workers is None else workers
    if workers > 1 and len(blocks) > 1:
        digests = list(_pool(workers).map(block_digest, blocks))
    else:
        digests = [block_digest(k) for k in blocks]
    return RangeHasher.combine(digests)


def range_checksum(size_bytes: int, segments: Sequence[Segment], workers: int | None = None) -> str:
    """The checksum of a `size_bytes` range made of `segments` (zeros between them)."""
    hasher = RangeHasher(size_bytes, segments)
    return _combine(hasher, hasher.block_digest, workers)


def copy_checksum(size_bytes: int, copies: Sequence[CopySegment], workers: int | None = None) -> str:
    """Copy every segment's source into its destination (equal lengths, no overlap between them)
    and return the checksum of the range as it landed: of the destination bytes, each hashed
    right after it was copied (zeros between segments)."""
    for _, src, dst in copies:
        _check_bytes("copy source", src)
        if src.numel() != dst.numel():
            raise ValueError(f"copy of {src.numel()} bytes into {dst.numel()} bytes")
    hasher = RangeHasher(size_bytes, [(offset, dst) for offset, _, dst in copies])
    src_ptrs = [src.data_ptr() for _, src, _ in copies]
    dst_ptrs = [dst.data_ptr() for _, _, dst in copies]

    def block_digest(k: int) -> bytes:
        digest = xxhash.xxh3_128()
        for index, start, length in hasher._block_parts(k):
            if index < 0:
                digest.update(_ZEROS[:length])
                continue
            for at in range(start, start + length, COPY_CHUNK_BYTES):
                n = min(COPY_CHUNK_BYTES, start + length - at)
                ctypes.memmove(dst_ptrs[index] + at, src_ptrs[index] + at, n)  # releases the GIL
                digest.update(hasher._views[index][at : at + n])
        return digest.digest()

    return _combine(hasher, block_digest, workers)
