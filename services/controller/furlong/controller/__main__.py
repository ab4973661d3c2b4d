"""`python -m furlong.controller`: the controller process (REST API + run executor).

Reads the bearer token from --token-file, connects to Redis and the three gRPC services, recovers
runs a previous process left behind, and serves until SIGINT/SIGTERM; then asks the active run to
stop and waits for its teardown.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from furlong import rpc
from furlong.core.errors import FurlongError

from furlong.controller.clients import (BROKER_SERVICE, ROLLOUT_SERVICE, TRAINER_SERVICE,
                                        GrpcBrokerClient, GrpcRolloutClient, GrpcTrainerClient)
from furlong.controller.config import ControllerConfig
from furlong.controller.prompt_source import TaskPromptSource
from furlong.controller.run_store import RunStore
from furlong.controller.server import HttpServer, build_controller

log = logging.getLogger("furlong.controller")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m furlong.controller", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--trainer", required=True, help="host:port of the trainer")
    p.add_argument("--rollout", required=True, help="host:port of the rollout service")
    p.add_argument("--broker", required=True, help="host:port of the weight broker")
    p.add_argument("--token-file", required=True, type=Path,
                   help="file holding the bearer token /v1 requests must present")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def load_config(args: argparse.Namespace) -> ControllerConfig:
    try:
        token = args.token_file.read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read --token-file {args.token_file}: {exc}") from None
    return ControllerConfig(host=args.host, port=args.port, redis_url=args.redis_url,
                            trainer=args.trainer, rollout=args.rollout, broker=args.broker,
                            token=token)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    log.info("starting with %r", config)
    store = RunStore.from_url(config.redis_url)
    trainer = GrpcTrainerClient(config.trainer)
    rollout = GrpcRolloutClient(config.rollout)
    broker = GrpcBrokerClient(config.broker)

    def readiness() -> dict[str, bool]:
        return {
            "redis": store.ping(),
            "trainer": rpc.check_health(config.trainer, TRAINER_SERVICE),
            "rollout": rpc.check_health(config.rollout, ROLLOUT_SERVICE),
            "broker": rpc.check_health(config.broker, BROKER_SERVICE),
        }

    try:
        controller = build_controller(store, trainer, rollout, broker, TaskPromptSource(),
                                      config.token, readiness, config.timeouts)
    except FurlongError as exc:
        log.error("cannot start: %s", exc)
        return 1
    server = HttpServer(controller.app, config.host, config.port, log_level="warning")
    log.info("serving the REST API on %s", server.url)
    try:
        server.serve()
    finally:
        controller.close()
        for client in (trainer, rollout, broker):
            client.close()
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
