"""The cuda_ipc lane on CPU: the share record (validation, the wire round trip, only with a VRAM
source), which buckets offer it (CUDA ones only), and when `connect_lane` chooses it (a share
from this host that opens) or skips it with its reason (no share, another host, no CUDA here, a
GPU this process does not see, a handle torch refuses). Opening a real share and copying from it
needs two processes on one GPU: tests/gpu."""

from __future__ import annotations

import logging

import pytest
import torch

from furlong.core.cuda_ipc_share import CudaIpcShare
from furlong.core.errors import UnavailableError
from furlong.core.weight_versions import LANE_NAMES, RoundAck, WeightSourceInfo
from furlong.transfer import cuda_ipc
from furlong.transfer.bucket import StagingBucket, offered_lanes
from furlong.transfer.config import TransferConfig
from furlong.transfer.lanes import CudaIpcLane, GrpcStreamLane, connect_lane
from furlong.transfer.wire import source_from_proto, source_to_proto

pytestmark = pytest.mark.unit

GPU = "GPU-5a1c0de0-0000-4000-8000-000000000001"


def share(**fields: object) -> CudaIpcShare:
    base: dict[str, object] = dict(
        host_id=cuda_ipc.host_id(),
        device_uuid=GPU,
        handle=bytes(range(64)),
        storage_size_bytes=1 << 21,
        storage_offset_bytes=512,
        offset_bytes=4096,
        ref_counter_handle=b"/torch_1234_5678_0",
        ref_counter_offset=3,
        event_handle=bytes(64),
        event_sync_required=True,
    )
    base.update(fields)
    return CudaIpcShare(**base)  # type: ignore[arg-type]


def source(cuda_share: CudaIpcShare | None, **fields: object) -> WeightSourceInfo:
    base: dict[str, object] = dict(
        agent_name="trainer",
        agent_metadata=b"",
        base_address=0,
        size_bytes=1 << 20,
        memory_kind="VRAM",
        device_id=0,
        cuda_ipc=cuda_share,
    )
    base.update(fields)
    return WeightSourceInfo(**base)  # type: ignore[arg-type]


def test_the_lane_is_known_and_preferred_first():
    assert LANE_NAMES[0] == "cuda_ipc" and set(LANE_NAMES) == {"cuda_ipc", "nixl", "shm", "grpc"}
    assert TransferConfig().lanes == LANE_NAMES
    assert RoundAck("r", "e", 1, 0, True, lane="cuda_ipc").lane == "cuda_ipc"


def test_a_share_round_trips_the_wire():
    src = source(share())
    back = source_from_proto(source_to_proto(src))
    assert back == src and back.cuda_ipc == share()
    assert source_from_proto(source_to_proto(source(None, stream_address="h:1"))).cuda_ipc is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"handle": b""}, "CUDA IPC share with an empty handle"),
        ({"host_id": ""}, "CUDA IPC share with an empty host_id"),
        ({"device_uuid": ""}, "CUDA IPC share with an empty device_uuid"),
        ({"storage_size_bytes": 0}, "storage_size_bytes 0 <= 0"),
        ({"offset_bytes": -1}, "offset_bytes -1 < 0"),
    ],
)
def test_bad_shares_are_refused_naming_the_value(fields, message):
    with pytest.raises(ValueError, match=message):
        share(**fields)


def test_a_share_must_be_of_a_vram_bucket_that_it_holds():
    with pytest.raises(ValueError, match="a CUDA IPC share of a 'DRAM' bucket"):
        source(share(), memory_kind="DRAM")
    with pytest.raises(ValueError, match=r"1048576 bytes at offset 2093056 exceed the 2097152-byte"):
        source(share(offset_bytes=(1 << 21) - 4096))
    assert source(share(), agent_metadata=b"", shm_name="", stream_address="").cuda_ipc is not None


def test_a_host_tensor_cannot_be_shared():
    with pytest.raises(ValueError, match=r"needs a 1-D uint8 CUDA tensor, got torch.uint8 \(16,\) on cpu"):
        cuda_ipc.export_share(torch.zeros(16, dtype=torch.uint8))


def test_a_host_bucket_is_not_offered_over_cuda_ipc(caplog):
    with caplog.at_level(logging.INFO, logger="furlong.transfer.bucket"):
        assert offered_lanes("b", LANE_NAMES, "cpu") == ("nixl", "shm", "grpc")
        assert offered_lanes("b", LANE_NAMES, "cuda:0") == ("cuda_ipc", "nixl")
    assert "lanes ['cuda_ipc'] are not offered: it shares CUDA memory and the bucket is on cpu" in caplog.text
    with pytest.raises(ValueError, match=r"lanes \['cuda_ipc'\] cannot serve a bucket on cpu"):
        offered_lanes("b", ("cuda_ipc",), "cpu")
    bucket = StagingBucket("host", 4096, ("cuda_ipc", "grpc"))
    try:
        assert bucket.source.cuda_ipc is None and bucket.source.stream_address
    finally:
        bucket.close()


def test_a_host_source_skips_cuda_ipc_quietly(caplog):
    bucket = StagingBucket("host", 4096, ("grpc",))
    try:
        with caplog.at_level(logging.INFO, logger="furlong.transfer.lanes"):
            lane = connect_lane(bucket.source, LANE_NAMES, None, 1 << 20)
        assert isinstance(lane, GrpcStreamLane)
        lane.close()
    finally:
        bucket.close()
    [record] = [r for r in caplog.records if "using lane" in r.getMessage()]
    assert "cuda_ipc: source host offers no CUDA IPC share (its bucket is DRAM memory)" in record.getMessage()
    # nixl failed because this side has no agent: a real failure, so a warning
    assert record.levelno == logging.WARNING
    with caplog.at_level(logging.INFO, logger="furlong.transfer.lanes"):
        caplog.clear()
        bucket = StagingBucket("host2", 4096, ("grpc",))
        try:
            connect_lane(bucket.source, ("cuda_ipc", "grpc"), None, 1 << 20).close()
        finally:
            bucket.close()
    [record] = [r for r in caplog.records if "using lane" in r.getMessage()]
    assert record.levelno == logging.INFO  # only lanes the source does not offer were skipped


def test_a_share_from_another_host_is_skipped_naming_both_hosts():
    other = share(host_id="another-boot-id")
    with pytest.raises(UnavailableError) as err:
        connect_lane(source(other, stream_address=""), ("cuda_ipc",), None, 1 << 20)
    assert (
        f"cuda_ipc: the CUDA IPC share of trainer is from host another-boot-id, this is host "
        f"{cuda_ipc.host_id()}: CUDA IPC works between processes of one host"
    ) in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is absent")
def test_a_share_where_there_is_no_cuda_is_skipped_with_the_reason():
    with pytest.raises(UnavailableError, match="the CUDA IPC share of trainer: CUDA is not available"):
        CudaIpcLane(source(share()))


def test_a_share_on_a_gpu_this_process_does_not_see_is_skipped(monkeypatch):
    # stand-ins for the CUDA runtime's answers (this machine has no GPU)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cuda_ipc, "device_uuid", lambda i: f"GPU-local-{i}")
    with pytest.raises(
        UnavailableError, match=rf"is on GPU {GPU}, which this process does not see \(it sees"
    ):
        CudaIpcLane(source(share()))


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch must refuse the open")
def test_a_share_torch_cannot_open_is_skipped_naming_its_handle(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cuda_ipc, "device_uuid", lambda i: GPU)
    with pytest.raises(
        UnavailableError,
        match=rf"handle 0001020304050607\.\.\., 2097152 bytes on GPU {GPU}\) cannot be opened",
    ):
        CudaIpcLane(source(share()))
