"""The services a controller drives, through each service's own client: the trainer's
(`furlong.trainer.client`), rollout's (`furlong.rollout.client`) and the weight broker's
(`furlong.weight_broker.client`). `connect` makes their gRPC clients with deadlines from the
controller's `DriverTimeouts` (several rollout replicas behind one `ReplicatedRollout`);
`in_process` wraps services running in this process in their twins, so the whole RL loop can run
in one process. Knows nothing about runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from furlong.controller.config import DriverTimeouts
from furlong.controller.rollout_replicas import ReplicatedRollout
from furlong.rollout import client as rollout_client
from furlong.rollout.api import RolloutClient
from furlong.rollout.client import RolloutDeadlines
from furlong.trainer import client as trainer_client
from furlong.trainer.api import TrainerClient
from furlong.trainer.client import TrainerDeadlines
from furlong.v1 import weight_broker_pb2
from furlong.weight_broker import client as broker_client
from furlong.weight_broker.client import BrokerClient

# Their gRPC service names, also their grpc.health.v1 names.
TRAINER_SERVICE = trainer_client.SERVICE_NAME
ROLLOUT_SERVICE = rollout_client.SERVICE_NAME
BROKER_SERVICE = weight_broker_pb2.DESCRIPTOR.services_by_name["WeightBroker"].full_name

# A service's own wait (train_s, generate_s, commit_s) is sent with the request; the gRPC deadline
# adds this much, so that the service's own timeout answers first.
WAIT_MARGIN_S = 10.0


@dataclass
class Services:
    trainer: TrainerClient
    rollout: RolloutClient
    broker: BrokerClient

    def close(self) -> None:
        for client in (self.trainer, self.rollout, self.broker):
            client.close()


def rollout_clients(addresses: Sequence[str], deadlines: RolloutDeadlines) -> RolloutClient:
    """The gRPC client of the rollout service at the one address, or a `ReplicatedRollout` over
    the replicas at several (named rollout, rollout-1, ... as the local stack names them)."""
    clients = [rollout_client.make_client(a, deadlines) for a in addresses]
    if len(clients) == 1:
        return clients[0]
    return ReplicatedRollout(clients, replica_names(len(clients)))


def replica_names(count: int) -> list[str]:
    """The names of `count` rollout replicas: rollout, rollout-1, rollout-2, ..."""
    return ["rollout"] + [f"rollout-{k}" for k in range(1, count)]


def connect(trainer: str, rollout: str | Sequence[str], broker: str, timeouts: DriverTimeouts) -> Services:
    """gRPC clients of the services at these host:port addresses (`rollout`: one address, or one
    per rollout replica)."""
    t = timeouts
    return Services(
        trainer=trainer_client.make_client(
            trainer,
            TrainerDeadlines(
                call_s=t.end_s,
                configure_s=t.configure_s,
                publish_s=t.publish_s,
                checkpoint_s=t.checkpoint_s,
                wait_margin_s=WAIT_MARGIN_S,
            ),
        ),
        rollout=rollout_clients(
            [rollout] if isinstance(rollout, str) else list(rollout),
            RolloutDeadlines(call_s=t.end_s, configure_s=t.configure_s, generate_margin_s=WAIT_MARGIN_S),
        ),
        broker=broker_client.make_client(broker, timeout_s=t.end_s),
    )


def in_process(trainer: Any, rollout: Any, broker: Any) -> Services:
    """The in-process twins of a TrainerService, a RolloutService and a BrokerCore."""
    return Services(
        trainer=trainer_client.make_client(trainer),
        rollout=rollout_client.make_client(rollout),
        broker=broker_client.make_client(broker),
    )
