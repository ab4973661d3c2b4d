"""Fault tests with real processes: the broker (`python -m furlong.weight_broker`), engines as child
processes (receiver_process.py, over gRPC and shared memory) and a WeightPublisher here.

- kill -9 an engine mid-pull: the version commits for the others; the engine comes back and
  catches up with the next version.
- kill -9 the broker mid-publish: no engine serves the torn version; after a restart the trainer
  publishes the same version again and every engine takes it.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from polling import wait_until

from furlong.core.errors import UnavailableError
from furlong.core.weights import WeightLayout
from furlong.rpc import check_health
from furlong.rpc.ports import free_port
from furlong.transfer.broker_client import GrpcBrokerClient
from furlong.transfer.config import TransferConfig
from furlong.transfer.publisher import WeightPublisher

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN = "run-faults"
CHILD = Path(__file__).with_name("receiver_process.py")
BUCKET = TransferConfig(bucket_size_bytes=4096, round_timeout_s=30.0)


def policy(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"layer{i}": torch.randn(1024, generator=gen) for i in range(4)}  # 4 rounds of 4 KiB


class Stack:
    """The broker process (restartable on the same port) and engine processes."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.address = f"127.0.0.1:{free_port()}"
        self.broker: subprocess.Popen | None = None
        self.engines: dict[str, subprocess.Popen] = {}

    def start_broker(self) -> None:
        port = self.address.rsplit(":", 1)[1]
        self.broker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "furlong.weight_broker",
                "--port",
                port,
                "--metrics-port",
                str(free_port()),
                "--ack-timeout-s",
                "20",
            ],
            stdout=open(self.tmp / "broker.log", "a"),
            stderr=subprocess.STDOUT,
        )
        wait_until(
            lambda: self.broker.poll() is not None or check_health(self.address, "furlong.v1.WeightBroker"),
            60.0,
            "the broker",
        )
        assert self.broker.poll() is None, (self.tmp / "broker.log").read_text()[-3000:]

    def start_engine(self, engine_id: str, pull_delay_s: float = 0.0) -> None:
        self.engines[engine_id] = subprocess.Popen(
            [
                sys.executable,
                str(CHILD),
                "--broker",
                self.address,
                "--run-id",
                RUN,
                "--engine-id",
                engine_id,
                "--out",
                str(self.tmp),
                "--pull-delay-s",
                str(pull_delay_s),
            ],
            stdout=open(self.tmp / f"{engine_id}.log", "a"),
            stderr=subprocess.STDOUT,
        )

    def stop(self) -> None:
        for proc in [*self.engines.values(), self.broker]:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@pytest.fixture
def stack(tmp_path):
    s = Stack(tmp_path)
    s.start_broker()
    yield s
    s.stop()


def engines_of(client: GrpcBrokerClient) -> tuple[str, ...]:
    try:
        return client.get_version(RUN).engine_ids
    except Exception:  # noqa: BLE001 - no run (yet, or after a broker restart)
        return ()


def assert_has(tmp: Path, engine: str, version: int, expected: dict[str, torch.Tensor]) -> None:
    got = torch.load(tmp / f"{engine}-v{version}.pt")
    assert list(got) == list(expected), engine
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), (engine, version, name)


def test_killing_an_engine_mid_pull_commits_for_the_others_and_it_catches_up(stack, tmp_path):
    stack.start_engine("steady")
    stack.start_engine("doomed", pull_delay_s=0.5)
    client = GrpcBrokerClient(stack.address)
    publisher = None
    try:
        wait_until(lambda: engines_of(client) == ("doomed", "steady"), 60.0, "both engines")
        publisher = WeightPublisher(
            client, RUN, WeightLayout.from_state_dict(policy(1)), "trainer-faults-1", config=BUCKET
        )
        published = threading.Thread(target=publisher.publish, args=(1, policy(1)), daemon=True)
        published.start()
        wait_until(lambda: (tmp_path / "doomed-pulling").exists(), 30.0, "doomed to start pulling")
        stack.engines["doomed"].kill()  # kill -9 in the middle of its pulls
        stack.engines["doomed"].wait(10)
        published.join(60.0)
        assert not published.is_alive()
        status = client.wait_committed(RUN, 1, 60.0)
        assert status.committed_version == 1 and status.engine_ids == ("steady",)
        assert_has(tmp_path, "steady", 1, policy(1))
        assert not (tmp_path / "doomed-v1.pt").exists()

        stack.start_engine("doomed")  # back, without the slow link
        wait_until(lambda: engines_of(client) == ("doomed", "steady"), 60.0, "doomed to return")
        publisher.publish(2, policy(2))
        assert client.wait_committed(RUN, 2, 60.0).committed_version == 2
        for engine in ("steady", "doomed"):
            assert_has(tmp_path, engine, 2, policy(2))
    finally:
        if publisher is not None:
            publisher.close()
        client.close()


def test_killing_the_broker_mid_publish_tears_nothing_and_the_trainer_republishes(stack, tmp_path):
    for engine in ("e1", "e2"):
        stack.start_engine(engine, pull_delay_s=0.3)
    client = GrpcBrokerClient(stack.address, timeout_s=5.0)
    publisher = None
    try:
        wait_until(lambda: engines_of(client) == ("e1", "e2"), 60.0, "both engines")
        publisher = WeightPublisher(
            client, RUN, WeightLayout.from_state_dict(policy(1)), "trainer-faults-2", config=BUCKET
        )
        publisher.publish(1, policy(1))
        assert client.wait_committed(RUN, 1, 60.0).committed_version == 1

        errors: list[BaseException] = []

        def publish_two() -> None:
            try:
                publisher.publish(2, policy(2))
            except BaseException as exc:  # noqa: BLE001 - the test inspects it
                errors.append(exc)

        for engine in ("e1", "e2"):
            (tmp_path / f"{engine}-pulling").unlink()
        thread = threading.Thread(target=publish_two, daemon=True)
        thread.start()
        wait_until(lambda: (tmp_path / "e1-pulling").exists(), 30.0, "version 2 to be pulled")
        stack.broker.kill()  # kill -9 the broker mid-publish
        stack.broker.wait(10)
        thread.join(60.0)
        assert len(errors) == 1 and isinstance(errors[0], UnavailableError), errors
        time.sleep(1.0)  # engines keep serving version 1; nothing of version 2 was applied
        for engine in ("e1", "e2"):
            assert not (tmp_path / f"{engine}-v2.pt").exists()
            assert_has(tmp_path, engine, 1, policy(1))

        stack.start_broker()
        wait_until(lambda: engines_of(client) == ("e1", "e2"), 60.0, "engines to re-register")
        publisher.publish(2, policy(2))  # the same version again, on the new broker
        assert client.wait_committed(RUN, 2, 60.0).committed_version == 2
        for engine in ("e1", "e2"):
            assert_has(tmp_path, engine, 2, policy(2))
    finally:
        if publisher is not None:
            publisher.close()
        client.close()
