"""The weight-update equality check (`--check-weight-update-equal`): proves that a weight sync
really rewrites every parameter of an engine, bit for bit.

Snapshot the engine's parameters (which start equal to the trainer's), overwrite them with garbage,
publish the trainer's state through a real broker, publisher, receiver and lane, and compare every
engine parameter with its snapshot bit-exactly. A parameter the sync forgot (left out of the
manifest, or never copied by apply) still holds garbage and is named; so is one that differs.

    python -m furlong.weight_broker.equality --model-dir DIR [--lanes nixl,shm,grpc]
        [--bucket-bytes N] [--leave-out NAME]

        [--tp-size N --tp-rank R [--fuse]]

exits 0 when every parameter matches and 1 naming the ones that do not. --leave-out publishes the
state without NAME, to show the check catching a forgotten parameter. With --tp-size the engine
holds tensor-parallel rank R of N (Llama-style: q/k/v/gate/up by rows, o/down by columns; --fuse:
fused qkv_proj and gate_up_proj), declares that shard layout and pulls its pieces straight into its
parameters; its parameters start as the expected shards of the trainer's tensors.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from furlong.core.weight_shards import ShardLayout, expected_shards, llama_tensor_parallel
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
    mismatched: tuple[str, ...]  # engine parameters that differ from their snapshot after the sync
    unexpected: tuple[str, ...]  # published tensors the engine has no parameter for

    @property
    def ok(self) -> bool:
        return not self.mismatched and not self.unexpected


def check_weight_update_equal(
    published: Mapping[str, torch.Tensor],
    engine_params: Mapping[str, torch.Tensor],
    *,
    config: TransferConfig = TransferConfig(),
    timeout_s: float = 60.0,
    shard_layout: ShardLayout | None = None,
) -> EqualityReport:
    """Run the check. `published` is what the trainer publishes; `engine_params` are the engine's
    parameter tensors (contiguous; written in place, left equal to their snapshot when the check
    passes). The garbage is every byte XOR 0xA5, so no byte of it equals the original.

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

    client = InProcessBrokerClient(BrokerCore())
    if shard_layout is None:
        receiver = WeightReceiver(client, _RUN, "equality-engine", apply, config=config)
    else:
        receiver = WeightReceiver(
            client,
            _RUN,
            "equality-engine",
            lambda version, params: None,
            config=config,
            shard_layout=shard_layout,
            params=engine_params,
        )
    publisher = WeightPublisher(
        client, _RUN, WeightLayout.from_state_dict(published), "equality-trainer", config=config
    )
    try:
        receiver.start()
        publisher.publish(1, published)
        client.wait_committed(_RUN, 1, timeout_s)
    finally:
        publisher.close()
        receiver.close()
        client.close()
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


def main(argv: Sequence[str] | None = None) -> int:
    from furlong.core.checkpoint import load_policy, unique_state

    parser = argparse.ArgumentParser(
        prog="python -m furlong.weight_broker.equality", description="weight-update equality check"
    )
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--lanes", default="nixl,shm,grpc")
    parser.add_argument(
        "--bucket-bytes",
        type=int,
        default=64 << 10,
        help="small by default so that the model goes in several rounds",
    )
    parser.add_argument(
        "--leave-out", action="append", default=[], help="publish without this tensor (repeatable)"
    )
    parser.add_argument(
        "--tp-size", type=int, default=0, help="the engine holds a tensor-parallel shard (Llama-style names)"
    )
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--fuse", action="store_true", help="fused qkv_proj and gate_up_proj")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = TransferConfig(lanes=tuple(args.lanes.split(",")), bucket_size_bytes=args.bucket_bytes)
    except ValueError as exc:
        parser.error(str(exc))
    trainer, _ = load_policy(args.model_dir)
    engine, _ = load_policy(args.model_dir)
    published = {n: t.detach() for n, t in unique_state(trainer).items() if n not in args.leave_out}
    unknown = sorted(set(args.leave_out) - set(unique_state(trainer)))
    if unknown:
        parser.error(f"--leave-out names unknown tensors {unknown}")
    if args.tp_size:
        full = {n: t.detach() for n, t in unique_state(trainer).items()}
        try:
            shards = llama_tensor_parallel(
                WeightLayout.from_state_dict(full), args.tp_rank, args.tp_size, fuse=args.fuse
            )
        except ValueError as exc:
            parser.error(str(exc))
        report = check_weight_update_equal(
            published, expected_shards(shards, full), config=config, shard_layout=shards
        )
    else:
        report = check_weight_update_equal(published, unique_state(engine), config=config)
    print(
        f"parameters: {report.num_parameters}, mismatched: {list(report.mismatched)}, "
        f"unexpected: {list(report.unexpected)}"
    )
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
