"""The WeightBroker gRPC service and its clients: the same behaviour through the gRPC client (real
server on 127.0.0.1) and the in-process twin; proto conversions; configuration."""

from __future__ import annotations

import threading

import pytest
import torch
from polling import wait_until

from furlong.core.errors import ConflictError, NotFoundError
from furlong.core.weight_versions import EventKind, VersionAck, VersionEventInfo, WeightSourceInfo
from furlong.core.weights import Manifest, WeightLayout, combine_checksums, plan_buckets, round_checksums
from furlong.rpc import check_health, start_server
from furlong.transfer.broker_client import GrpcBrokerClient
from furlong.transfer.config import TransferConfig
from furlong.transfer.wire import event_from_proto, event_to_proto, manifest_from_proto, manifest_to_proto
from furlong.v1 import common_pb2
from furlong.v1 import weight_broker_pb2 as pb
from furlong.weight_broker.client import InProcessBrokerClient, make_client
from furlong.weight_broker.config import BrokerConfig
from furlong.weight_broker.core import BrokerCore
from furlong.weight_broker.server import SERVICE_NAME, WeightBrokerServicer

LAYOUT = WeightLayout.from_state_dict(
    {"w": torch.zeros(3, 2, dtype=torch.bfloat16), "b": torch.zeros(5, dtype=torch.int32)}
)
SOURCE = WeightSourceInfo("trainer", b"\x00metadata\xff", 0x7F0000001000, 4096, "DRAM", 0)
RUN = "run-grpc"


def manifest(version: int) -> Manifest:
    return Manifest(version, LAYOUT, f"{version:032x}")


@pytest.fixture(params=["grpc", "in_process"])
def broker(request):
    core = BrokerCore(max_ack_attempts=3)
    if request.param == "in_process":
        client = InProcessBrokerClient(core)
        yield client, core
        client.close()
        return
    servicer = WeightBrokerServicer(core, stream_poll_s=0.1)
    server = start_server([servicer.add_to_server], [SERVICE_NAME])
    client = GrpcBrokerClient(f"127.0.0.1:{server.port}", timeout_s=5.0)
    yield client, core
    client.close()
    core.shutdown()
    server.stop(0.5)


class Collector:
    """Iterates a watch on a thread and records its events."""

    def __init__(self, watch) -> None:
        self.watch = watch
        self.events = []
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        try:
            for event in self.watch:
                self.events.append(event)
        except Exception as exc:  # noqa: BLE001 - recorded for the test to assert on
            self.error = exc

    def kinds(self):
        return [(e.kind, e.version) for e in self.events]


@pytest.mark.integration
def test_errors_arrive_as_domain_exceptions(broker):
    client, _ = broker
    assert client.begin_version(RUN, manifest(2), SOURCE) == []
    with pytest.raises(ConflictError, match="version 2 is not newer than version 2"):
        client.begin_version(RUN, manifest(2), SOURCE)
    with pytest.raises(NotFoundError, match="run other is not known"):
        client.get_version("other")
    with pytest.raises(ValueError, match="4 bytes is smaller than the 84 bytes version 3 stages"):
        client.begin_version(RUN, manifest(3), WeightSourceInfo("t", b"m", 0x1000, 4))
    client.register_engine(RUN, "e1")
    client.begin_version(RUN, manifest(3), SOURCE)
    with pytest.raises(TimeoutError, match=r"version 3 not committed after 0.1 s.*\['e1'\]"):
        client.wait_committed(RUN, 3, 0.1)
    with pytest.raises(ValueError, match="timeout_s -1"):
        client.wait_committed(RUN, 3, -1)
    with pytest.raises(NotFoundError, match="engine e9 is not registered"):
        client.ack_version(VersionAck(RUN, "e9", 3, True))


@pytest.mark.integration
def test_watch_delivers_published_then_committed_with_the_manifest(broker):
    client, _ = broker
    assert client.register_engine(RUN, "e1") == -1
    collector = Collector(client.watch_versions(RUN, "e1"))
    assert client.begin_version(RUN, manifest(1), SOURCE) == ["e1"]
    wait_until(lambda: len(collector.events) == 1)
    published = collector.events[0]
    assert published.kind is EventKind.PUBLISHED and published.run_id == RUN
    assert published.manifest == manifest(1) and published.source == SOURCE

    assert client.ack_version(VersionAck(RUN, "e1", 1, True, transfer_seconds=0.5, transfer_bytes=64)) == 1
    wait_until(lambda: len(collector.events) == 2)
    assert collector.kinds() == [(EventKind.PUBLISHED, 1), (EventKind.COMMITTED, 1)]
    status = client.wait_committed(RUN, 1, 1.0)
    assert (status.latest_version, status.committed_version, status.engine_ids) == (1, 1, ("e1",))

    # close() from another thread ends the blocked iterator, and the engine leaves the run.
    collector.watch.close()
    collector.thread.join(5.0)
    assert not collector.thread.is_alive() and collector.error is None
    wait_until(lambda: client.get_version(RUN).engine_ids == ())


@pytest.mark.integration
def test_unregister_and_end_run_end_streams(broker):
    client, _ = broker
    client.register_engine(RUN, "e1")
    client.register_engine(RUN, "e2")
    c1 = Collector(client.watch_versions(RUN, "e1"))
    c2 = Collector(client.watch_versions(RUN, "e2"))
    client.begin_version(RUN, manifest(1), SOURCE)
    wait_until(lambda: len(c1.events) == 1 and len(c2.events) == 1)
    client.unregister_engine(RUN, "e2")
    c2.thread.join(5.0)
    assert not c2.thread.is_alive() and c2.error is None
    client.ack_version(VersionAck(RUN, "e1", 1, True))
    assert client.wait_committed(RUN, 1, 2.0).committed_version == 1
    client.end_run(RUN)
    c1.thread.join(5.0)
    assert not c1.thread.is_alive() and c1.error is None
    assert c1.kinds() == [(EventKind.PUBLISHED, 1), (EventKind.COMMITTED, 1)]
    with pytest.raises(ConflictError, match="has ended"):
        client.register_engine(RUN, "e1")


@pytest.mark.integration
def test_watching_as_an_unknown_engine_fails(broker):
    client, _ = broker
    client.register_engine(RUN, "e1")
    with pytest.raises(NotFoundError, match="engine ghost is not registered"):
        next(client.watch_versions(RUN, "ghost"))


@pytest.mark.integration
def test_grpc_client_close_cancels_watches_and_health_serves():
    core = BrokerCore()
    servicer = WeightBrokerServicer(core, stream_poll_s=0.1)
    server = start_server([servicer.add_to_server], [SERVICE_NAME])
    address = f"127.0.0.1:{server.port}"
    try:
        assert check_health(address, "furlong.v1.WeightBroker")
        client = GrpcBrokerClient(address)
        client.register_engine(RUN, "e1")
        collector = Collector(client.watch_versions(RUN, "e1"))
        # the server holds the watch (closing earlier cancels a call the server never saw)
        wait_until(lambda: "e1" in core._runs[RUN].subscriptions)
        client.close()
        collector.thread.join(5.0)
        assert not collector.thread.is_alive() and collector.error is None
        wait_until(lambda: core.get_version(RUN).engine_ids == ())
    finally:
        server.stop(0.5)


@pytest.mark.unit
def test_manifest_and_event_conversions_round_trip():
    msg = manifest_to_proto(manifest(7))
    assert msg.checksum_algorithm == "xxh3-128/8MiB-blocks"
    assert [(t.name, t.dtype, list(t.shape)) for t in msg.tensors] == [
        ("w", "bfloat16", [3, 2]),
        ("b", "int32", [5]),
    ]
    assert manifest_from_proto(msg) == manifest(7)
    state = {"w": torch.ones(3, 2, dtype=torch.bfloat16), "b": torch.arange(5, dtype=torch.int32)}
    plan = plan_buckets(LAYOUT, 16)
    digests = round_checksums(LAYOUT, plan, state)
    rounds = Manifest(8, LAYOUT, combine_checksums(digests), plan.with_checksums(digests))
    assert len(rounds.rounds) == 2 and manifest_from_proto(manifest_to_proto(rounds)) == rounds
    split = plan_buckets(LAYOUT, 64, double_buffer=True)
    assert split.double_buffered and split.rounds[1].bucket_offset_bytes > 0
    halves = Manifest(
        9,
        LAYOUT,
        combine_checksums(round_checksums(LAYOUT, split, state)),
        split.with_checksums(round_checksums(LAYOUT, split, state)),
    )
    assert manifest_from_proto(manifest_to_proto(halves)) == halves
    source = WeightSourceInfo(
        "t", b"", 0, 8, shm_name="furlong-x", stream_address="127.0.0.1:1", holds_all_rounds=True
    )
    ready = VersionEventInfo(RUN, EventKind.ROUND_READY, 8, round=1)
    assert event_from_proto(event_to_proto(ready)) == ready
    fenced = VersionEventInfo(RUN, EventKind.FENCED, 8, reason="too slow")
    assert event_from_proto(event_to_proto(fenced)) == fenced
    published = VersionEventInfo(RUN, EventKind.PUBLISHED, 8, rounds, source)
    assert event_from_proto(event_to_proto(published)) == published
    event = event_from_proto(
        event_to_proto(
            event_from_proto(pb.VersionEvent(run_id=RUN, kind=pb.VersionEvent.COMMITTED, version=7))
        )
    )
    assert (event.kind, event.version, event.manifest, event.source) == (EventKind.COMMITTED, 7, None, None)
    with pytest.raises(ValueError, match="checksum_algorithm 'md5'"):
        manifest_from_proto(common_pb2.WeightManifest(version=1, checksum_algorithm="md5"))
    with pytest.raises(ValueError, match="unknown kind 0"):
        event_from_proto(pb.VersionEvent(run_id=RUN, version=1))
    with pytest.raises(ValueError, match="memory_kind 'HBM'"):
        WeightSourceInfo("t", b"m", 0x1000, 8, "HBM")
    with pytest.raises(ValueError, match="no lane"):
        WeightSourceInfo("t", b"", 0, 8)


@pytest.mark.unit
def test_config_validation_and_arguments():
    config = BrokerConfig.from_args(["--port", "5000", "--metrics-port", "5001", "--log-level", "debug"])
    assert (config.host, config.port, config.metrics_port, config.fault_hooks) == (
        "127.0.0.1",
        5000,
        5001,
        False,
    )
    assert config.relay_lanes == ("cuda_ipc", "nixl", "shm", "grpc")
    assert BrokerConfig.from_args(
        ["--port", "1", "--metrics-port", "2", "--relay-lanes", "nixl"]
    ).relay_lanes == ("nixl",)
    with pytest.raises(ValueError, match=r"relay_lanes \('nixl', 'smoke'\)"):
        BrokerConfig(relay_lanes=("nixl", "smoke"))
    with pytest.raises(ValueError, match="port must be a port number in 0..65535, got 70000"):
        BrokerConfig(port=70000)
    with pytest.raises(ValueError, match="max_ack_attempts 0"):
        BrokerConfig(max_ack_attempts=0)
    with pytest.raises(ValueError, match="transfer_timeout_s 0"):
        TransferConfig(transfer_timeout_s=0)
    with pytest.raises(ValueError, match="backends"):
        TransferConfig(backends=())
    with pytest.raises(ValueError, match="lanes \\('nixl', 'carrier-pigeon'\\)"):
        TransferConfig(lanes=("nixl", "carrier-pigeon"))
    with pytest.raises(ValueError, match="bucket_size_bytes 0"):
        TransferConfig(bucket_size_bytes=0)


@pytest.mark.unit
def test_make_client_picks_the_in_process_twin_or_grpc_by_target():
    core = BrokerCore()
    twin = make_client(core)
    assert isinstance(twin, InProcessBrokerClient)
    assert twin.register_engine(RUN, "engine-0") == -1 and core.get_version(RUN).engine_ids == ("engine-0",)
    twin.close()
    remote = make_client("127.0.0.1:1")  # gRPC channels connect lazily
    assert isinstance(remote, GrpcBrokerClient) and remote.address == "127.0.0.1:1"
    remote.close()
    with pytest.raises(TypeError, match="42"):
        make_client(42)
