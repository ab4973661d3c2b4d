"""Block checksums: a range made of segments with zero gaps hashes like the same bytes laid out
flat, on any number of threads; copy_checksum copies every byte and returns the checksum of what
landed, so a difference anywhere in the source shows."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
import xxhash

from furlong.core.block_checksum import BLOCK_BYTES, COPY_CHUNK_BYTES, copy_checksum, range_checksum

pytestmark = pytest.mark.unit


def _flat_digest(data: bytes) -> str:
    blocks = [data[i : i + BLOCK_BYTES] for i in range(0, len(data), BLOCK_BYTES)]
    return xxhash.xxh3_128(b"".join(xxhash.xxh3_128(b).digest() for b in blocks)).hexdigest()


def _random(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


# Segments that straddle block borders, start and end mid-block, leave gaps (also a gap that spans
# a whole block) and include an empty one.
LAYOUT = [
    (0, 1000),
    (1000, BLOCK_BYTES),
    (BLOCK_BYTES + 5000, 17),
    (BLOCK_BYTES + 6000, 0),
    (3 * BLOCK_BYTES + 1, BLOCK_BYTES // 2 + COPY_CHUNK_BYTES + 3),
]
SIZE = 4 * BLOCK_BYTES + 77


def _segments():
    return [(offset, _random(n, i)) for i, (offset, n) in enumerate(LAYOUT)]


def _flat(segments) -> bytes:
    flat = bytearray(SIZE)
    for offset, data in segments:
        flat[offset : offset + data.numel()] = data.numpy().tobytes()
    return bytes(flat)


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_segments_with_zero_gaps_hash_like_the_flat_range(workers):
    segments = _segments()
    assert range_checksum(SIZE, segments, workers) == _flat_digest(_flat(segments))


def test_empty_and_tiny_ranges():
    assert range_checksum(0, []) == xxhash.xxh3_128(b"").hexdigest()
    assert range_checksum(5, []) == _flat_digest(bytes(5))
    one = torch.tensor([7], dtype=torch.uint8)
    assert range_checksum(3, [(2, one)]) == _flat_digest(b"\0\0\7")


@pytest.mark.parametrize("workers", [1, 3])
def test_copy_checksum_copies_every_byte_and_hashes_what_landed(workers):
    segments = _segments()
    dsts = [torch.full((data.numel(),), 0xAB, dtype=torch.uint8) for _, data in segments]
    copies = [(offset, data, dst) for (offset, data), dst in zip(segments, dsts)]
    digest = copy_checksum(SIZE, copies, workers)
    assert digest == range_checksum(SIZE, segments)
    for (_, data), dst in zip(segments, dsts):
        assert torch.equal(data, dst)
    segments[4][1][BLOCK_BYTES // 4] ^= 1  # one flipped bit in the source ...
    assert copy_checksum(SIZE, copies, workers) != digest  # ... shows in the copy's checksum


def test_bad_segments_are_refused():
    data = torch.zeros(10, dtype=torch.uint8)
    with pytest.raises(ValueError, match="overlaps"):
        range_checksum(100, [(0, data), (5, data)])
    with pytest.raises(ValueError, match="outside"):
        range_checksum(12, [(5, data)])
    with pytest.raises(ValueError, match="1-D uint8"):
        range_checksum(100, [(0, torch.zeros(10))])
    with pytest.raises(ValueError, match="10 bytes into 9"):
        copy_checksum(100, [(0, data, torch.zeros(9, dtype=torch.uint8))])


def test_a_forked_child_hashes_on_threads_of_its_own():
    """The parent's pool has threads; a child made by fork must not wait on them forever."""
    data = _random(3 * BLOCK_BYTES, 9)
    expected = range_checksum(data.numel(), [(0, data)], workers=2)  # the pool now exists
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        got = pool.apply_async(range_checksum, (data.numel(), [(0, data)], 2)).get(timeout=60)
    assert got == expected
