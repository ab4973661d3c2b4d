"""The whole weight path as separate processes: `python -m furlong.weight_broker`, a WeightPublisher
in this process and two WeightReceivers in child processes, bytes moving over NIXL (UCX)."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from polling import wait_until

from furlong.core.errors import ConflictError
from furlong.core.weights import Manifest, WeightLayout
from furlong.rpc import check_health
from furlong.rpc.ports import free_port
from furlong.transfer.broker_client import GrpcBrokerClient
from furlong.transfer.publisher import WeightPublisher

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN = "run-xfer"
ENGINES = ("engine-a", "engine-b")
CHILD = Path(__file__).with_name("receiver_process.py")


def policy(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 16, generator=gen),
        "layers.0.mlp.weight": torch.randn(16, 16, generator=gen).to(torch.bfloat16),
        "layers.0.norm.weight": torch.randn(16, generator=gen),
        "lm_head.scale": torch.randn(4, generator=gen).to(torch.float8_e4m3fn),
    }


def assert_received(out: Path, version: int, expected: dict[str, torch.Tensor]) -> None:
    for engine in ENGINES:
        got = torch.load(out / f"{engine}-v{version}.pt")
        assert list(got) == list(expected), engine
        for name, tensor in expected.items():
            assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
            assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), (engine, name)


@pytest.fixture
def broker_process(tmp_path):
    port, metrics_port = free_port(), free_port()
    log_file = open(tmp_path / "broker.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "furlong.weight_broker",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--log-level",
            "INFO",
        ],
        stdout=log_file,
        stderr=subprocess.STDOUT,
    )
    address = f"127.0.0.1:{port}"
    try:
        wait_until(
            lambda: proc.poll() is not None or check_health(address, "furlong.v1.WeightBroker"),
            60.0,
            "the broker to serve",
        )
        assert proc.poll() is None, (tmp_path / "broker.log").read_text()
        yield address, metrics_port, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log_file.close()


def test_publish_to_two_engine_processes_over_nixl(broker_process, tmp_path):
    address, metrics_port, broker_proc = broker_process
    assert check_health(address, "furlong.v1.WeightBroker")
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
                engine,
                "--out",
                str(tmp_path),
            ],
            stdout=open(tmp_path / f"{engine}.log", "w"),
            stderr=subprocess.STDOUT,
        )
        for engine in ENGINES
    ]
    client = GrpcBrokerClient(address)
    publisher = None
    try:
        wait_until(lambda: _engines(client) == ENGINES, 60.0, "both engines to register")
        layout = WeightLayout.from_state_dict(policy(1))
        publisher = WeightPublisher(client, RUN, layout, agent_name="trainer-xfer")

        # Version 1 and version 2 reach both engines bit for bit and commit.
        for version, seed in ((1, 1), (2, 2)):
            result = publisher.publish(version, policy(seed))
            assert (result.version, result.num_bytes) == (version, layout.total_bytes)
            status = client.wait_committed(RUN, version, 30.0)
            assert status.committed_version == version and status.pending_engine_ids == ()
            assert_received(tmp_path, version, policy(seed))

        # A manifest whose checksum does not match the bytes: every engine re-pulls, refuses, and
        # after the re-sends it is fenced; with every engine fenced the version fails, naming the
        # engines and the mismatch.
        client.begin_version(RUN, Manifest(3, layout, "0" * 32), publisher.source)
        client.stage_round(RUN, 3, 0)
        with pytest.raises(
            ConflictError,
            match=r"every engine was fenced: engine engine-a failed "
            r"version 3 after 3 attempts: round 0: "
            r"IntegrityError: checksum mismatch",
        ):
            client.wait_committed(RUN, 3, 30.0)
        assert not (tmp_path / "engine-a-v3.pt").exists()
        assert client.get_version(RUN).fenced_engine_ids == ENGINES

        # Fenced engines register again; the publisher goes on after the failed version.
        wait_until(lambda: _engines(client) == ENGINES, 30.0, "fenced engines to come back")
        publisher.publish(4, policy(4))
        assert client.wait_committed(RUN, 4, 30.0).committed_version == 4
        assert_received(tmp_path, 4, policy(4))

        metrics = (
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        )
        assert f'furlong_broker_committed_version{{run_id="{RUN}"}} 4.0' in metrics
        assert f'furlong_broker_versions_failed_total{{run_id="{RUN}"}} 1.0' in metrics
        transferred = _sample(metrics, 'furlong_broker_transfer_bytes_total{lane="nixl"}')
        assert transferred >= 3 * len(ENGINES) * layout.total_bytes  # versions 1, 2 and 4

        # Stopping an engine unregisters it.
        children[0].send_signal(signal.SIGTERM)
        assert children[0].wait(30) == 0
        wait_until(lambda: _engines(client) == ENGINES[1:], 10.0, "engine-a to unregister")
    finally:
        for child in children:
            if child.poll() is None:
                child.terminate()
                child.wait(30)
        if publisher is not None:
            publisher.close()
        client.close()
    assert [c.returncode for c in children] == [0, 0], [
        (tmp_path / f"{e}.log").read_text()[-3000:] for e in ENGINES
    ]

    broker_proc.send_signal(signal.SIGTERM)
    assert broker_proc.wait(15) == 0


def _engines(client: GrpcBrokerClient) -> tuple[str, ...]:
    try:
        return client.get_version(RUN).engine_ids
    except Exception:  # noqa: BLE001 - the run does not exist until the first engine registers
        return ()


def _sample(metrics_text: str, series: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} not in metrics")


def test_a_broker_process_relays_over_the_lanes_it_is_given(tmp_path):
    """`--relay-run R --relay-lanes nixl`: the relay in the broker process takes the trainer's
    version over NIXL and serves it on NIXL only (a heap bucket, no shared-memory object)."""
    from furlong.transfer.config import TransferConfig
    from furlong.transfer.receiver import WeightReceiver
    from furlong.weight_broker.relay import upstream_run_id

    port, metrics_port = free_port(), free_port()
    log_file = open(tmp_path / "broker.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "furlong.weight_broker",
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--relay-run",
            "relayed",
            "--relay-lanes",
            "nixl",
        ],
        stdout=log_file,
        stderr=subprocess.STDOUT,
    )
    address = f"127.0.0.1:{port}"
    client = publisher = receiver = None
    try:
        wait_until(
            lambda: proc.poll() is not None or check_health(address, "furlong.v1.WeightBroker"),
            60.0,
            "the broker to serve",
        )
        client = GrpcBrokerClient(address)
        got = {}
        receiver = WeightReceiver(
            client,
            "relayed",
            "engine-r",
            lambda v, t: got.update({v: {k: x.clone() for k, x in t.items()}}),
            config=TransferConfig(lanes=("nixl",)),
        )
        receiver.start()
        publisher = WeightPublisher(
            client,
            upstream_run_id("relayed"),
            WeightLayout.from_state_dict(policy(0)),
            "trainer-relayed",
            config=TransferConfig(lanes=("nixl",), bucket_size_bytes=2048),
        )
        publisher.publish(1, policy(1))
        assert client.wait_committed("relayed", 1, 60.0).committed_version == 1
        wait_until(lambda: 1 in got, 30.0, "the engine to apply version 1")
        for name, tensor in policy(1).items():
            assert torch.equal(got[1][name].view(torch.uint8), tensor.view(torch.uint8)), name
        client.register_engine("relayed", "observer")  # a late joiner is sent the latest version
        watch = client.watch_versions("relayed", "observer")
        published = next(watch)
        watch.close()
        client.unregister_engine("relayed", "observer")
        assert published.source.holds_all_rounds and published.source.agent_metadata
        assert published.source.shm_name == "" and published.source.stream_address == ""
    finally:
        for obj in (receiver, publisher):
            if obj is not None:
                obj.close()
        if client is not None:
            client.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
