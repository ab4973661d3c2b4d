"""Measures a WeightPublisher's memory, as its own process (so nothing else moves its RSS):

    python publisher_memory_process.py --state-mib 96 --bucket-mib 16

Publishes two versions of a float32 state dict through the in-process broker to one engine that
acknowledges every round without reading (the publisher's memory does not depend on who reads).
Prints one JSON line: bucket_bytes, rounds, state_bytes and the peak RSS growth while publishing,
measured from just after the publisher was built (rss_growth_bytes) and from just before
(rss_growth_with_build_bytes: includes the bucket and the NIXL agent and gRPC server set-up).
"""

from __future__ import annotations

import argparse
import json
import os
import threading

import torch

from furlong.core.weight_versions import EventKind, RoundAck, VersionAck
from furlong.core.weights import WeightLayout
from furlong.transfer.config import TransferConfig
from furlong.transfer.publisher import WeightPublisher
from furlong.weight_broker.client import InProcessBrokerClient
from furlong.weight_broker.core import BrokerCore

RUN = "run-memory"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def acknowledging_engine(core: BrokerCore, stop: threading.Event) -> None:
    sub = core.subscribe(RUN, "engine")
    rounds = 0
    while not stop.is_set():
        event = sub.get(0.05)
        if event is None:
            continue
        if event.kind is EventKind.PUBLISHED:
            rounds = len(event.manifest.rounds)
        elif event.kind is EventKind.ROUND_READY:
            core.ack_round(RoundAck(RUN, "engine", event.version, event.round, True))
            if event.round == rounds - 1:
                core.ack_version(VersionAck(RUN, "engine", event.version, True))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--state-mib", type=int, required=True)
    parser.add_argument("--bucket-mib", type=int, required=True)
    parser.add_argument("--lanes", default="nixl,shm,grpc")
    args = parser.parse_args()
    per = 4 << 20
    state = {f"layer{i}": torch.randn(per // 4) for i in range((args.state_mib << 20) // per)}
    core = BrokerCore()
    core.register_engine(RUN, "engine")
    stop = threading.Event()
    engine = threading.Thread(target=acknowledging_engine, args=(core, stop), daemon=True)
    engine.start()
    client = InProcessBrokerClient(core)
    config = TransferConfig(bucket_size_bytes=args.bucket_mib << 20, lanes=tuple(args.lanes.split(",")))
    layout = WeightLayout.from_state_dict(state)
    before_build = rss_bytes()
    publisher = WeightPublisher(client, RUN, layout, "trainer-memory", config=config)
    before = rss_bytes()
    peak = before
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.001):
            peak = max(peak, rss_bytes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    rounds = 0
    for version in (1, 2):
        result = publisher.publish(version, state, commit_timeout_s=30.0)
        client.wait_committed(RUN, version, 30.0)
        rounds = result.num_rounds
    done.set()
    sampler.join()
    peak = max(peak, rss_bytes())
    print(
        json.dumps(
            {
                "bucket_bytes": publisher.bucket_size_bytes,
                "rounds": rounds,
                "state_bytes": publisher.layout.total_bytes,
                "rss_growth_bytes": peak - before,
                "rss_growth_with_build_bytes": peak - before_build,
            }
        )
    )
    stop.set()
    publisher.close()
    client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
