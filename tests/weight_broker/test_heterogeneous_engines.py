"""Engines with different shard layouts of the same model take the same versions: one holds the
published tensors whole, another a tensor-parallel rank with fused qkv/gate_up. Each receives
exactly its bytes (pieces pulled straight to their place), verified against the digests the trainer
computed for its layout; the equality check passes for both layouts and fails for a wrong slice."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from llama_state import assert_bytes_equal, llama
from polling import wait_until

from furlong.core.weight_shards import ShardLayout, expected_shards, llama_tensor_parallel, plan_shards
from furlong.core.weight_versions import EventKind, VersionAck, WeightSourceInfo
from furlong.core.weights import Manifest, WeightLayout, combine_checksums, plan_buckets, round_checksums
from furlong.rpc import check_health
from furlong.rpc.ports import free_port
from furlong.transfer.broker_client import GrpcBrokerClient
from furlong.transfer.config import TransferConfig
from furlong.transfer.equality import check_weight_update_equal
from furlong.transfer.publisher import WeightPublisher
from furlong.transfer.receiver import WeightReceiver
from furlong.weight_broker.client import InProcessBrokerClient, make_client
from furlong.weight_broker.core import BrokerCore
from furlong.weight_broker.equality import main

CHILD = Path(__file__).with_name("receiver_process.py")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "addition" / "checkpoint"
RUN = "run-hetero"
BUCKET = 2048  # several rounds


@pytest.mark.integration
@pytest.mark.slow
def test_two_shard_layouts_in_two_engine_processes_over_nixl(tmp_path):
    layout = WeightLayout.from_state_dict(llama(0))
    tp1 = llama_tensor_parallel(layout, 1, 2, fuse=True)
    (tmp_path / "tp1.json").write_text(tp1.to_json())
    port, metrics_port = free_port(), free_port()
    broker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "furlong.weight_broker",
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
        ],
        stdout=open(tmp_path / "broker.log", "w"),
        stderr=subprocess.STDOUT,
    )
    address = f"127.0.0.1:{port}"
    engines = {"engine-full": [], "engine-tp1": ["--shard-layout", str(tmp_path / "tp1.json")]}
    children = []
    client = publisher = None
    try:
        wait_until(lambda: check_health(address, "furlong.v1.WeightBroker"), 60.0, "the broker")
        children = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(CHILD),
                    "--broker",
                    address,
                    "--run-id",
                    RUN,
                    "--engine-id",
                    e,
                    "--out",
                    str(tmp_path),
                    "--lanes",
                    "nixl",
                    *extra,
                ],
                stdout=open(tmp_path / f"{e}.log", "w"),
                stderr=subprocess.STDOUT,
            )
            for e, extra in engines.items()
        ]
        client = GrpcBrokerClient(address)
        wait_until(lambda: _engines(client) == tuple(sorted(engines)), 60.0, "both engines")
        assert [x.layout_id for x in client.destinations(RUN)] == [tp1.layout_id]
        publisher = WeightPublisher(
            client,
            RUN,
            layout,
            "trainer-hetero",
            config=TransferConfig(bucket_size_bytes=BUCKET, lanes=("nixl",)),
        )
        for version in (1, 2):
            result = publisher.publish(version, llama(version))
            assert result.num_rounds > 3
            assert client.wait_committed(RUN, version, 60.0).pending_engine_ids == ()
            assert_bytes_equal(torch.load(tmp_path / f"engine-full-v{version}.pt"), llama(version))
            assert_bytes_equal(
                torch.load(tmp_path / f"engine-tp1-v{version}.pt"), expected_shards(tp1, llama(version))
            )
        # Each engine moved exactly its bytes: the whole layout, and its pieces only.
        shard_bytes = plan_shards(layout, plan_buckets(layout, BUCKET), tp1).total_bytes
        assert shard_bytes == sum(
            t.numel() * t.element_size() for t in expected_shards(tp1, llama(0)).values()
        )
        assert shard_bytes < layout.total_bytes * 0.6
        metrics = (
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        )
        moved = next(
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith('furlong_broker_transfer_bytes_total{lane="nixl"}')
        )
        assert moved == 2 * (layout.total_bytes + shard_bytes)
    finally:
        for child in children:
            child.terminate()
        for child in children:
            child.wait(30)
        if publisher is not None:
            publisher.close()
        if client is not None:
            client.close()
        broker.terminate()
        broker.wait(30)


def _engines(client: GrpcBrokerClient) -> tuple[str, ...]:
    try:
        return client.get_version(RUN).engine_ids
    except Exception:  # noqa: BLE001 - the run does not exist until the first engine registers
        return ()


@pytest.mark.integration
@pytest.mark.parametrize("lane", ["nixl", "shm", "grpc"])
def test_pieces_land_straight_in_the_engine_parameters(lane):
    layout = WeightLayout.from_state_dict(llama(0))
    tp0 = llama_tensor_parallel(layout, 0, 2)
    params = {n: torch.zeros_like(t) for n, t in expected_shards(tp0, llama(0)).items()}
    storage = {n: t.data_ptr() for n, t in params.items()}
    events: list[tuple[str, int]] = []
    config = TransferConfig(bucket_size_bytes=BUCKET, lanes=(lane,))
    client = InProcessBrokerClient(BrokerCore())
    receiver = WeightReceiver(
        client,
        RUN,
        "engine-tp0",
        lambda v, t: events.append(("apply", v)),
        config=config,
        shard_layout=tp0,
        params=params,
        prepare=lambda v: events.append(("prepare", v)),
    )
    publisher = WeightPublisher(client, RUN, layout, f"trainer-{lane}", config=config)
    try:
        receiver.start()
        for version in (1, 2):
            publisher.publish(version, llama(version))
            client.wait_committed(RUN, version, 30.0)
            assert_bytes_equal(params, expected_shards(tp0, llama(version)))
        assert events == [("prepare", 1), ("apply", 1), ("prepare", 2), ("apply", 2)]
        assert {n: t.data_ptr() for n, t in params.items()} == storage  # in place
    finally:
        publisher.close()
        receiver.close()
        client.close()


@pytest.mark.integration
def test_a_receive_buffer_engine_is_told_before_the_next_version_overwrites_what_apply_got():
    """Without params, apply gets views of the receive buffer; prepare(v + 1) comes before the
    first byte of version v + 1 lands in it, while the views still hold version v."""
    layout = WeightLayout.from_state_dict(llama(0))
    config = TransferConfig(bucket_size_bytes=BUCKET, lanes=("shm",))
    client = InProcessBrokerClient(BrokerCore())
    held: dict[str, torch.Tensor] = {}
    events: list[tuple[str, int, bool]] = []

    def apply(version: int, tensors) -> None:
        held.clear()
        held.update(tensors)
        events.append(("apply", version, _equal(held, llama(version))))

    def prepare(version: int) -> None:  # the views still hold the previous version, whole
        events.append(("prepare", version, not held or _equal(held, llama(version - 1))))

    receiver = WeightReceiver(client, RUN, "engine-buffer", apply, config=config, prepare=prepare)
    publisher = WeightPublisher(client, RUN, layout, "trainer-buffer", config=config)
    try:
        receiver.start()
        for version in (1, 2, 3):
            publisher.publish(version, llama(version))
            client.wait_committed(RUN, version, 30.0)
        assert events == [(kind, v, True) for v in (1, 2, 3) for kind in ("prepare", "apply")]
    finally:
        publisher.close()
        receiver.close()
        client.close()


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.unit
def test_an_engine_whose_layout_the_version_does_not_cover_waits_for_the_next_one():
    core = BrokerCore()
    source = WeightSourceInfo("t", b"", 0, 1 << 20, shm_name="x")
    state = {"w": torch.zeros(4, 4)}
    layout = WeightLayout.from_state_dict(state)
    shards = ShardLayout((llama_tensor_parallel(layout, 0, 1).tensors[0],))
    core.register_engine(RUN, "plain")
    core.register_engine(RUN, "sharded", shards)
    sub = core.subscribe(RUN, "sharded")
    assert core.destinations(RUN) == [shards]
    plan = plan_buckets(layout, 1 << 20)
    digests = round_checksums(layout, plan, state)
    bare = Manifest(1, layout, combine_checksums(digests), plan.with_checksums(digests))
    assert core.begin_version(RUN, bare, source) == ["plain"]
    assert sub.get(0.05) is None  # not told about a version it cannot verify
    covered = Manifest(2, layout, bare.checksum, bare.plan, destinations=((shards.layout_id, digests),))
    core.ack_version(VersionAck(RUN, "plain", 1, True))
    assert core.begin_version(RUN, covered, source) == ["plain", "sharded"]
    assert sub.get(1.0).kind is EventKind.COMMITTED  # version 1, for everyone
    event = sub.get(1.0)
    assert (event.kind, event.version) == (EventKind.PUBLISHED, 2)


@pytest.mark.integration
@pytest.mark.parametrize(
    "argv",
    [["--tp-size", "2", "--tp-rank", "1", "--fuse"], ["--tp-size", "2", "--tp-rank", "0", "--lanes", "shm"]],
)
def test_the_equality_check_passes_for_tensor_parallel_layouts_of_the_example(argv, capsys):
    assert main(["--model-dir", str(EXAMPLE), *argv]) == 0
    assert "mismatched: [], unexpected: []" in capsys.readouterr().out


@pytest.mark.integration
def test_the_equality_check_fails_naming_every_tensor_of_a_wrong_slice():
    source = llama(3)
    layout = WeightLayout.from_state_dict(source)
    rank0, rank1 = (llama_tensor_parallel(layout, r, 2, fuse=True) for r in (0, 1))
    engine = expected_shards(rank0, source)  # holds rank 0 but declares rank 1
    grpc_lane = TransferConfig(lanes=("grpc",), bucket_size_bytes=BUCKET)
    with contextlib.closing(make_client(BrokerCore())) as broker:
        report = check_weight_update_equal(source, engine, broker, shard_layout=rank1, config=grpc_lane)
    p = "model.layers.0."
    assert set(report.mismatched) == {
        p + "self_attn.qkv_proj.weight",
        p + "self_attn.o_proj.weight",
        p + "mlp.gate_up_proj.weight",
        p + "mlp.down_proj.weight",
    }
    shm_lane = TransferConfig(lanes=("shm",), bucket_size_bytes=BUCKET)
    with contextlib.closing(make_client(BrokerCore())) as broker:
        good = check_weight_update_equal(
            source, expected_shards(rank1, source), broker, shard_layout=rank1, config=shm_lane
        )
    assert good.ok and good.num_parameters == len(rank1.tensors)
