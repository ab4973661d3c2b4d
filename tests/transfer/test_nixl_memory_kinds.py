"""Which memory kind and device id reach NIXL: host tensors register and read as DRAM (device 0),
CUDA tensors as VRAM with their device index, the local side of a READ is described as the memory
its buffer is in, and a VRAM source's descriptors carry its kind and device. The nixl agent object
and CUDA tensors are stand-ins (tests/transfer/nixl_fakes.py); the endpoint's code is real. The
same paths on real NIXL with host memory are tests/weight_broker/test_nixl_blocks.py; with CUDA
memory, tests/gpu."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from nixl_fakes import FakeAgent, FakeCudaBuffer

from furlong.core.weight_versions import WeightSourceInfo
from furlong.transfer import nixl_transport
from furlong.transfer.nixl_transport import NixlEndpoint

pytestmark = pytest.mark.unit

GPU_BASE = 0x7F00_0000_0000


@pytest.fixture
def agent(monkeypatch):
    fake = FakeAgent()
    monkeypatch.setattr(nixl_transport, "_new_agent", lambda name, backends: fake)
    return fake


def vram_source(device_id: int = 2, size: int = 1 << 20) -> WeightSourceInfo:
    return WeightSourceInfo(
        "trainer", b"peer-metadata", GPU_BASE, size, memory_kind="VRAM", device_id=device_id
    )


def test_a_host_tensor_registers_as_dram_on_device_0(agent):
    buffer = torch.zeros(4096, dtype=torch.uint8)
    NixlEndpoint("e").register(buffer)
    [(kind, rows)] = agent.registered
    assert kind == "DRAM"
    assert rows.tolist() == [[buffer.data_ptr(), 4096, 0]]


def test_a_cuda_tensor_registers_as_vram_with_its_device_index(agent):
    endpoint = NixlEndpoint("e")
    endpoint.register([FakeCudaBuffer(GPU_BASE, 8192, index=3)])  # a list: the stand-in is no Tensor
    [(kind, rows)] = agent.registered
    assert kind == "VRAM"
    assert rows.tolist() == [[GPU_BASE, 8192, 3]]


def test_a_mixed_list_is_one_registration_per_memory_kind(agent):
    host = torch.zeros(100, dtype=torch.float32)  # bytes, not elements, are registered
    cuda = [FakeCudaBuffer(GPU_BASE, 64, index=0), FakeCudaBuffer(GPU_BASE + 4096, 32, index=1)]
    NixlEndpoint("e").register([cuda[0], host, cuda[1]])
    by_kind = {kind: rows.tolist() for kind, rows in agent.registered}
    assert by_kind == {
        "VRAM": [[GPU_BASE, 64, 0], [GPU_BASE + 4096, 32, 1]],
        "DRAM": [[host.data_ptr(), 400, 0]],
    }


def test_registration_refuses_what_nixl_cannot_take(agent):
    endpoint = NixlEndpoint("e")
    with pytest.raises(ValueError, match="tensor 1 of the registration is not contiguous"):
        endpoint.register([torch.zeros(8), torch.zeros(4, 4).t()])
    with pytest.raises(ValueError, match="host or CUDA memory, got one on meta"):
        endpoint.register(torch.empty(8, device="meta"))
    agent.mem_types = ("DRAM_SEG",)
    with pytest.raises(ValueError, match=r"cannot register VRAM memory \(they support \['DRAM'\]\)"):
        endpoint.register([FakeCudaBuffer(GPU_BASE, 64)])
    assert agent.registered == []


def test_a_read_into_cuda_memory_describes_both_sides_as_vram(agent):
    endpoint = NixlEndpoint("engine")
    dst = FakeCudaBuffer(0x5500_0000_0000, 1 << 16, index=1)
    endpoint.register([dst])
    endpoint.read(vram_source(device_id=2), dst, 4096, 5.0, src_offset_bytes=8192)
    (local_kind, local), (remote_kind, remote) = agent.xfer_descs
    assert (local_kind, local.tolist()) == ("VRAM", [[dst.address, 4096, 1]])
    assert (remote_kind, remote.tolist()) == ("VRAM", [[GPU_BASE + 8192, 4096, 2]])
    assert agent.posted == 1


def test_a_read_from_vram_into_host_memory_is_local_dram(agent):
    endpoint = NixlEndpoint("engine")
    dst = torch.zeros(1 << 12, dtype=torch.uint8)
    endpoint.register(dst)
    endpoint.read(vram_source(device_id=0), dst, 1 << 12, 5.0)
    (local_kind, local), (remote_kind, remote) = agent.xfer_descs
    assert (local_kind, local.tolist()) == ("DRAM", [[dst.data_ptr(), 1 << 12, 0]])
    assert (remote_kind, remote[:, 2].tolist()) == ("VRAM", [0])


def test_piece_reads_take_each_pieces_device_from_its_buffer(agent):
    endpoint = NixlEndpoint("engine")
    a, b = FakeCudaBuffer(0x1000_0000, 1 << 12, index=1), FakeCudaBuffer(0x2000_0000, 1 << 12, index=1)
    endpoint.register([a, b])
    local = np.array([[a.address + 16, 64, 0], [b.address, 128, 0]], dtype=np.uint64)
    remote = np.array([[GPU_BASE, 64, 2], [GPU_BASE + 64, 128, 2]], dtype=np.uint64)
    endpoint.read_descs(vram_source(), local, remote, 5.0)
    (local_kind, described), _ = agent.xfer_descs
    assert local_kind == "VRAM"
    assert described.tolist() == [[a.address + 16, 64, 1], [b.address, 128, 1]]


def test_a_read_outside_registered_memory_or_across_memory_kinds_is_refused(agent):
    endpoint = NixlEndpoint("engine")
    host = torch.zeros(256, dtype=torch.uint8)
    cuda = FakeCudaBuffer(GPU_BASE, 256)
    endpoint.register([host, cuda])
    source = vram_source()
    outside = np.array([[host.data_ptr() + 200, 100, 0]], dtype=np.uint64)
    with pytest.raises(ValueError, match="lies in no buffer registered here"):
        endpoint.read_descs(source, outside, np.array([[GPU_BASE, 100, 2]], dtype=np.uint64), 5.0)
    both = np.array([[host.data_ptr(), 8, 0], [cuda.address, 8, 0]], dtype=np.uint64)
    remote = np.array([[GPU_BASE, 8, 2], [GPU_BASE + 8, 8, 2]], dtype=np.uint64)
    with pytest.raises(ValueError, match=r"one READ lands in one kind of memory, got \['DRAM', 'VRAM'\]"):
        endpoint.read_descs(source, both, remote, 5.0)
    assert agent.xfer_descs == [] and agent.posted == 0
