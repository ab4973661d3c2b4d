"""Run the rollout service:

    python -m furlong.rollout --host 127.0.0.1 --port P --metrics-port M --redis-url URL \
        --broker HOST:PORT [--num-threads 2] [--max-batch-size 256] [--max-support-size 0]
        [--user-reward NAME=MODULE:FN ...] [--reward-timeout-s 60] [--reward-workers 4]
        [--engines inprocess|process] [--engine-threads 1] [--engine-max-batch-size 64]
        [--chunk-rows 8] [--engine-work-dir DIR] [--gateway-port P]
        [--sglang-command CMD] [--sglang-arg ARG ...]
        [--weight-route auto|disk|tensor|distributed] [--weight-group-address HOST] [--replica-id K]
        [--device cpu|cuda|cuda:N] [--weight-buffer-device cpu|cuda|cuda:N]
        [--log-level INFO] [--shutdown-grace-s 10] [--auth-token-file F]
        [--tls-ca-file F --tls-cert-file F --tls-key-file F [--tls-server-name NAME]]

Serves furlong.v1.Rollout and grpc.health.v1 on host:port and Prometheus metrics on
host:metrics-port; with --gateway-port, also the OpenAI-compatible gateway over the configured runs'
engines (`furlong.rollout.gateway`, model = run id), logging `rollout gateway on URL` with its base
URL. On SIGTERM or SIGINT it reports NOT_SERVING and refuses new calls, lets the
Generate calls in flight finish within --shutdown-grace-s, then ends every run (closing its weight
receivers and engine processes) and exits (`furlong.service_main`).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import redis
import torch

from furlong.rollout.agents import agent_harness
from furlong.rollout.config import ENGINES_PROCESS, RolloutServerConfig
from furlong.rollout.core.engine_set import in_process_factory
from furlong.rollout.core.sampling import SupportBound
from furlong.rollout.core.service import RolloutService
from furlong.rollout.environment_workers import environment_pool
from furlong.rollout.metrics import RolloutMetrics
from furlong.rollout.process_engines import ProcessEnginesConfig, engine_factory, process_factory
from furlong.rollout.receivers import service_receiver_factory
from furlong.rollout.rewards import resolve_user_reward, reward_registry
from furlong.rollout.run_records import redis_records
from furlong.rollout.run_reward import build_run_reward
from furlong.rollout.server import SERVICE_NAME, RolloutServicer
from furlong.rpc import start_server
from furlong.rpc.service_main import drain_on_shutdown, install_credentials
from furlong.service_main import ServiceCommand, start
from furlong.service_main.http_server import HttpServer
from furlong.transfer.broker_client import GrpcBrokerClient

log = logging.getLogger("furlong.rollout")


def command() -> ServiceCommand:
    """The service's command line (`RolloutServerConfig.command`)."""
    return RolloutServerConfig.command()


def start_gateway(service: RolloutService, host: str, port: int) -> HttpServer:
    """The OpenAI-compatible gateway over the service's runs, serving on host:port."""
    from furlong.rollout.gateway.app import create_app
    from furlong.rollout.gateway.calls import Gateway
    from furlong.rollout.gateway.run_models import RunModels

    return HttpServer(create_app(Gateway(RunModels(service))), host, port).start()


def main(argv: Sequence[str] | None = None) -> int:
    cmd = command()
    config, flags = cmd.parse(argv, RolloutServerConfig.from_namespace)
    runtime = start("rollout", flags)
    cmd.check(lambda: install_credentials(config.auth_token_file, config.tls))
    torch.set_num_threads(config.num_threads)
    redis_client = redis.Redis.from_url(config.redis_url)
    broker = GrpcBrokerClient(config.broker_address)
    rewards = cmd.check(  # --user-reward callables are imported and checked here
        lambda: reward_registry(
            {name: resolve_user_reward(reference) for name, reference in config.user_rewards}
        )
    )
    metrics = RolloutMetrics(runtime.registry)
    receivers = service_receiver_factory(broker, config)  # buffers on --weight-buffer-device
    support_bound = SupportBound(max_size=config.max_support_size)
    processes = ProcessEnginesConfig(
        max_batch_size=config.engine_max_batch_size,
        num_threads=config.engine_threads,
        chunk_rows=config.chunk_rows,
        work_root=config.engine_work_dir,
        sglang_command=config.sglang_command,
        sglang_args=config.sglang_args,
        weight_route=config.weight_route,
        weight_group_address=config.weight_group_address,
        replica_id=config.replica_id,
    )
    builtin = (
        process_factory(processes, receivers, metrics)
        if config.engines == ENGINES_PROCESS
        else in_process_factory(
            max_batch_size=config.max_batch_size,
            support_bound=support_bound,
            receiver_factory=receivers,
            observer=metrics,
            replica_id=config.replica_id,
        )
    )
    # SGLang engines are always processes (or running servers), whatever --engines says
    engines = engine_factory(builtin, process_factory(processes, receivers, metrics))
    service = RolloutService(
        redis_records(redis_client),
        receivers,
        engines=engines,
        max_batch_size=config.max_batch_size,
        observer=metrics,
        support_bound=support_bound,
        rewards=rewards,
        reward_timeout_s=config.reward_timeout_s,
        reward_workers=config.reward_workers,
        device=config.device,
        run_rewards=build_run_reward,
        run_environments=environment_pool,
        run_agents=agent_harness,
        replica_id=config.replica_id,
    )
    metrics.watch_engines(service.status)
    metrics_endpoint = runtime.serve_metrics()
    server = start_server(
        [RolloutServicer(service).add_to_server],
        [SERVICE_NAME],
        host=config.host,
        port=config.port,
        max_workers=config.max_workers,
    )
    log.info(
        "rollout serving on %s:%d, metrics on %s:%d, broker %s, %d torch thread(s), engines %s, "
        "weight buffers on %s",
        config.host,
        server.port,
        config.host,
        metrics_endpoint.port,
        config.broker_address,
        config.num_threads,
        config.engines,
        config.weight_buffer_device,
    )

    drain_on_shutdown(runtime.shutdown, server)
    if config.gateway_port is not None:
        gateway = start_gateway(service, config.host, config.gateway_port)
        log.info("rollout gateway on %s/v1", gateway.url)
        runtime.shutdown.add("OpenAI-compatible gateway", gateway.stop)
    runtime.shutdown.add_close("runs and engines", service)
    runtime.shutdown.add_close("broker client", broker)
    runtime.shutdown.add_close("Redis client", redis_client)
    return runtime.serve_until_stopped()


if __name__ == "__main__":
    sys.exit(main())
