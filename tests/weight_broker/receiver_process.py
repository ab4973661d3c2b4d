"""A rollout engine stand-in for the transfer tests, run as its own process:

    python receiver_process.py --broker HOST:PORT --run-id R --engine-id E --out DIR
        [--pull-delay-s S] [--shard-layout FILE] [--lanes nixl,shm,grpc]

It receives versions with a WeightReceiver over gRPC and NIXL; its apply() copies the tensors and
saves them to DIR/E-v<version>.pt (atomically) so the test can compare them bit for bit. With
--pull-delay-s it reads over shared memory and every read of a round first touches DIR/E-pulling and
then waits S seconds (a slow link, so a test can kill something mid-pull). With --shard-layout it
registers the shard layout in FILE (ShardLayout JSON) and receives only its pieces. It stops,
unregistering the engine, on SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from furlong.core.weight_shards import ShardLayout
from furlong.transfer.broker_client import GrpcBrokerClient
from furlong.transfer.config import TransferConfig
from furlong.transfer.lanes import connect_lane
from furlong.transfer.receiver import WeightReceiver


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--broker", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--engine-id", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pull-delay-s", type=float, default=0.0)
    parser.add_argument("--shard-layout", type=Path, default=None)
    parser.add_argument("--lanes", default="nixl,shm,grpc")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"{args.engine_id} %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def apply(version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        copied = {name: tensor.clone() for name, tensor in tensors.items()}
        final = args.out / f"{args.engine_id}-v{version}.pt"
        partial = final.with_suffix(".partial")
        torch.save(copied, partial)
        os.replace(partial, final)

    config = TransferConfig(rpc_retry_s=0.2, lanes=tuple(args.lanes.split(",")))
    shard_layout = ShardLayout.from_json(args.shard_layout.read_text()) if args.shard_layout else None
    connect = None
    if args.pull_delay_s:

        def connect(source):
            return SlowLane(connect_lane(source, ("shm",), None, 1 << 20))

    class SlowLane:
        def __init__(self, lane) -> None:
            self._lane, self.name = lane, lane.name

        def read(self, src_offset_bytes, dst, timeout_s):
            (args.out / f"{args.engine_id}-pulling").touch()
            time.sleep(args.pull_delay_s)
            return self._lane.read(src_offset_bytes, dst, timeout_s)

        def close(self) -> None:
            self._lane.close()

    client = GrpcBrokerClient(args.broker)
    receiver = WeightReceiver(
        client, args.run_id, args.engine_id, apply, config=config, connect=connect, shard_layout=shard_layout
    )
    receiver.start()
    while not stop.wait(0.2):
        pass
    receiver.close()
    client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
