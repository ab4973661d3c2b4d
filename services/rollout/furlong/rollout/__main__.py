"""Run the rollout service:

    python -m furlong.rollout --host 127.0.0.1 --port P --metrics-port M --redis-url URL \
        --broker HOST:PORT [--num-threads 2] [--max-batch-size 256] [--max-support-size 0]
        [--user-reward NAME=MODULE:FN ...] [--reward-timeout-s 60] [--reward-workers 4]
        [--engines inprocess|process] [--engine-threads 1] [--engine-max-batch-size 64]
        [--chunk-rows 8] [--engine-work-dir DIR]
        [--log-level INFO] [--auth-token-file F] [--tls-ca-file F --tls-cert-file F --tls-key-file F
        [--tls-server-name NAME]]

Serves furlong.v1.Rollout and grpc.health.v1 on host:port and Prometheus metrics on
host:metrics-port; on SIGTERM or SIGINT ends every run (closing its weight receivers) and exits.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Sequence

import redis
import torch
from prometheus_client import REGISTRY, start_http_server

from furlong import rpc
from furlong.rollout.config import ENGINES_PROCESS, RolloutServerConfig
from furlong.rollout.core.sampling import SupportBound
from furlong.rollout.core.service import RolloutService
from furlong.rollout.metrics import RolloutMetrics
from furlong.rollout.process_engines import ProcessEnginesConfig, process_factory
from furlong.rollout.receivers import broker_receiver_factory
from furlong.rollout.rewards import resolve_user_reward, reward_registry
from furlong.rollout.run_records import redis_records
from furlong.rollout.server import SERVICE_NAME, RolloutServicer
from furlong.rpc import start_server
from furlong.transfer.broker_client import GrpcBrokerClient

log = logging.getLogger("furlong.rollout")


def main(argv: Sequence[str] | None = None) -> int:
    config = RolloutServerConfig.from_args(argv)
    logging.basicConfig(level=config.logging_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(config.num_threads)
    if not rpc.use_credentials(config.auth_token_file, config.tls):
        return 2
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda received, frame: stop.set())

    redis_client = redis.Redis.from_url(config.redis_url)
    broker = GrpcBrokerClient(config.broker_address)
    metrics = RolloutMetrics(REGISTRY)
    receivers = broker_receiver_factory(broker)
    engines = None
    if config.engines == ENGINES_PROCESS:
        engines = process_factory(
            ProcessEnginesConfig(
                max_batch_size=config.engine_max_batch_size,
                num_threads=config.engine_threads,
                chunk_rows=config.chunk_rows,
                work_root=config.engine_work_dir,
            ),
            receivers,
            metrics,
        )
    service = RolloutService(
        redis_records(redis_client),
        receivers,
        engines=engines,
        max_batch_size=config.max_batch_size,
        observer=metrics,
        support_bound=SupportBound(max_size=config.max_support_size),
        rewards=reward_registry(
            {name: resolve_user_reward(reference) for name, reference in config.user_rewards}
        ),
        reward_timeout_s=config.reward_timeout_s,
        reward_workers=config.reward_workers,
    )
    metrics.watch_engines(service.status)
    metrics_server, metrics_thread = start_http_server(
        config.metrics_port, addr=config.host, registry=REGISTRY
    )
    server = start_server(
        [RolloutServicer(service).add_to_server],
        [SERVICE_NAME],
        host=config.host,
        port=config.port,
        max_workers=config.max_workers,
    )
    log.info(
        "rollout serving on %s:%d, metrics on %s:%d, broker %s, %d torch thread(s), engines %s",
        config.host,
        server.port,
        config.host,
        metrics_server.server_port,
        config.broker_address,
        config.num_threads,
        config.engines,
    )

    while not stop.wait(0.5):
        pass
    log.info("rollout stopping")
    server.stop(grace_s=2.0)
    service.close()
    broker.close()
    redis_client.close()
    metrics_server.shutdown()
    metrics_server.server_close()
    metrics_thread.join(timeout=5.0)
    log.info("rollout stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
