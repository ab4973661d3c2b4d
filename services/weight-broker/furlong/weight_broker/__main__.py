"""Run the weight broker service:

    python -m furlong.weight_broker --host 127.0.0.1 --port P --metrics-port M [--log-level INFO]
        [--max-ack-attempts N] [--ack-timeout-s S] [--relay-run RUN ...] [--relay-lanes L,...]
        [--auth-token-file F]
        [--tls-ca-file F --tls-cert-file F --tls-key-file F [--tls-server-name NAME]]

Serves furlong.v1.WeightBroker and grpc.health.v1 on host:port and Prometheus metrics on
host:metrics-port; relays the runs named by --relay-run (see furlong.weight_broker.relay); stops
cleanly on SIGTERM or SIGINT.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from prometheus_client import REGISTRY, start_http_server

from furlong import rpc
from furlong.rpc import start_server
from furlong.transfer.config import TransferConfig
from furlong.weight_broker.client import InProcessBrokerClient
from furlong.weight_broker.config import BrokerConfig
from furlong.weight_broker.fault_hooks import broker_core
from furlong.weight_broker.metrics import BrokerMetrics
from furlong.weight_broker.relay import WeightRelay
from furlong.weight_broker.server import SERVICE_NAME, WeightBrokerServicer

log = logging.getLogger("furlong.weight_broker")


def main(argv: Sequence[str] | None = None) -> int:
    config = BrokerConfig.from_args(argv)
    logging.basicConfig(level=config.logging_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not rpc.use_credentials(config.auth_token_file, config.tls):
        return 2
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda received, frame: stop.set())

    try:  # a test-only fault hook, off unless its variable is set (see fault_hooks)
        core = broker_core(
            os.environ,
            max_ack_attempts=config.max_ack_attempts,
            observer=BrokerMetrics(REGISTRY),
            ack_timeout_s=config.ack_timeout_s,
        )
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    servicer = WeightBrokerServicer(core)
    metrics_server, metrics_thread = start_http_server(
        config.metrics_port, addr=config.host, registry=REGISTRY
    )
    server = start_server(
        [servicer.add_to_server],
        [SERVICE_NAME],
        host=config.host,
        port=config.port,
        max_workers=config.max_workers,
    )
    log.info(
        "weight broker serving on %s:%d, metrics on %s:%d",
        config.host,
        server.port,
        config.host,
        metrics_server.server_port,
    )
    relay_client = InProcessBrokerClient(core)
    relays = []
    for run_id in config.relay_runs:
        relay = WeightRelay(
            relay_client,
            run_id,
            f"broker-relay-{run_id}-{os.getpid()}",
            config=TransferConfig(lanes=config.relay_lanes),
        )
        relay.start()
        relays.append(relay)

    while not stop.wait(0.5):
        pass
    log.info("weight broker stopping")
    for relay in relays:
        relay.close()
    relay_client.close()
    core.shutdown()  # end watch streams so that their handler threads return
    server.stop(grace_s=2.0)
    metrics_server.shutdown()
    metrics_server.server_close()
    metrics_thread.join(timeout=5.0)
    log.info("weight broker stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
