"""How fast does a new policy version get from the trainer to the engines?

    python bench/weight_sync.py [--quick] [--json] [--size-mib N] [--bucket-mib N] [--reps N]

One trainer process (this one: a WeightPublisher) and two engine processes (WeightReceivers that
pull every version straight into their own parameter tensors), with the weight broker as a third
process.
bf16 parameters, 1 GiB by default (--quick: 32 MiB, same code paths). Measured in the same run, on
the same data, after a warm-up, as medians over --reps repetitions:

- memcpy_gbps: torch copy_ of the whole state, host to host, in this process; sampled before the
  raw read and before each lane's measurement, median of all samples (lowest and highest too).
- raw_nixl_seconds: one raw NIXL READ of the whole state from this process into an engine process.
- nixl_gbps / shm_gbps: per-engine pull rate of the broker pipeline over that lane (bytes and
  seconds the engines acknowledged, so both engines pulling at once share the machine).
- switch_seconds_<mode>: publish start -> both engines serving v+1 (the broker committed it, which
  it does only after every engine verified and applied it). Modes: direct (engines pull from the
  trainer's bucket) and relay (the broker pulls from the trainer, engines from the broker; the
  broker runs with --relay-lanes nixl, so its serving bucket is on huge pages).
- switch_seconds_direct_buffer: the same over NIXL with engines that pull into a receive buffer and
  copy it into their parameters (apply), the path before pulls went straight into parameters.
- trainer_free_seconds_<mode>: publish start -> the trainer's bucket may be reused (direct: the
  version committed; relay: the relay took it).
- switch_seconds_direct_concurrent / nixl_gbps_concurrent: direct over NIXL with the engines
  pulling at the same time (pull lock off) instead of taking turns (the default, see
  furlong.transfer.pull_lock); turns_vs_concurrent_switch compares the two switches. The two
  are measured twice each, in the order turns, at once, at once, turns; figures are the means.
- naive_seconds: torch.save -> bytes -> gRPC stream -> torch.load into ONE engine process.
- publish_rss_delta_bytes: peak growth of this process's RSS while publishing, against the bucket.

Prints one JSON object as its last line, like every bench/ script; never fails on a number.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch

from furlong.core.weight_versions import WeightSourceInfo
from furlong.core.weights import WeightLayout
from furlong.rpc import check_health, start_server
from furlong.rpc.ports import free_port
from furlong.transfer.broker_client import GrpcBrokerClient
from furlong.transfer.bucket import STREAM_SERVICE_NAME, WeightStreamServicer
from furlong.transfer.config import TransferConfig
from furlong.transfer.host_memory import host_buffer
from furlong.transfer.nixl_transport import NixlEndpoint
from furlong.transfer.publisher import WeightPublisher
from furlong.weight_broker.relay import upstream_run_id

MIB = 1 << 20
ENGINES = ("engine-0", "engine-1")
log = logging.getLogger("bench.weight_sync")


# -- child roles -------------------------------------------------------------------------------------


def engine_main(args) -> int:
    """A rollout engine stand-in: parameters in its own tensors (shaped like the trainer's), a
    WeightReceiver that pulls each version straight into them (--into params), or into a receive
    buffer that apply copies into them (--into buffer)."""
    from furlong.transfer.receiver import WeightReceiver

    model = {name: torch.zeros_like(t) for name, t in make_state(args.size, seed=None).items()}

    def copy_in(version, tensors) -> None:
        for name, tensor in tensors.items():
            model[name].copy_(tensor)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    client = GrpcBrokerClient(args.broker)
    config = TransferConfig(lanes=tuple(args.lanes.split(",")), pull_lock_wait_s=args.pull_lock_wait_s)
    if args.into == "params":
        receiver = WeightReceiver(
            client, args.run_id, args.engine_id, lambda v, t: None, config=config, params=model
        )
    else:
        receiver = WeightReceiver(client, args.run_id, args.engine_id, copy_in, config=config)
    receiver.start()
    while not stop.wait(0.2):
        pass
    receiver.close()
    client.close()
    return 0


def raw_main(args) -> int:
    """Raw NIXL READs of the whole region described in --meta into a registered buffer."""
    meta = json.loads(Path(args.meta).read_text())
    source = WeightSourceInfo(meta["agent"], bytes.fromhex(meta["metadata"]), meta["address"], meta["size"])
    endpoint = NixlEndpoint(f"raw-reader-{os.getpid()}")
    dst = host_buffer(meta["size"])
    endpoint.register(dst)
    times = [endpoint.read(source, dst, meta["size"], 120.0) for _ in range(args.reps + 1)]
    endpoint.close()
    Path(args.out).write_text(json.dumps(times[1:]))
    return 0


def naive_main(args) -> int:
    """Stream torch.save bytes over gRPC and torch.load them, --reps times after a warm-up."""
    import numpy as np

    from furlong.rpc import channel
    from furlong.v1 import weight_broker_pb2 as pb
    from furlong.v1 import weight_broker_pb2_grpc as pb_grpc

    stub = pb_grpc.WeightStreamStub(channel(args.address))
    times = []
    for _ in range(args.reps + 1):
        started = time.perf_counter()
        data = bytearray(args.size)
        view = np.frombuffer(data, dtype=np.uint8)
        for chunk in stub.ReadRange(
            pb.ReadRangeRequest(offset_bytes=0, size_bytes=args.size, chunk_bytes=MIB), timeout=300
        ):
            view[chunk.offset_bytes : chunk.offset_bytes + len(chunk.data)] = np.frombuffer(
                chunk.data, dtype=np.uint8
            )
        state = torch.load(io.BytesIO(data), weights_only=True)
        assert state
        times.append(time.perf_counter() - started)
    Path(args.out).write_text(json.dumps(times[1:]))
    return 0


# -- trainer side ------------------------------------------------------------------------------------


def make_state(size_bytes: int, seed: int | None = 0) -> dict[str, torch.Tensor]:
    """bf16 tensors of 32 MiB (2 MiB below 512 MiB); seed None: shapes only (zeros)."""
    per = 32 * MIB if size_bytes >= 512 * MIB else 2 * MIB
    cols = 1024 if per == 2 * MIB else 4096
    shape = (per // 2 // cols, cols)
    if seed is None:
        return {
            f"layers.{i}.weight": torch.zeros(shape, dtype=torch.bfloat16) for i in range(size_bytes // per)
        }
    gen = torch.Generator().manual_seed(seed)
    return {
        f"layers.{i}.weight": torch.randn(shape, generator=gen).to(torch.bfloat16)
        for i in range(size_bytes // per)
    }


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    def __init__(self) -> None:
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def child(role: str, *extra: str, log_path: Path) -> subprocess.Popen:
    # Engine parameters on transparent huge pages, like the buffers the broker allocates itself
    # (furlong.transfer.host_memory); the raw reference reads between such buffers too.
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1"}
    return subprocess.Popen(
        [sys.executable, __file__, "--role", role, *extra],
        stdout=open(log_path, "w"),
        stderr=subprocess.STDOUT,
        env=env,
    )


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached in {timeout_s} s")
        time.sleep(0.05)


def metric(metrics_port: int, series: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


class Memcpy:
    """memcpy of the whole state (torch copy_ per tensor, host to host, in this process). Sampled
    again before every measurement, since the rate of a shared host drifts during a run; the
    figure is the median of every sample, with the lowest and highest kept for the notes."""

    def __init__(self, state) -> None:
        self.state = state
        self.total = sum(t.numel() * t.element_size() for t in state.values())
        self.dst = {k: torch.empty_like(v) for k, v in state.items()}
        self.times: list[float] = []

    def sample(self, reps: int) -> None:
        for rep in range(reps + 1):
            started = time.perf_counter()
            for k, v in self.state.items():
                self.dst[k].copy_(v)
            if rep:  # the first copy warms up
                self.times.append(time.perf_counter() - started)

    def gbps(self, pick=statistics.median) -> float:
        return self.total / pick(self.times) / 1e9


def measure_raw(size: int, reps: int, tmp: Path) -> float:
    endpoint = NixlEndpoint(f"raw-source-{os.getpid()}")
    src = host_buffer(size)
    src.copy_(torch.randint(0, 255, (size,), dtype=torch.uint8))
    endpoint.register(src)
    meta = tmp / "raw.json"
    meta.write_text(
        json.dumps(
            {
                "agent": endpoint.agent_name,
                "metadata": endpoint.metadata.hex(),
                "address": src.data_ptr(),
                "size": size,
            }
        )
    )
    proc = child(
        "raw",
        "--meta",
        str(meta),
        "--reps",
        str(reps),
        "--out",
        str(tmp / "raw.out"),
        log_path=tmp / "raw.log",
    )
    proc.wait(600)
    endpoint.close()
    return statistics.median(json.loads((tmp / "raw.out").read_text()))


def measure_naive(state, reps: int, tmp: Path) -> float:
    save_times = []
    blob = b""
    for _ in range(reps + 1):
        started = time.perf_counter()
        buf = io.BytesIO()
        torch.save(state, buf)
        blob = buf.getvalue()
        save_times.append(time.perf_counter() - started)
    data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    server = start_server([WeightStreamServicer(data).add_to_server], [STREAM_SERVICE_NAME], max_workers=4)
    proc = child(
        "naive",
        "--address",
        f"127.0.0.1:{server.port}",
        "--size",
        str(len(blob)),
        "--reps",
        str(reps),
        "--out",
        str(tmp / "naive.out"),
        log_path=tmp / "naive.log",
    )
    proc.wait(900)
    server.stop(0.5)
    return statistics.median(save_times[1:]) + statistics.median(json.loads((tmp / "naive.out").read_text()))


def measure_lane(
    lane: str,
    mode: str,
    state,
    args,
    broker: str,
    metrics_port: int,
    tmp: Path,
    into: str = "params",
    pull_lock: bool = True,
    tag: str = "",
) -> dict:
    run_id = (
        f"bench-{lane}-{mode}"
        + ("" if into == "params" else f"-{into}")
        + ("" if pull_lock else "-concurrent")
        + tag
    )
    publish_run = upstream_run_id(run_id) if mode == "relay" else run_id
    engines = [
        child(
            "engine",
            "--broker",
            broker,
            "--run-id",
            run_id,
            "--engine-id",
            e,
            "--lanes",
            lane,
            "--size",
            str(len_bytes(state)),
            "--into",
            into,
            "--pull-lock-wait-s",
            "5" if pull_lock else "0",
            log_path=tmp / f"{run_id}-{e}.log",
        )
        for e in ENGINES
    ]
    client = GrpcBrokerClient(broker)
    publisher = None
    try:
        wait_for(lambda: _engines(client, run_id) == ENGINES, 120.0, "engines registered")
        rss_before = rss_bytes()
        config = TransferConfig(
            bucket_size_bytes=args.bucket_mib * MIB,
            lanes=(lane,),
            round_timeout_s=300.0,
            transfer_timeout_s=300.0,
        )
        publisher = WeightPublisher(
            client, publish_run, WeightLayout.from_state_dict(state), f"bench-trainer-{run_id}", config=config
        )
        bytes0 = seconds0 = 0.0
        switch, free = [], []
        with PeakRss() as peak:
            for version in range(1, args.reps + 2):
                if version == 2:  # version 1 warmed up connections and buffers
                    bytes0 = metric(metrics_port, f'furlong_broker_transfer_bytes_total{{lane="{lane}"}}')
                    seconds0 = metric(metrics_port, f'furlong_broker_transfer_seconds_total{{lane="{lane}"}}')
                started = time.perf_counter()
                publisher.publish(version, state, commit_timeout_s=300.0)
                client.wait_committed(publish_run, version, 300.0)
                free.append(time.perf_counter() - started)  # the trainer may move on
                client.wait_committed(run_id, version, 300.0)
                switch.append(time.perf_counter() - started)
        moved = metric(metrics_port, f'furlong_broker_transfer_bytes_total{{lane="{lane}"}}') - bytes0
        spent = metric(metrics_port, f'furlong_broker_transfer_seconds_total{{lane="{lane}"}}') - seconds0
        return {
            "switch_seconds": statistics.median(switch[1:]),
            "trainer_free_seconds": statistics.median(free[1:]),
            "per_engine_gbps": moved / spent / 1e9 if spent else 0.0,
            "rss_delta_bytes": peak.peak - rss_before,
            "bucket_bytes": publisher.bucket_size_bytes,
        }
    finally:
        if publisher is not None:
            publisher.close()
        for proc in engines:
            proc.send_signal(signal.SIGTERM)
        for proc in engines:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        client.end_run(run_id)
        client.close()


def combine(results: list[dict]) -> dict:
    """Several measure_lane results of one configuration: means, and the largest memory growth."""
    out = {
        key: statistics.mean(r[key] for r in results)
        for key in ("switch_seconds", "trainer_free_seconds", "per_engine_gbps")
    }
    out["rss_delta_bytes"] = max(r["rss_delta_bytes"] for r in results)
    out["bucket_bytes"] = results[0]["bucket_bytes"]
    return out


def len_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _engines(client: GrpcBrokerClient, run_id: str) -> tuple[str, ...]:
    try:
        return client.get_version(run_id).engine_ids
    except Exception:  # noqa: BLE001 - the run exists once the first engine registers
        return ()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument("--size-mib", type=int, default=None)
    parser.add_argument("--bucket-mib", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--role", default="main")
    parser.add_argument("--broker"), parser.add_argument("--run-id"), parser.add_argument("--engine-id")
    parser.add_argument("--lanes"), parser.add_argument("--meta"), parser.add_argument("--out")
    parser.add_argument("--address"), parser.add_argument("--size", type=int)
    parser.add_argument("--into", choices=("params", "buffer"), default="params")
    parser.add_argument("--pull-lock-wait-s", type=float, default=5.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    if args.role != "main":
        return {"engine": engine_main, "raw": raw_main, "naive": naive_main}[args.role](args)
    args.size_mib = args.size_mib or (32 if args.quick else 1024)
    args.bucket_mib = args.bucket_mib or (8 if args.quick else 256)
    args.reps = args.reps or (2 if args.quick else 3)
    size = args.size_mib * MIB
    state = make_state(size)
    with tempfile.TemporaryDirectory(prefix="weight-sync-") as tmpdir:
        tmp = Path(tmpdir)
        port, metrics_port = free_port(), free_port()
        broker_proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "furlong.weight_broker",
                "--port",
                str(port),
                "--metrics-port",
                str(metrics_port),
                "--log-level",
                "WARNING",
                "--relay-run",
                "bench-nixl-relay",
                "--relay-lanes",
                "nixl",
            ],
            stdout=open(tmp / "broker.log", "w"),
            stderr=subprocess.STDOUT,
        )
        broker = f"127.0.0.1:{port}"
        try:
            wait_for(lambda: check_health(broker), 60.0, "broker serving")
            memcpy = Memcpy(state)
            memcpy.sample(args.reps)
            raw_s = measure_raw(size, args.reps, tmp)
            lanes = {}
            # Taking turns against pulling at once, in the order A B B A so that a drift of the
            # host during the run hits both alike; each figure is the mean of its two runs.
            memcpy.sample(args.reps)
            runs: dict[bool, list[dict]] = {True: [], False: []}
            for i, lock in enumerate((True, False, False, True)):
                runs[lock].append(
                    measure_lane(
                        "nixl", "direct", state, args, broker, metrics_port, tmp, pull_lock=lock, tag=f"-{i}"
                    )
                )
            lanes["nixl"], concurrent = combine(runs[True]), combine(runs[False])
            memcpy.sample(args.reps)
            lanes["shm"] = measure_lane("shm", "direct", state, args, broker, metrics_port, tmp)
            memcpy.sample(args.reps)
            relay = measure_lane("nixl", "relay", state, args, broker, metrics_port, tmp)
            buffered = measure_lane("nixl", "direct", state, args, broker, metrics_port, tmp, into="buffer")
            naive_s = measure_naive(state, args.reps, tmp)
            memcpy_gbps = memcpy.gbps()
        finally:
            broker_proc.send_signal(signal.SIGTERM)
            broker_proc.wait(30)
    direct = lanes["nixl"]
    result = {
        "bench": "weight_sync",
        "machine": {"cpus": os.cpu_count(), "gpu": None},
        "params": {
            "size_bytes": size,
            "engines": len(ENGINES),
            "dtype": "bfloat16",
            "bucket_bytes": direct["bucket_bytes"],
            "reps": args.reps,
        },
        "metrics": {
            "memcpy_gbps": round(memcpy_gbps, 3),
            "memcpy_gbps_lowest": round(memcpy.gbps(max), 3),
            "memcpy_gbps_highest": round(memcpy.gbps(min), 3),
            "raw_nixl_seconds": round(raw_s, 4),
            "raw_nixl_gbps": round(size / raw_s / 1e9, 3),
            "nixl_gbps": round(lanes["nixl"]["per_engine_gbps"], 3),
            "shm_gbps": round(lanes["shm"]["per_engine_gbps"], 3),
            "switch_seconds_direct": round(direct["switch_seconds"], 4),
            "switch_seconds_direct_shm": round(lanes["shm"]["switch_seconds"], 4),
            "switch_seconds_relay": round(relay["switch_seconds"], 4),
            "switch_seconds_direct_buffer": round(buffered["switch_seconds"], 4),
            "nixl_gbps_buffer": round(buffered["per_engine_gbps"], 3),
            "switch_seconds_direct_concurrent": round(concurrent["switch_seconds"], 4),
            "nixl_gbps_concurrent": round(concurrent["per_engine_gbps"], 3),
            "trainer_free_seconds_direct": round(direct["trainer_free_seconds"], 4),
            "trainer_free_seconds_relay": round(relay["trainer_free_seconds"], 4),
            "naive_seconds": round(naive_s, 4),
            "publish_rss_delta_bytes": direct["rss_delta_bytes"],
        },
        "ratios": {
            "nixl_vs_memcpy": round(lanes["nixl"]["per_engine_gbps"] / memcpy_gbps, 3),
            "shm_vs_memcpy": round(lanes["shm"]["per_engine_gbps"] / memcpy_gbps, 3),
            "raw_vs_switch": round(raw_s / direct["switch_seconds"], 3),
            "raw_vs_switch_relay": round(raw_s / relay["switch_seconds"], 3),
            "params_vs_buffer_switch": round(buffered["switch_seconds"] / direct["switch_seconds"], 3),
            "turns_vs_concurrent_switch": round(concurrent["switch_seconds"] / direct["switch_seconds"], 3),
            "vs_naive": round(naive_s / direct["switch_seconds"], 3),
            "vs_naive_relay": round(naive_s / relay["switch_seconds"], 3),
            "publish_mem_vs_bucket": round(direct["rss_delta_bytes"] / direct["bucket_bytes"], 3),
        },
        "notes": (
            "bf16 state, one trainer process -> two engine processes, broker as a process; "
            "medians of reps after one warm-up. Engines pull straight into their parameters "
            "(direct_buffer: into a receive buffer plus an apply copy, for comparison). "
            "nixl/shm_gbps: per-engine rate from the "
            "engines' acknowledged bytes and seconds of their pulls; engines on one host take "
            "turns pulling (host pull lock), except in the _concurrent figures. switch: publish "
            "start -> broker commit (both engines verified and applied v+1). raw: one NIXL READ "
            "of the whole state into one engine process. naive: torch.save + gRPC stream + "
            "torch.load into one engine. publish_mem_vs_bucket: peak RSS growth of the "
            "trainer while publishing / bucket bytes (lower is better)."
        ),
    }
    if not args.json:
        for key, value in {**result["metrics"], **result["ratios"]}.items():
            print(f"{key:28s} {value}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
