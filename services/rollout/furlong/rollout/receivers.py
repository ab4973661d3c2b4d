"""Weight receivers of the rollout engines backed by the weight broker: one `WeightReceiver` per
engine, all sharing one broker client. The service only sees the `ReceiverFactory` seam.

Where a receiver puts the versions it receives is the service's `--weight-buffer-device`: host
memory (`cpu`, the default) or GPU memory (`cuda`, `cuda:N`). With a CUDA device every receive
buffer is allocated there when the first version arrives (furlong.transfer.destination), NIXL
reads land in it as VRAM, and in-process engines on the GPU load each version from it device to
device, with no copy through host memory. The device is checked when the configuration is parsed
(RolloutServerConfig), so a CUDA device the process lacks stops the service at start-up, not at
the first update.
"""

from __future__ import annotations

from furlong.rollout.config import RolloutServerConfig
from furlong.rollout.core.types import ApplyWeightsFn, PrepareWeightsFn, ReceiverFactory
from furlong.transfer.broker_client import BrokerClient
from furlong.transfer.config import TransferConfig
from furlong.transfer.receiver import WeightReceiver


def broker_receiver_factory(
    broker: BrokerClient, transfer: TransferConfig = TransferConfig()
) -> ReceiverFactory:
    """A factory of broker-backed receivers; the engine id doubles as its NIXL agent name prefix."""

    def make(
        run_id: str, engine_id: str, apply: ApplyWeightsFn, prepare: PrepareWeightsFn | None = None
    ) -> WeightReceiver:
        return WeightReceiver(broker, run_id, engine_id, apply, config=transfer, prepare=prepare)

    return make


def receiver_transfer(config: RolloutServerConfig) -> TransferConfig:
    """The transfer settings of the service's receivers: the defaults, with receive buffers on
    `config.weight_buffer_device` ("cpu": exactly the defaults)."""
    return TransferConfig(device=config.weight_buffer_device)


def service_receiver_factory(broker: BrokerClient, config: RolloutServerConfig) -> ReceiverFactory:
    """The rollout service's receivers (`__main__`): broker-backed, their receive buffers on the
    configured `--weight-buffer-device`."""
    return broker_receiver_factory(broker, receiver_transfer(config))
