"""Where the rollout service's weight receivers put the versions they receive
(`--weight-buffer-device`): the flag parses into the config and a bad value exits 2 naming it, a
CUDA device this machine lacks stops the service at start-up, and the service's receivers allocate
their receive buffers on the configured device. CPU only: CUDA availability is faked while a
config naming a CUDA device is parsed, and the CUDA allocation is a stand-in that records the
device it was asked for and hands out host memory (tests/gpu/gpu_transfer_checks.py receives into
real GPU memory)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from furlong.core.weights import WeightLayout
from furlong.rollout.__main__ import main
from furlong.rollout.config import RolloutServerConfig
from furlong.rollout.receivers import receiver_transfer, service_receiver_factory
from furlong.transfer import destination
from furlong.transfer.config import TransferConfig
from furlong.transfer.publisher import WeightPublisher
from furlong.weight_broker.client import InProcessBrokerClient
from furlong.weight_broker.core import BrokerCore

BASE = ["--port", "1", "--metrics-port", "2", "--redis-url", "redis://127.0.0.1:1/0"]
BASE += ["--broker", "127.0.0.1:3"]
RUN = "run-buffers"


def with_cuda_devices(monkeypatch: pytest.MonkeyPatch, count: int, argv: list[str]) -> RolloutServerConfig:
    """The config of BASE + argv parsed as on a machine with `count` CUDA devices."""
    with monkeypatch.context() as fake:
        fake.setattr(torch.cuda, "is_available", lambda: True)
        fake.setattr(torch.cuda, "device_count", lambda: count)
        return RolloutServerConfig.from_args([*BASE, *argv])


@pytest.fixture
def cuda_allocations(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(device, bytes) of every receive buffer allocated in CUDA memory; the stand-in gives host
    memory, so the rest of the receive path runs as it is."""
    asked: list[tuple[str, int]] = []

    def zeroed_buffer(size_bytes: int, device: str) -> torch.Tensor:
        asked.append((device, size_bytes))
        return torch.zeros(size_bytes, dtype=torch.uint8)

    monkeypatch.setattr(destination, "zeroed_buffer", zeroed_buffer)
    return asked


@pytest.mark.unit
def test_the_weight_buffer_device_flag_reaches_the_config_and_a_bad_one_exits_2(monkeypatch, capsys):
    assert RolloutServerConfig.from_args(BASE).weight_buffer_device == "cpu"
    explicit = RolloutServerConfig.from_args([*BASE, "--weight-buffer-device", "cpu"])
    assert explicit.weight_buffer_device == "cpu"
    for bad in ("gpu", "cuda:x", "CUDA", "cuda:"):
        with pytest.raises(SystemExit) as exc:
            RolloutServerConfig.from_args([*BASE, "--weight-buffer-device", bad])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"--weight-buffer-device {bad!r}" in err
        assert "device must be 'cpu', 'cuda' or 'cuda:N'" in err
    config = with_cuda_devices(monkeypatch, 2, ["--weight-buffer-device", "cuda:1", "--device", "cuda"])
    assert (config.weight_buffer_device, config.device) == ("cuda:1", "cuda")
    with pytest.raises(SystemExit) as exc:
        with_cuda_devices(monkeypatch, 2, ["--weight-buffer-device", "cuda:2"])
    assert exc.value.code == 2
    assert "--weight-buffer-device 'cuda:2': device 'cuda:2': this machine has 2 CUDA device(s)" in (
        capsys.readouterr().err
    )


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is absent")
def test_a_cuda_buffer_device_without_cuda_stops_the_service_at_start_up(capsys):
    for device in ("cuda", "cuda:0"):
        with pytest.raises(SystemExit) as exc:
            main([*BASE, "--weight-buffer-device", device])
        err = capsys.readouterr().err
        assert exc.value.code == 2
        assert f"--weight-buffer-device {device!r}: device {device!r}: CUDA is not available" in err
    with pytest.raises(ValueError, match="--weight-buffer-device 'cuda': .*CUDA is not available"):
        RolloutServerConfig(redis_url="redis://x", broker_address="h:1", weight_buffer_device="cuda")


@pytest.mark.unit
def test_the_receivers_transfer_settings_differ_from_the_defaults_only_in_the_buffer_device(monkeypatch):
    assert receiver_transfer(RolloutServerConfig.from_args(BASE)) == TransferConfig()
    config = with_cuda_devices(monkeypatch, 2, ["--weight-buffer-device", "cuda:1"])
    assert receiver_transfer(config) == dataclasses.replace(TransferConfig(), device="cuda:1")


def _state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(64, 48, generator=generator),
        "b": torch.randn(300, generator=generator).to(torch.bfloat16),
    }


def _receive_one_version(config: RolloutServerConfig) -> dict[str, torch.Tensor]:
    """Publish one version to a receiver from the service's factory (real NIXL between the
    publisher's host bucket and the receive buffer); what its engine was given."""
    state = _state()
    client = InProcessBrokerClient(BrokerCore())
    applied: dict[int, dict[str, torch.Tensor]] = {}
    receiver = service_receiver_factory(client, config)(
        RUN, f"{RUN}-engine-0", lambda v, t: applied.__setitem__(v, {n: x.clone() for n, x in t.items()})
    )
    publisher = WeightPublisher(client, RUN, WeightLayout.from_state_dict(state), "trainer-buffers")
    try:
        receiver.start()
        publisher.publish(1, state)
        client.wait_committed(RUN, 1, 30.0)
    finally:
        publisher.close()
        receiver.close()
        client.close()
    return applied[1]


@pytest.mark.integration
def test_the_services_receivers_allocate_their_buffers_on_the_configured_cuda_device(
    monkeypatch, cuda_allocations
):
    config = with_cuda_devices(monkeypatch, 2, ["--weight-buffer-device", "cuda:1"])
    got = _receive_one_version(config)
    state = _state()
    assert cuda_allocations == [("cuda:1", WeightLayout.from_state_dict(state).total_bytes)]
    assert sorted(got) == sorted(state)
    for name, tensor in state.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.mark.integration
def test_with_the_default_cpu_the_receive_buffers_are_host_memory(cuda_allocations):
    got = _receive_one_version(RolloutServerConfig.from_args(BASE))
    assert cuda_allocations == []  # host_buffer, as without the flag
    for name, tensor in _state().items():
        assert got[name].device.type == "cpu" and torch.equal(got[name], tensor), name
