"""Sources whose bucket is GPU memory (memory_kind VRAM): validation and the wire round trip, which
lanes reach them (nixl; shm and grpc read host memory and are skipped with that reason), which
lanes a CUDA bucket is offered on, and the device settings. CPU only: nothing here allocates CUDA
memory (tests/gpu does)."""

from __future__ import annotations

import logging

import pytest
import torch

from furlong.core.errors import UnavailableError
from furlong.core.weight_versions import WeightSourceInfo
from furlong.transfer.bucket import StagingBucket, offered_lanes
from furlong.transfer.config import TransferConfig
from furlong.transfer.destination import receive_buffer
from furlong.transfer.lanes import ShmLane, connect_lane
from furlong.transfer.wire import source_from_proto, source_to_proto

pytestmark = pytest.mark.unit


def vram(**fields: object) -> WeightSourceInfo:
    base: dict[str, object] = dict(
        agent_name="trainer",
        agent_metadata=b"md",
        base_address=0x7F00_0000_0000,
        size_bytes=1 << 20,
        memory_kind="VRAM",
        device_id=3,
    )
    base.update(fields)
    return WeightSourceInfo(**base)  # type: ignore[arg-type]


def test_a_vram_source_round_trips_the_wire():
    source = vram(shm_name="furlong-x-0123456789ab", stream_address="127.0.0.1:1")
    assert source_from_proto(source_to_proto(source)) == source
    assert source_to_proto(source).memory_kind == "VRAM" and source_to_proto(source).device_id == 3


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"memory_kind": "HBM"}, "memory_kind 'HBM' not one of"),
        ({"device_id": -1}, "device_id -1 < 0"),
        ({"base_address": 0}, "base_address 0 is not a valid address"),
    ],
)
def test_bad_vram_sources_are_refused_naming_the_value(fields, message):
    with pytest.raises(ValueError, match=message):
        vram(**fields)


def test_shm_and_grpc_are_skipped_for_a_vram_source_with_the_reason(caplog):
    source = vram(agent_metadata=b"", base_address=0, shm_name="furlong-x-0123456789ab", stream_address="h:1")
    with pytest.raises(UnavailableError) as err:
        connect_lane(source, ("shm", "grpc"), None, 1 << 20)
    text = str(err.value)
    assert "no lane reaches source trainer" in text
    assert "shm: the bucket of trainer is VRAM memory (device 3); the shm lane reads host memory" in text
    assert "grpc: the bucket of trainer is VRAM memory (device 3); the grpc lane reads host memory" in text


def test_a_host_source_still_goes_over_shm(caplog):
    bucket = StagingBucket("host-bucket", 4096, ("shm",))
    try:
        assert bucket.source.memory_kind == "DRAM" and bucket.source.device_id == 0
        with caplog.at_level(logging.INFO, logger="furlong.transfer.lanes"):
            lane = connect_lane(bucket.source, ("nixl", "shm"), None, 1 << 20)
        assert isinstance(lane, ShmLane)
        assert "using lane shm because nixl: no NIXL agent on this side" in caplog.text
        lane.close()
    finally:
        bucket.close()


def test_a_cuda_bucket_is_offered_over_nixl_only(caplog):
    with caplog.at_level(logging.INFO, logger="furlong.transfer.bucket"):
        assert offered_lanes("b", ("nixl", "shm", "grpc"), "cuda:1") == ("nixl",)
    assert "lanes ['shm', 'grpc'] are not offered: they read host memory and the bucket is on cuda:1" in (
        caplog.text
    )
    assert offered_lanes("b", ("shm", "grpc"), "cpu") == ("shm", "grpc")
    with pytest.raises(ValueError, match=r"lanes \['shm', 'grpc'\] cannot serve a bucket on cuda"):
        offered_lanes("b", ("shm", "grpc"), "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is absent")
def test_cuda_memory_where_there_is_no_cuda_is_refused_naming_the_device():
    with pytest.raises(ValueError, match="device 'cuda:0': CUDA is not available in this process"):
        StagingBucket("b", 4096, ("nixl",), device="cuda:0")
    with pytest.raises(ValueError, match="device 'cuda': CUDA is not available"):
        receive_buffer(4096, "cuda")


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "CPU", ""])
def test_device_settings_are_checked(device):
    with pytest.raises(ValueError, match=f"device {device!r} is not 'cpu', 'cuda' or 'cuda:N'"):
        TransferConfig(device=device)
    with pytest.raises(ValueError, match="bucket device"):
        StagingBucket("b", 4096, ("shm",), device=device)
