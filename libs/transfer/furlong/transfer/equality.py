"""The weight-update equality check (`--check-weight-update-equal`): proves that a weight sync
really rewrites every parameter of an engine, bit for bit.

Snapshot the engine's parameters (which start equal to the trainer's), overwrite them with garbage,
publish the trainer's state through a real broker, publisher, receiver and lane, and compare every
engine parameter with its snapshot bit-exactly. A parameter the sync forgot (left out of the
manifest, or never copied by apply) still holds garbage and is named; so is one that differs.

The broker is the caller's (any BrokerClient: the broker service's in-process twin over a private
BrokerCore, or a gRPC client); the check uses a run of its own on it and ends that run. The command
line over a private in-process broker is the broker service's (services/weight-broker).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from furlong.core.weight_shards import ShardLayout
from furlong.core.weights import WeightLayout
from furlong.transfer.broker_client import BrokerClient
from furlong.transfer.config import TransferConfig
from furlong.transfer.publisher import WeightPublisher
from furlong.transfer.receiver import WeightReceiver

log = logging.getLogger(__name__)

DEFAULT_RUN_ID = "weight-update-equality"


@dataclass(frozen=True)
class EqualityReport:
    num_parameters: int
    mismatched: tuple[str, ...]  # engine parameters that differ from their snapshot after the sync
    unexpected: tuple[str, ...]  # published tensors the engine has no parameter for

    @property
    def ok(self) -> bool:
        return not self.mismatched and not self.unexpected


def check_weight_update_equal(
    published: Mapping[str, torch.Tensor],
    engine_params: Mapping[str, torch.Tensor],
    broker: BrokerClient,
    *,
    run_id: str = DEFAULT_RUN_ID,
    config: TransferConfig = TransferConfig(),
    timeout_s: float = 60.0,
    shard_layout: ShardLayout | None = None,
) -> EqualityReport:
    """Run the check. `published` is what the trainer publishes; `engine_params` are the engine's
    parameter tensors (contiguous; written in place, left equal to their snapshot when the check
    passes). The garbage is every byte XOR 0xA5, so no byte of it equals the original. The sync
    goes through `broker` as run `run_id`, which must be a run nobody else uses and is ended
    afterwards (the broker stays open: it is the caller's).

    Without shard_layout the engine receives the published tensors into a receive buffer and
    copies them (apply). With one, it registers that layout and pulls its pieces straight into
    engine_params, which must hold every tensor of the layout (ValueError naming the others)."""
    if shard_layout is not None:
        wanted = [s.name for s in shard_layout.resolve(WeightLayout.from_state_dict(published)).slots]
        missing = sorted(set(wanted) - engine_params.keys())
        if missing:
            raise ValueError(f"the engine has no parameters {missing} of its shard layout")
    snapshot = {name: t.detach().clone() for name, t in engine_params.items()}
    with torch.no_grad():
        for name, tensor in engine_params.items():
            raw = tensor.detach().reshape(-1).view(torch.uint8)
            raw.copy_(snapshot[name].reshape(-1).view(torch.uint8) ^ 0xA5)
    unexpected: list[str] = []

    def apply(version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in tensors.items():
                target = engine_params.get(name)
                if target is None:
                    unexpected.append(name)
                else:
                    target.copy_(tensor)

    if shard_layout is None:
        receiver = WeightReceiver(broker, run_id, "equality-engine", apply, config=config)
    else:
        receiver = WeightReceiver(
            broker,
            run_id,
            "equality-engine",
            lambda version, params: None,
            config=config,
            shard_layout=shard_layout,
            params=engine_params,
        )
    publisher = WeightPublisher(
        broker, run_id, WeightLayout.from_state_dict(published), "equality-trainer", config=config
    )
    try:
        receiver.start()
        publisher.publish(1, published)
        broker.wait_committed(run_id, 1, timeout_s)
    finally:
        publisher.close()
        receiver.close()
        broker.end_run(run_id)
    mismatched = tuple(
        name
        for name, tensor in engine_params.items()
        if not torch.equal(
            tensor.detach().reshape(-1).view(torch.uint8), snapshot[name].reshape(-1).view(torch.uint8)
        )
    )
    report = EqualityReport(len(engine_params), mismatched, tuple(sorted(unexpected)))
    if report.ok:
        log.info("weight update equal: %d parameters bit-identical after the sync", report.num_parameters)
    else:
        log.error(
            "weight update NOT equal: mismatched %s, unexpected %s", list(mismatched), list(report.unexpected)
        )
    return report
