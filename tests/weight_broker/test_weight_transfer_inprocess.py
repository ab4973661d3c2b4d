"""WeightPublisher and WeightReceiver with real NIXL agents in one process and the in-process broker
client: what the receiver applies, what it refuses, and how the publisher fences its buffer."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import pytest
import torch
from polling import wait_until

from furlong.core.errors import ConflictError
from furlong.core.weights import WeightLayout
from furlong.transfer.destination import layout_mismatch
from furlong.transfer.publisher import WeightPublisher
from furlong.transfer.receiver import WeightReceiver
from furlong.weight_broker.client import InProcessBrokerClient
from furlong.weight_broker.core import BrokerCore

pytestmark = pytest.mark.integration

RUN = "run-local"


def policy(seed: int, width: int = 8) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(width, 4, generator=gen), "b": torch.randn(4, generator=gen).half()}


class Engine:
    """Records what apply() was given (as copies); can be told to block or to fail."""

    def __init__(self) -> None:
        self.applied: dict[int, dict[str, torch.Tensor]] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.fail_with: str | None = None

    def apply(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        self.gate.wait(10.0)
        if self.fail_with:
            raise RuntimeError(self.fail_with)
        self.applied[version] = {name: t.clone() for name, t in tensors.items()}


@pytest.fixture
def local():
    core = BrokerCore(max_ack_attempts=3)
    client = InProcessBrokerClient(core)
    opened = []

    def open_(kind, *args, **kwargs):
        obj = kind(client, RUN, *args, **kwargs)
        opened.append(obj)
        return obj

    yield client, open_
    for obj in reversed(opened):
        obj.close()
    client.close()


def test_versions_arrive_bit_identical_and_commit(local):
    client, open_ = local
    engine = Engine()
    receiver = open_(WeightReceiver, "e1", engine.apply, agent_name="engine-e1")
    receiver.start()
    assert receiver.version == -1
    publisher = open_(WeightPublisher, WeightLayout.from_state_dict(policy(0)), "trainer-a")
    for version in (1, 2):
        result = publisher.publish(version, policy(version))
        assert result.num_bytes == publisher.layout.total_bytes and result.stage_seconds >= 0
        assert client.wait_committed(RUN, version, 10.0).committed_version == version
        assert receiver.version == version
        for name, tensor in policy(version).items():
            assert torch.equal(engine.applied[version][name], tensor), (version, name)
    with pytest.raises(ConflictError, match="version 2 is not newer than the last published version 2"):
        publisher.publish(2, policy(2))
    with pytest.raises(ValueError, match="'w': shape"):
        publisher.publish(3, policy(3, width=9))

    receiver.close()
    assert client.get_version(RUN).engine_ids == ()


def test_a_late_engine_gets_the_committed_version(local):
    client, open_ = local
    publisher = open_(WeightPublisher, WeightLayout.from_state_dict(policy(0)), "trainer-b")
    publisher.publish(5, policy(5))
    assert client.wait_committed(RUN, 5, 1.0).committed_version == 5  # no engines yet
    engine = Engine()
    receiver = open_(WeightReceiver, "late", engine.apply)
    receiver.start()
    wait_until(lambda: receiver.version == 5)
    assert torch.equal(engine.applied[5]["w"], policy(5)["w"])


def test_publisher_waits_for_the_previous_version_to_commit(local):
    client, open_ = local
    engine = Engine()
    engine.gate.clear()  # the engine holds version 1 in apply()
    open_(WeightReceiver, "slow", engine.apply).start()
    publisher = open_(WeightPublisher, WeightLayout.from_state_dict(policy(0)), "trainer-c")
    publisher.publish(1, policy(1))
    with pytest.raises(TimeoutError, match="version 1 not committed"):
        publisher.publish(2, policy(2), commit_timeout_s=0.2)
    assert client.get_version(RUN).latest_version == 1  # version 2 was never begun
    engine.gate.set()
    publisher.publish(2, policy(2), commit_timeout_s=10.0)
    assert client.wait_committed(RUN, 2, 10.0).committed_version == 2
    assert torch.equal(engine.applied[1]["w"], policy(1)["w"])  # not overwritten mid-transfer
    assert torch.equal(engine.applied[2]["w"], policy(2)["w"])


def test_a_different_layout_is_refused_and_fails_the_version(local):
    client, open_ = local
    engine = Engine()
    open_(WeightReceiver, "e1", engine.apply).start()
    first = open_(WeightPublisher, WeightLayout.from_state_dict(policy(0)), "trainer-d")
    first.publish(1, policy(1))
    client.wait_committed(RUN, 1, 10.0)
    wider = open_(WeightPublisher, WeightLayout.from_state_dict(policy(0, width=16)), "trainer-e")
    wider.publish(2, policy(2, width=16))
    with pytest.raises(
        ConflictError,
        match="engine e1 failed version 2 after 3 attempts: ValueError: version 2 has a different layout",
    ):
        client.wait_committed(RUN, 2, 10.0)
    assert sorted(engine.applied) == [1]


def test_an_apply_error_is_reported(local):
    client, open_ = local
    engine = Engine()
    engine.fail_with = "model is busy"
    receiver = open_(WeightReceiver, "e1", engine.apply)
    receiver.start()
    publisher = open_(WeightPublisher, WeightLayout.from_state_dict(policy(0)), "trainer-f")
    publisher.publish(1, policy(1))
    with pytest.raises(ConflictError, match="RuntimeError: model is busy"):
        client.wait_committed(RUN, 1, 10.0)
    assert receiver.version == -1


@pytest.mark.unit
def test_layout_mismatch_explains_the_difference():
    a = WeightLayout.from_state_dict(policy(0))
    assert layout_mismatch(a, WeightLayout.from_state_dict(policy(1))) == ""
    assert "total_bytes" in layout_mismatch(a, WeightLayout.from_state_dict(policy(0, width=16)))
    renamed = WeightLayout.from_state_dict({"v": torch.zeros(8, 4), "b": torch.zeros(4).half()})
    assert "tensor 'v' differs from 'w'" in layout_mismatch(a, renamed)
