"""Publisher and receivers in one process with the in-process broker: versions staged in rounds
through a small bucket reach engines on each lane (NIXL, shared memory, gRPC stream) bit for bit,
the lane shows in the metrics, corruption in transit is re-pulled, and engines that keep failing or
never answer are fenced while the version commits for the others."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from furlong.core.weights import WeightLayout, plan_buckets
from furlong.transfer.config import TransferConfig
from furlong.transfer.lanes import NixlLane, ShmLane, connect_lane
from furlong.transfer.publisher import WeightPublisher
from furlong.transfer.receiver import WeightReceiver
from furlong.weight_broker.client import InProcessBrokerClient
from furlong.weight_broker.core import BrokerCore
from furlong.weight_broker.metrics import BrokerMetrics

pytestmark = pytest.mark.integration

RUN = "run-lanes"
BUCKET = TransferConfig(bucket_size_bytes=1024, round_timeout_s=10.0)


def policy(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(32, 8, generator=gen),  # 1024 bytes
        "mlp": torch.randn(24, 16, generator=gen).to(torch.bfloat16),  # 768 bytes
        "norm": torch.randn(16, generator=gen),
        "scale": torch.randn(8, generator=gen).to(torch.float8_e4m3fn),
        "head": torch.randn(40, 8, generator=gen),  # 1280: grows the bucket
    }


class Engine:
    def __init__(self) -> None:
        self.applied: dict[int, dict[str, torch.Tensor]] = {}

    def apply(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        self.applied[version] = {name: t.clone() for name, t in tensors.items()}

    def assert_has(self, version: int, expected: dict[str, torch.Tensor]) -> None:
        got = self.applied[version]
        assert list(got) == list(expected)
        for name, tensor in expected.items():
            assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


class FlakyLane:
    """Wraps a real lane and flips one byte of the first `corrupt` reads, as a bad link would."""

    def __init__(self, lane, corrupt: int) -> None:
        self._lane = lane
        self.name = lane.name
        self.corrupt = corrupt
        self.reads = 0

    def read(self, src_offset_bytes: int, dst: torch.Tensor, timeout_s: float) -> float:
        seconds = self._lane.read(src_offset_bytes, dst, timeout_s)
        self.reads += 1
        if self.reads <= self.corrupt:
            dst[dst.numel() // 2] ^= 0x40
        return seconds

    def close(self) -> None:
        self._lane.close()


@pytest.fixture
def local():
    registry = CollectorRegistry()
    core = BrokerCore(max_ack_attempts=2, observer=BrokerMetrics(registry))
    client = InProcessBrokerClient(core)
    opened = []

    def open_(kind, *args, **kwargs):
        obj = kind(client, RUN, *args, **kwargs)
        opened.append(obj)
        return obj

    yield client, open_, registry
    for obj in reversed(opened):
        obj.close()
    client.close()


def test_rounds_reach_engines_on_every_lane_bit_for_bit(local):
    client, open_, registry = local
    engines = {lane: Engine() for lane in ("nixl", "shm", "grpc")}
    for lane, engine in engines.items():
        open_(WeightReceiver, f"e-{lane}", engine.apply, config=TransferConfig(lanes=(lane,))).start()
    publisher = open_(
        WeightPublisher, WeightLayout.from_state_dict(policy(0)), "trainer-lanes", config=BUCKET
    )
    assert publisher.bucket_size_bytes == 1280  # grown once to the largest tensor
    for version in (1, 2):
        result = publisher.publish(version, policy(version))
        assert result.num_rounds == 3 and result.fenced_engine_ids == ()
        assert client.wait_committed(RUN, version, 20.0).committed_version == version
    for engine in engines.values():
        engine.assert_has(1, policy(1))
        engine.assert_has(2, policy(2))
    total = sum(r.size_bytes for r in plan_buckets(publisher.layout, 1024).rounds)  # no padding
    assert total == publisher.layout.total_bytes - 56
    for lane in engines:
        sample = registry.get_sample_value("furlong_broker_transfer_bytes_total", {"lane": lane})
        assert sample == 2 * total, lane


def test_a_corrupted_byte_in_transit_is_detected_and_re_pulled(local):
    client, open_, _ = local
    flaky: list[FlakyLane] = []

    def connect(source):
        flaky.append(FlakyLane(connect_lane(source, ("shm",), None, 1 << 20), corrupt=1))
        return flaky[-1]

    _one_version_arrives(client, open_, "shm", connect)
    assert flaky[0].reads == 3 + 1  # three rounds, the corrupted one pulled twice


def _one_version_arrives(
    client, open_, lane: str, connect, params=None, receivers: list | None = None
) -> None:
    """An engine pulling over `lane` (through `connect`; the receiver is appended to receivers
    before it starts) takes version 1 bit for bit."""
    engine = Engine()
    receiver = open_(
        WeightReceiver,
        "e1",
        engine.apply,
        config=TransferConfig(lanes=(lane,)),
        connect=connect,
        params=params,
    )
    if receivers is not None:
        receivers.append(receiver)
    receiver.start()
    publisher = open_(WeightPublisher, WeightLayout.from_state_dict(policy(0)), "trainer-lane", config=BUCKET)
    publisher.publish(1, policy(1))
    assert client.wait_committed(RUN, 1, 20.0).committed_version == 1
    engine.assert_has(1, policy(1))


class Torn:
    """A lane that hashes while it pulls, with one byte of the publisher's bucket flipped while
    its first `corrupt` pulls read it (and put back after): what landed is wrong. The publisher
    runs in this process, so the bucket is at the source's address here."""

    corrupt = 0
    reads = 0

    def read_hashed(self, size_bytes, pieces, timeout_s, cache_key=None):
        self.reads += 1
        torn = self.reads <= self.corrupt
        cell = ctypes.c_uint8.from_address(self.torn_source.base_address + pieces[0][1])
        if torn:
            cell.value ^= 0x40
        try:
            return super().read_hashed(size_bytes, pieces, timeout_s, cache_key)
        finally:
            if torn:
                cell.value ^= 0x40


class TornShmLane(Torn, ShmLane):
    pass


class TornNixlLane(Torn, NixlLane):
    pass


@pytest.mark.parametrize("lane", ["shm", "nixl"])
@pytest.mark.parametrize("into", ["buffer", "params"])
def test_a_lane_hashes_what_it_pulls_and_a_torn_pull_is_re_pulled(local, lane, into):
    client, open_, _ = local
    lanes: list[Torn] = []
    receivers: list[WeightReceiver] = []  # the lane is connected once the receiver exists

    def connect(source):
        torn = TornShmLane(source) if lane == "shm" else TornNixlLane(receivers[0]._endpoint, source)
        torn.torn_source, torn.corrupt = source, 1
        lanes.append(torn)
        return torn

    params = {n: torch.zeros_like(t) for n, t in policy(0).items()} if into == "params" else None
    _one_version_arrives(client, open_, lane, connect, params, receivers)
    assert lanes[0].reads == 3 + 1  # three rounds, the torn one pulled twice


def test_an_engine_that_keeps_failing_is_fenced_and_the_others_commit(local):
    client, open_, registry = local
    good, bad = Engine(), Engine()
    open_(WeightReceiver, "good", good.apply).start()
    open_(
        WeightReceiver,
        "bad",
        bad.apply,
        config=TransferConfig(lanes=("shm",)),
        connect=lambda s: FlakyLane(connect_lane(s, ("shm",), None, 1 << 20), corrupt=10**6),
    ).start()
    publisher = open_(
        WeightPublisher, WeightLayout.from_state_dict(policy(0)), "trainer-fence", config=BUCKET
    )
    result = publisher.publish(1, policy(1))
    assert result.fenced_engine_ids == ("bad",)
    status = client.wait_committed(RUN, 1, 20.0)
    assert status.committed_version == 1 and status.fenced_engine_ids == ("bad",)
    good.assert_has(1, policy(1))
    assert 1 not in bad.applied  # never served a version it could not verify
    assert registry.get_sample_value("furlong_broker_engines_fenced_total", {"run_id": RUN}) == 1


def test_an_engine_that_never_answers_times_out_is_fenced_and_the_run_continues(local):
    client, open_, _ = local
    good = Engine()
    open_(WeightReceiver, "good", good.apply).start()
    client.register_engine(RUN, "mute")
    watch = client.watch_versions(RUN, "mute")  # subscribed, never reads, never acknowledges
    publisher = open_(
        WeightPublisher,
        WeightLayout.from_state_dict(policy(0)),
        "trainer-mute",
        config=TransferConfig(bucket_size_bytes=1024, round_timeout_s=0.5),
    )
    started = time.monotonic()
    result = publisher.publish(1, policy(1))
    assert result.fenced_engine_ids == ("mute",)
    assert time.monotonic() - started < 10.0
    assert client.wait_committed(RUN, 1, 20.0).committed_version == 1
    good.assert_has(1, policy(1))
    publisher.publish(2, policy(2))  # the run goes on without it
    assert client.wait_committed(RUN, 2, 20.0).committed_version == 2
    good.assert_has(2, policy(2))
    watch.close()


def test_the_stream_server_answers_while_the_publisher_waits_on_the_broker(local):
    client, open_, _ = local
    engines = [Engine() for _ in range(3)]
    for i, engine in enumerate(engines):
        open_(WeightReceiver, f"g{i}", engine.apply, config=TransferConfig(lanes=("grpc",))).start()
    publisher = open_(
        WeightPublisher,
        WeightLayout.from_state_dict(policy(0)),
        "trainer-stream",
        config=TransferConfig(bucket_size_bytes=1024, stream_workers=3),
    )
    done = threading.Event()
    threading.Thread(target=lambda: (publisher.publish(1, policy(1)), done.set()), daemon=True).start()
    assert done.wait(20.0)
    assert client.wait_committed(RUN, 1, 20.0).committed_version == 1
    for engine in engines:
        engine.assert_has(1, policy(1))


@pytest.mark.unit
def test_host_buffers_are_zeroed_2mib_aligned_and_on_huge_pages_where_the_kernel_allows():
    from furlong.transfer.host_memory import HUGE_PAGE_BYTES, host_buffer

    buffer = host_buffer(3 * HUGE_PAGE_BYTES + 5)
    assert buffer.numel() == 3 * HUGE_PAGE_BYTES + 5 and buffer.is_contiguous()
    assert buffer.data_ptr() % HUGE_PAGE_BYTES == 0 and int(buffer.count_nonzero()) == 0
    buffer.fill_(7)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        rollup = Path("/proc/self/smaps_rollup").read_text()
        huge_kb = int(rollup.split("AnonHugePages:")[1].split()[0])
        assert huge_kb >= 2 * HUGE_PAGE_BYTES // 1024
    with pytest.raises(ValueError, match="size_bytes 0"):
        host_buffer(0)


def test_double_buffered_rounds_reach_engines_on_every_lane_bit_for_bit(local):
    """The bucket split in two halves: round i + 1 is staged while engines pull round i, into
    their parameters or into a receive buffer, on every lane; a third version overwrites both."""
    client, open_, registry = local

    def small(seed: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {
            f"layer{i}": torch.randn(8 + i, 16, generator=gen).to(torch.bfloat16 if i % 2 else torch.float32)
            for i in range(7)
        }

    engines, params = {}, {}
    for lane in ("nixl", "shm", "grpc"):
        engines[lane] = Engine()
        open_(WeightReceiver, f"e-{lane}", engines[lane].apply, config=TransferConfig(lanes=(lane,))).start()
        params[lane] = {name: torch.zeros_like(t) for name, t in small(0).items()}
        open_(
            WeightReceiver,
            f"p-{lane}",
            lambda v, t: None,
            config=TransferConfig(lanes=(lane,)),
            params=params[lane],
        ).start()
    publisher = open_(
        WeightPublisher,
        WeightLayout.from_state_dict(small(0)),
        "trainer-halves",
        config=TransferConfig(bucket_size_bytes=2048, round_timeout_s=10.0, double_buffer=True),
    )
    plan = plan_buckets(publisher.layout, 2048, double_buffer=True)
    assert plan.double_buffered and len(plan.rounds) >= 4
    assert publisher.bucket_size_bytes == plan.bucket_size_bytes <= 2048
    for version in (1, 2, 3):
        result = publisher.publish(version, small(version))
        assert result.num_rounds == len(plan.rounds) and result.fenced_engine_ids == ()
        assert client.wait_committed(RUN, version, 20.0).committed_version == version
        for lane in engines:
            engines[lane].assert_has(version, small(version))
            for name, tensor in small(version).items():
                assert torch.equal(params[lane][name].view(torch.uint8), tensor.view(torch.uint8)), (
                    lane,
                    name,
                )
