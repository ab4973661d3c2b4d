"""`python -m furlong.trainer`: the trainer service process (composition root)."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

import prometheus_client
import redis
import torch

from furlong import rpc
from furlong.rpc import start_server
from furlong.trainer.config import TrainerServiceConfig
from furlong.trainer.server import SERVICE_NAME, register
from furlong.trainer.service import TrainerService
from furlong.transfer.broker_client import GrpcBrokerClient

log = logging.getLogger("furlong.trainer")


def parse_args(argv: list[str] | None = None) -> TrainerServiceConfig:
    p = argparse.ArgumentParser(prog="python -m furlong.trainer", description="Furlong trainer service")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--metrics-port", type=int, default=0)
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
        "--auth-token-file",
        default="",
        help="file with the shared token every gRPC call (in and out) must carry",
    )
    rpc.add_tls_arguments(p)
    p.add_argument(
        "--check-weight-update-equal",
        action="store_true",
        help="before a run's first version, check that a weight sync rewrites every "
        "parameter bit for bit (fails the run's configuration if not)",
    )
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return TrainerServiceConfig(
            host=args.host,
            port=args.port,
            metrics_port=args.metrics_port,
            redis_url=args.redis_url,
            broker_address=args.broker,
            consumer_name=args.consumer_name,
            num_threads=args.num_threads,
            checkpoint_dir=args.checkpoint_dir,
            auth_token_file=args.auth_token_file,
            tls=rpc.TlsFiles(args.tls_ca_file, args.tls_cert_file, args.tls_key_file, args.tls_server_name),
            check_weight_update_equal=args.check_weight_update_equal,
        )
    except ValueError as exc:
        p.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    torch.set_num_threads(config.num_threads)
    if not rpc.use_credentials(config.auth_token_file, config.tls):
        return 2
    redis_client = redis.Redis.from_url(config.redis_url)
    broker = GrpcBrokerClient(config.broker_address)
    service = TrainerService(
        redis_client,
        broker,
        config.consumer_name,
        checkpoint_root=config.checkpoint_dir or None,
        check_weight_update_equal=config.check_weight_update_equal,
    )
    server = start_server([register(service)], [SERVICE_NAME], host=config.host, port=config.port)
    if config.metrics_port:
        prometheus_client.start_http_server(config.metrics_port, addr=config.host)
    log.info("trainer serving on %s:%d", config.host, server.port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    log.info("trainer shutting down")
    server.stop()
    service.close()
    broker.close()
    redis_client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
