"""Weight receivers of the rollout engines backed by the weight broker: one `WeightReceiver` per
engine, all sharing one broker client. The service only sees the `ReceiverFactory` seam.
"""

from __future__ import annotations

from furlong.rollout.core.types import ApplyWeightsFn, ReceiverFactory
from furlong.transfer.broker_client import BrokerClient
from furlong.transfer.config import TransferConfig
from furlong.transfer.receiver import WeightReceiver


def broker_receiver_factory(
    broker: BrokerClient, transfer: TransferConfig = TransferConfig()
) -> ReceiverFactory:
    """A factory of broker-backed receivers; the engine id doubles as its NIXL agent name prefix."""

    def make(run_id: str, engine_id: str, apply: ApplyWeightsFn) -> WeightReceiver:
        return WeightReceiver(broker, run_id, engine_id, apply, config=transfer)

    return make
