"""`python -m furlong.trainer`: the trainer service process (composition root).

Serves furlong.v1.Trainer and grpc.health.v1 on --host:--port and Prometheus metrics on
--metrics-port. On SIGTERM or SIGINT it reports NOT_SERVING and refuses new calls, lets the calls in
flight (a training step, a publish) finish within --shutdown-grace-s, then ends its runs and exits
(`furlong.service_main`).

Under torchrun (`torchrun --nproc-per-node N -m furlong.trainer ...`: RANK and WORLD_SIZE set) every
rank joins the job's process group (gloo on CPU, NCCL on CUDA, each rank on `cuda:LOCAL_RANK` when
--device is cuda). Rank 0 serves as above and drives the others (`furlong.trainer.ranks`); every
other rank serves nothing and runs `furlong.trainer.rank_follower` until rank 0 shuts it down.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence

import redis
import torch

from furlong.core.devices import parse_device
from furlong.rpc import start_server
from furlong.rpc.service_main import (
    add_credential_flags,
    credential_fields,
    drain_on_shutdown,
    install_credentials,
)
from furlong.service_main import PortOption, ServiceCommand, ServiceFlags, start
from furlong.service_main.command import configure_logging
from furlong.trainer import ranks as trainer_ranks
from furlong.trainer.config import TrainerServiceConfig
from furlong.trainer.metrics import TrainerMetrics
from furlong.trainer.rank_follower import RankFollower
from furlong.trainer.run_learner import DEFAULT_MICRO_BATCH_TOKENS, LearnerMemory
from furlong.trainer.server import SERVICE_NAME, register
from furlong.trainer.service import TrainerService
from furlong.transfer.broker_client import GrpcBrokerClient
from furlong.transfer.config import TransferConfig
from furlong.transfer.publisher import WeightPublisher

log = logging.getLogger("furlong.trainer")
_PR_SET_PDEATHSIG = 1


def command() -> ServiceCommand:
    """The trainer's command line: the shared flags and its own."""
    cmd = ServiceCommand(
        "python -m furlong.trainer",
        "Furlong trainer service",
        port=PortOption(default=0),
        metrics_port=PortOption(default=0),
    )
    p = cmd.parser
    p.add_argument("--redis-url", required=True)
    p.add_argument("--broker", required=True, help="weight broker HOST:PORT")
    p.add_argument("--consumer-name", default="trainer-0")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument(
        "--checkpoint-dir",
        default="",
        help="write a training checkpoint per step under DIR/<run_id> and resume from it",
    )
    p.add_argument(
        "--policy-dir",
        default="",
        help="write a run's exported policies (Hugging Face directories) under DIR/<run_id>: "
        "final/ and checkpoints/step-N/",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="where runs' models train: cpu, cuda or cuda:N (default cpu); a run's precision "
        "(run spec) sets the compute dtype",
    )
    p.add_argument(
        "--weight-bucket-device",
        default="cpu",
        help="where each run's weight staging bucket lives: cpu (default: host memory, offered on "
        "every lane) or cuda / cuda:N (GPU memory, offered over the nixl and cuda_ipc lanes only; "
        "cuda is this rank's device under torchrun)",
    )
    p.add_argument(
        "--lm-head-chunk-tokens",
        type=int,
        default=1024,
        help="tokens per chunk of the LM head in training: log-probs and entropy are taken a chunk "
        "at a time, so the tokens x vocabulary logits never exist (default 1024)",
    )
    p.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=DEFAULT_MICRO_BATCH_TOKENS,
        help="0 (default): padded micro-batches of the run's micro_batch_size rows; N > 0: packed "
        "micro-batches (no padding) of at most N tokens and micro_batch_size rows, balanced by tokens",
    )
    add_credential_flags(p)
    p.add_argument(
        "--check-weight-update-equal",
        action="store_true",
        help="before a run's first version, check that a weight sync rewrites every "
        "parameter bit for bit (fails the run's configuration if not)",
    )
    return cmd


def _config(args: argparse.Namespace, flags: ServiceFlags) -> TrainerServiceConfig:
    return TrainerServiceConfig(
        host=flags.host,
        port=flags.port,
        metrics_port=flags.served_metrics_port,
        redis_url=args.redis_url,
        broker_address=args.broker,
        consumer_name=args.consumer_name,
        num_threads=args.num_threads,
        checkpoint_dir=args.checkpoint_dir,
        policy_dir=args.policy_dir,
        check_weight_update_equal=args.check_weight_update_equal,
        device=args.device,
        weight_bucket_device=args.weight_bucket_device,
        lm_head_chunk_tokens=args.lm_head_chunk_tokens,
        micro_batch_tokens=args.micro_batch_tokens,
        **credential_fields(args),
    )


def parse_args(argv: Sequence[str] | None = None) -> TrainerServiceConfig:
    """The trainer's config from a command line (exits with status 2 on a bad value)."""
    return command().parse(argv, _config)[0]


def rank_device(device: str, env: Mapping[str, str]) -> torch.device:
    """This rank's device: `cuda` means `cuda:LOCAL_RANK` under torchrun; any other is taken as
    it is."""
    parsed = parse_device(device)
    assert parsed is not None  # a device was named
    if parsed.type == "cuda" and parsed.index is None and "LOCAL_RANK" in env:
        return torch.device("cuda", int(env["LOCAL_RANK"]))
    return parsed


def _end_with_the_agent() -> None:
    """SIGTERM from the kernel when torchrun's agent (this rank's parent) dies, even by SIGKILL:
    the agent puts each rank in a session of its own, so a signal to the agent's process group
    does not reach the ranks. Linux only (elsewhere a warning)."""
    if not sys.platform.startswith("linux"):
        log.warning("no parent-death signal on %s: a rank outlives a killed torchrun agent", sys.platform)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() == 1:  # the agent died before the prctl
        raise SystemExit("torchrun's agent is gone; this rank exits")


def _join_ranks(device: torch.device) -> trainer_ranks.TrainerRanks | None:
    if "WORLD_SIZE" not in os.environ:  # not started by torchrun: one rank
        return None
    _end_with_the_agent()
    return trainer_ranks.join("nccl" if device.type == "cuda" else "gloo")


def main(argv: Sequence[str] | None = None) -> int:
    cmd = command()
    config, flags = cmd.parse(argv, _config)
    device = rank_device(config.device, os.environ)
    ranks = _join_ranks(device)
    if ranks is not None and not ranks.is_leader:
        configure_logging(flags.log_level)
        torch.set_num_threads(config.num_threads)
        # torchrun's agent sends SIGTERM to every rank when the job stops: a follower finishes
        # the command under way (rank 0 may be waiting for it), then leaves.
        stopping = threading.Event()
        signal.signal(signal.SIGTERM, lambda _signum, _frame: stopping.set())
        memory = LearnerMemory(config.lm_head_chunk_tokens, config.micro_batch_tokens)
        return RankFollower(ranks, device, stopping.is_set, memory).serve()
    runtime = start("trainer", flags)
    cmd.check(lambda: install_credentials(config.auth_token_file, config.tls))
    torch.set_num_threads(config.num_threads)
    # checked when parsed (parse_device: a CUDA device this machine has)
    transfer = TransferConfig(device=str(rank_device(config.weight_bucket_device, os.environ)))
    redis_client = redis.Redis.from_url(config.redis_url)
    broker = GrpcBrokerClient(config.broker_address)
    service = TrainerService(
        redis_client,
        broker,
        config.consumer_name,
        checkpoint_root=config.checkpoint_dir or None,
        policy_root=config.policy_dir or None,
        check_weight_update_equal=config.check_weight_update_equal,
        metrics=TrainerMetrics(runtime.registry),
        device=device,
        ranks=ranks,
        lm_head_chunk_tokens=config.lm_head_chunk_tokens,
        micro_batch_tokens=config.micro_batch_tokens,
        publisher_factory=functools.partial(WeightPublisher, config=transfer),
    )
    server = start_server([register(service)], [SERVICE_NAME], host=config.host, port=config.port)
    metrics = runtime.serve_metrics()
    log.info(
        "trainer serving on %s:%d, metrics on %s:%d", config.host, server.port, config.host, metrics.port
    )
    drain_on_shutdown(runtime.shutdown, server)
    runtime.shutdown.add_close("runs", service)
    if ranks is not None:
        runtime.shutdown.add("follower ranks", lambda _seconds: ranks.shutdown())
    runtime.shutdown.add_close("broker client", broker)
    runtime.shutdown.add_close("Redis client", redis_client)
    return runtime.serve_until_stopped()


if __name__ == "__main__":
    sys.exit(main())
