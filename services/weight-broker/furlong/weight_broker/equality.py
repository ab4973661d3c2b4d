"""The weight-update equality check (`--check-weight-update-equal`): proves that a weight sync
really rewrites every parameter of an engine, bit for bit.

Snapshot the engine's parameters (which start equal to the trainer's), overwrite them with garbage,
publish the trainer's state through a real broker, publisher, receiver and lane, and compare every
engine parameter with its snapshot bit-exactly. A parameter the sync forgot (left out of the
manifest, or never copied by apply) still holds garbage and is named; so is one that differs.

    python -m furlong.weight_broker.equality --model-dir DIR [--lanes nixl,shm,grpc]
        [--bucket-bytes N] [--leave-out NAME]

exits 0 when every parameter matches and 1 naming the ones that do not. --leave-out publishes the
state without NAME, to show the check catching a forgotten parameter.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from furlong.core.weights import WeightLayout
from furlong.weight_broker.client import InProcessBrokerClient
from furlong.weight_broker.config import TransferConfig
from furlong.weight_broker.core import BrokerCore
from furlong.weight_broker.publisher import WeightPublisher
from furlong.weight_broker.receiver import WeightReceiver

log = logging.getLogger(__name__)

_RUN = "weight-update-equality"


@dataclass(frozen=True)
class EqualityReport:
    num_parameters: int
    mismatched: tuple[str, ...]   # engine parameters that differ from their snapshot after the sync
    unexpected: tuple[str, ...]   # published tensors the engine has no parameter for

    @property
    def ok(self) -> bool:
        return not self.mismatched and not self.unexpected


def check_weight_update_equal(published: Mapping[str, torch.Tensor],
                              engine_params: Mapping[str, torch.Tensor], *,
                              config: TransferConfig = TransferConfig(),
                              timeout_s: float = 60.0) -> EqualityReport:
    """Run the check. `published` is what the trainer publishes; `engine_params` are the engine's
    parameter tensors (contiguous; written in place, left equal to their snapshot when the check
    passes). The garbage is every byte XOR 0xA5, so no byte of it equals the original."""
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

    client = InProcessBrokerClient(BrokerCore())
    receiver = WeightReceiver(client, _RUN, "equality-engine", apply, config=config)
    publisher = WeightPublisher(client, _RUN, WeightLayout.from_state_dict(published),
                                "equality-trainer", config=config)
    try:
        receiver.start()
        publisher.publish(1, published)
        client.wait_committed(_RUN, 1, timeout_s)
    finally:
        publisher.close()
        receiver.close()
        client.close()
    mismatched = tuple(name for name, tensor in engine_params.items()
                       if not torch.equal(tensor.detach().reshape(-1).view(torch.uint8),
                                          snapshot[name].reshape(-1).view(torch.uint8)))
    report = EqualityReport(len(engine_params), mismatched, tuple(sorted(unexpected)))
    if report.ok:
        log.info("weight update equal: %d parameters bit-identical after the sync",
                 report.num_parameters)
    else:
        log.error("weight update NOT equal: mismatched %s, unexpected %s", list(mismatched),
                  list(report.unexpected))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    from furlong.core.checkpoint import load_policy, unique_state

    parser = argparse.ArgumentParser(prog="python -m furlong.weight_broker.equality",
                                     description="weight-update equality check")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--lanes", default="nixl,shm,grpc")
    parser.add_argument("--bucket-bytes", type=int, default=64 << 10,
                        help="small by default so that the model goes in several rounds")
    parser.add_argument("--leave-out", action="append", default=[],
                        help="publish without this tensor (repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = TransferConfig(lanes=tuple(args.lanes.split(",")),
                                bucket_size_bytes=args.bucket_bytes)
    except ValueError as exc:
        parser.error(str(exc))
    trainer, _ = load_policy(args.model_dir)
    engine, _ = load_policy(args.model_dir)
    published = {n: t.detach() for n, t in unique_state(trainer).items()
                 if n not in args.leave_out}
    unknown = sorted(set(args.leave_out) - set(unique_state(trainer)))
    if unknown:
        parser.error(f"--leave-out names unknown tensors {unknown}")
    report = check_weight_update_equal(published, unique_state(engine), config=config)
    print(f"parameters: {report.num_parameters}, mismatched: {list(report.mismatched)}, "
          f"unexpected: {list(report.unexpected)}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
