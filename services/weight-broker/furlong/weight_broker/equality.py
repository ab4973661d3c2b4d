"""The weight-update equality check's command line (furlong.transfer.equality), over a private
in-process broker:

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

import torch

from furlong.core.weight_shards import ShardLayout, expected_shards, llama_tensor_parallel
from furlong.core.weights import WeightLayout
from furlong.transfer.config import TransferConfig
from furlong.transfer.equality import EqualityReport, check_weight_update_equal
from furlong.weight_broker.client import make_client
from furlong.weight_broker.core import BrokerCore


def check_in_process(
    published: Mapping[str, torch.Tensor],
    engine_params: Mapping[str, torch.Tensor],
    *,
    config: TransferConfig = TransferConfig(),
    shard_layout: ShardLayout | None = None,
) -> EqualityReport:
    """check_weight_update_equal through a private in-process broker (a fresh BrokerCore)."""
    broker = make_client(BrokerCore())
    try:
        return check_weight_update_equal(
            published, engine_params, broker, config=config, shard_layout=shard_layout
        )
    finally:
        broker.close()


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
        report = check_in_process(
            published, expected_shards(shards, full), config=config, shard_layout=shards
        )
    else:
        report = check_in_process(published, unique_state(engine), config=config)
    print(
        f"parameters: {report.num_parameters}, mismatched: {list(report.mismatched)}, "
        f"unexpected: {list(report.unexpected)}"
    )
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
