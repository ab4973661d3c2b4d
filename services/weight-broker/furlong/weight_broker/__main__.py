"""Run the weight broker service:

    python -m furlong.weight_broker --host 127.0.0.1 --port P --metrics-port M [--log-level INFO]
        [--shutdown-grace-s 10] [--max-ack-attempts N] [--ack-timeout-s S] [--relay-run RUN ...]
        [--relay-lanes L,...] [--auth-token-file F]
        [--tls-ca-file F --tls-cert-file F --tls-key-file F [--tls-server-name NAME]]
        [--enable-fault-hooks]

Serves furlong.v1.WeightBroker and grpc.health.v1 on host:port and Prometheus metrics on
host:metrics-port; relays the runs named by --relay-run (see furlong.weight_broker.relay). On
SIGTERM or SIGINT it reports NOT_SERVING and refuses new calls, ends the engines' watch streams,
lets the calls in flight finish within --shutdown-grace-s, closes its relays and exits
(`furlong.service_main`). `--enable-fault-hooks` (tests only) installs the fault-injection hooks
of `furlong.weight_broker.fault_hooks`; without it their variables are ignored.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from furlong.rpc import start_server
from furlong.rpc.service_main import install_credentials
from furlong.service_main import ServiceCommand, start
from furlong.transfer.config import TransferConfig
from furlong.weight_broker import fault_hooks
from furlong.weight_broker.client import InProcessBrokerClient
from furlong.weight_broker.config import BrokerConfig
from furlong.weight_broker.core import BrokerCore, BrokerObserver
from furlong.weight_broker.metrics import BrokerMetrics
from furlong.weight_broker.relay import WeightRelay
from furlong.weight_broker.server import SERVICE_NAME, WeightBrokerServicer

log = logging.getLogger("furlong.weight_broker")


def command() -> ServiceCommand:
    """The service's command line (`BrokerConfig.command`)."""
    return BrokerConfig.command()


def broker_core(config: BrokerConfig, observer: BrokerObserver, environ: Mapping[str, str]) -> BrokerCore:
    """The broker's core. The fault hooks are installed only with --enable-fault-hooks (then from
    their environment variables in environ); without it a plain BrokerCore, whatever environ
    holds. ValueError naming a bad hook variable."""
    kwargs: dict[str, Any] = dict(
        max_ack_attempts=config.max_ack_attempts, observer=observer, ack_timeout_s=config.ack_timeout_s
    )
    if config.fault_hooks:
        log.warning("fault hooks enabled (--enable-fault-hooks): this process is for fault tests only")
        return fault_hooks.broker_core(environ, **kwargs)
    ignored = fault_hooks.hook_variables_set(environ)
    if ignored:
        log.warning("fault hooks are off (no --enable-fault-hooks): ignoring %s", ", ".join(ignored))
    return BrokerCore(**kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    cmd = command()
    config, flags = cmd.parse(argv, BrokerConfig.from_namespace)
    runtime = start("weight-broker", flags)
    cmd.check(lambda: install_credentials(config.auth_token_file, config.tls))
    core = cmd.check(lambda: broker_core(config, BrokerMetrics(runtime.registry), os.environ))
    servicer = WeightBrokerServicer(core)
    metrics = runtime.serve_metrics()
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
        metrics.port,
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

    def drain(left_s: float) -> None:
        stopped = server.begin_stop(left_s)  # NOT_SERVING, no new calls
        core.shutdown()  # end the watch streams, so that their handler threads return
        stopped.wait()

    runtime.shutdown.add("gRPC server", drain)
    runtime.shutdown.probe("gRPC calls in flight", server.in_flight.describe)
    for relay in relays:
        runtime.shutdown.add_close(f"relay of run {relay.run_id}", relay)
    runtime.shutdown.add_close("relay client", relay_client)
    return runtime.serve_until_stopped()


if __name__ == "__main__":
    sys.exit(main())
