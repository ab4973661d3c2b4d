"""Block-wise NIXL READs (real NIXL, two agents in one process): each block has landed when its
callback runs, blocks with nothing to read are skipped, a failing callback leaves no READ in flight
(the next read works), a READ outside the source's region is refused, and the NIXL lane's hashed
read returns the checksum of what landed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from furlong.core.block_checksum import BLOCK_BYTES
from furlong.core.weight_versions import WeightSourceInfo
from furlong.core.weights import checksum
from furlong.transfer.host_memory import host_buffer
from furlong.transfer.lanes import NixlLane
from furlong.transfer.nixl_transport import NixlEndpoint

pytestmark = pytest.mark.integration

SIZE = 2 * BLOCK_BYTES + 4096
CHUNK = 1 << 20


@pytest.fixture
def pair():
    source_ep, reader_ep = NixlEndpoint("blocks-source"), NixlEndpoint("blocks-reader")
    src, dst = host_buffer(SIZE), host_buffer(SIZE)
    src.copy_(torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)))
    source_ep.register(src)
    reader_ep.register(dst)
    source = WeightSourceInfo(source_ep.agent_name, source_ep.metadata, src.data_ptr(), SIZE)
    yield reader_ep, source, src, dst
    reader_ep.close()
    source_ep.close()


def _block(src: torch.Tensor, dst: torch.Tensor, offset: int, size: int):
    local = np.array([[dst.data_ptr() + offset, size, 0]], dtype=np.uint64)
    remote = np.array([[src.data_ptr() + offset, size, 0]], dtype=np.uint64)
    return local, remote


def test_each_block_has_landed_when_its_callback_runs(pair):
    endpoint, source, src, dst = pair
    offsets = [0, CHUNK, 2 * CHUNK, 3 * CHUNK]
    blocks = [_block(src, dst, o, CHUNK) for o in offsets]
    blocks[2] = None  # nothing to read there
    seen = []

    def landed(k: int) -> None:
        lo = offsets[k]
        if blocks[k] is not None:
            assert torch.equal(dst[lo : lo + CHUNK], src[lo : lo + CHUNK]), k
        seen.append(k)

    for _ in range(2):  # the second time from cached requests
        dst.zero_()
        assert endpoint.read_blocks(source, blocks, 30.0, landed, "four") > 0
        assert not dst[2 * CHUNK : 3 * CHUNK].any()  # the skipped block was not read
    assert seen == [0, 1, 2, 3] * 2


def test_a_failing_callback_leaves_no_read_in_flight(pair):
    endpoint, source, src, dst = pair
    blocks = [_block(src, dst, o, CHUNK) for o in (0, CHUNK, 2 * CHUNK)]

    def fail(k: int) -> None:
        if k == 1:
            raise RuntimeError("callback failed")

    with pytest.raises(RuntimeError, match="callback failed"):
        endpoint.read_blocks(source, blocks, 30.0, fail, "fail")
    dst.zero_()
    endpoint.read_blocks(source, blocks, 30.0, lambda k: None, "fail")
    assert torch.equal(dst[: 3 * CHUNK], src[: 3 * CHUNK])


def test_a_read_outside_the_source_region_is_refused(pair):
    endpoint, source, src, dst = pair
    local = np.array([[dst.data_ptr(), CHUNK, 0]], dtype=np.uint64)
    remote = np.array([[src.data_ptr() + SIZE - CHUNK // 2, CHUNK, 0]], dtype=np.uint64)
    with pytest.raises(ValueError, match="exceeds the source region"):
        endpoint.read_blocks(source, [(local, remote)], 30.0, lambda k: None, "outside")


def test_the_lane_returns_the_checksum_of_what_landed(pair):
    endpoint, source, src, dst = pair
    lane = NixlLane(endpoint, source)
    # two pieces with a gap between them (zeros in the range), across block borders
    first, second = dst[: BLOCK_BYTES + 100], dst[BLOCK_BYTES + 300 : SIZE]
    pieces = [(0, 0, first), (BLOCK_BYTES + 300, BLOCK_BYTES + 300, second)]
    seconds, digest = lane.read_hashed(SIZE, pieces, 30.0, "pieces")
    assert seconds > 0
    assert torch.equal(first, src[: BLOCK_BYTES + 100])
    assert torch.equal(second, src[BLOCK_BYTES + 300 :])
    expected = src.clone()
    expected[BLOCK_BYTES + 100 : BLOCK_BYTES + 300] = 0
    assert digest == checksum(expected, SIZE)
    src[5] ^= 1  # the source changed: so does the checksum
    assert lane.read_hashed(SIZE, pieces, 30.0, "pieces")[1] != digest
