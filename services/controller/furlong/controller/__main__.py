"""`python -m furlong.controller`: the controller process (REST API + run executor).

Reads the admin bearer token from --token-file (or the environment variable named by --token-env)
and an optional viewer token likewise, the shared gRPC token from --auth-token-file and, with
--tls-ca-file/--tls-cert-file/--tls-key-file, mutual TLS to the services; connects to Redis and the
three gRPC services, recovers runs a previous process left behind, and serves until SIGINT/SIGTERM.
Then it stops accepting connections, lets the requests in flight finish, asks the active run to stop
and waits for its teardown, all within --shutdown-grace-s (`furlong.service_main`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from furlong import rpc
from furlong.controller.app import ENGINE_STATUS_TIMEOUT_S
from furlong.controller.auth import ApiTokens
from furlong.controller.config import ControllerConfig
from furlong.controller.metrics import ControllerMetrics
from furlong.controller.run_store import RunStore
from furlong.controller.server import HttpServer, build_controller
from furlong.controller.services import (
    BROKER_SERVICE,
    ROLLOUT_SERVICE,
    TRAINER_SERVICE,
    connect,
    rollout_clients,
)
from furlong.core.errors import FurlongError
from furlong.rollout.client import RolloutDeadlines
from furlong.rpc.service_main import add_credential_flags, credential_fields, install_credentials
from furlong.service_main import REQUIRED, ServiceCommand, ServiceFlags, start

log = logging.getLogger("furlong.controller")


def command() -> ServiceCommand:
    """The controller's command line: the shared flags (no --metrics-port: /metrics is on --port)
    and its own."""
    cmd = ServiceCommand("python -m furlong.controller", __doc__, port=REQUIRED)
    p = cmd.parser
    p.add_argument("--redis-url", required=True)
    p.add_argument("--trainer", required=True, help="host:port of the trainer")
    p.add_argument(
        "--rollout",
        required=True,
        action="append",
        help="host:port of the rollout service; repeated: of each rollout replica (each step is "
        "spread over the live ones)",
    )
    p.add_argument("--broker", required=True, help="host:port of the weight broker")
    p.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help="file holding the admin bearer token (reads and changes runs)",
    )
    p.add_argument(
        "--token-env",
        default=None,
        metavar="VAR",
        help="environment variable holding the admin token (instead of --token-file)",
    )
    p.add_argument(
        "--viewer-token-file",
        type=Path,
        default=None,
        help="file holding a viewer bearer token (may only read)",
    )
    p.add_argument(
        "--viewer-token-env",
        default=None,
        metavar="VAR",
        help="environment variable holding the viewer token",
    )
    p.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        dest="cors_origins",
        help="allow browser requests from this origin (repeatable); CORS is off without",
    )
    add_credential_flags(p)
    return cmd


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The parsed command line, the shared flags validated (exits with status 2 on a bad value);
    `load_config` turns it into the config."""
    cmd = command()
    args = cmd.parser.parse_args(argv)
    cmd.check(lambda: cmd.flags(args))
    return args


def _secret(file_flag: str, path: Path | None, env_flag: str, var: str | None, required: bool) -> str:
    """A token from a file or an environment variable (exactly one when required)."""
    if path is not None and var is not None:
        raise ValueError(f"give {file_flag} or {env_flag}, not both")
    if path is not None:
        try:
            return path.read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read {file_flag} {path}: {exc.strerror}") from None
    if var is not None:
        if not os.environ.get(var):
            raise ValueError(f"{env_flag}: environment variable {var} is not set or empty")
        return os.environ[var].strip()
    if required:
        raise ValueError(f"one of {file_flag} or {env_flag} is required")
    return ""


def load_config(args: argparse.Namespace, flags: ServiceFlags | None = None) -> ControllerConfig:
    """The controller's config: reads the tokens (ValueError naming the flag or variable). `flags`:
    the validated shared flags (default: taken from args)."""
    flags = flags if flags is not None else command().flags(args)
    token = _secret("--token-file", args.token_file, "--token-env", args.token_env, True)
    viewer = _secret(
        "--viewer-token-file", args.viewer_token_file, "--viewer-token-env", args.viewer_token_env, False
    )
    return ControllerConfig(
        host=flags.host,
        port=flags.port,
        redis_url=args.redis_url,
        trainer=args.trainer,
        rollout=args.rollout[0],
        rollout_replicas=tuple(args.rollout[1:]),
        broker=args.broker,
        token=token,
        viewer_token=viewer,
        cors_origins=tuple(args.cors_origins),
        **credential_fields(args),
    )


def main(argv: Sequence[str] | None = None) -> int:
    cmd = command()
    config, flags = cmd.parse(argv, load_config)
    runtime = start("controller", flags)
    log.info("starting with %r", config)
    cmd.check(lambda: install_credentials(config.auth_token_file, config.tls))
    tokens = ApiTokens(admin=(config.token,), viewer=(config.viewer_token,) if config.viewer_token else ())
    store = RunStore.from_url(config.redis_url)
    services = connect(config.trainer, config.rollouts, config.broker, config.timeouts)
    # /v1/engines answers within a few seconds even while rollout is busy generating
    engines = rollout_clients(config.rollouts, RolloutDeadlines(call_s=ENGINE_STATUS_TIMEOUT_S))

    def readiness() -> dict[str, bool]:
        return {
            "redis": store.ping(),
            "trainer": rpc.check_health(config.trainer, TRAINER_SERVICE),
            # with rollout replicas: ready while any answers (the others' shares go to it)
            "rollout": any(rpc.check_health(address, ROLLOUT_SERVICE) for address in config.rollouts),
            "broker": rpc.check_health(config.broker, BROKER_SERVICE),
        }

    try:
        controller = build_controller(
            store,
            services,
            tokens,
            readiness,
            config.timeouts,
            metrics=ControllerMetrics(runtime.registry),
            cors_origins=config.cors_origins,
            engines=engines,
        )
    except FurlongError as exc:
        log.error("cannot start: %s", exc)
        return 1
    server = HttpServer(controller.app, config.host, config.port, log_level="warning")
    runtime.shutdown.add("HTTP server", server.stop)
    runtime.shutdown.probe("HTTP requests in flight", server.still_running)
    runtime.shutdown.add("active run teardown", controller.close)
    runtime.shutdown.probe("active run", lambda: controller.executor.active_run or "")
    runtime.shutdown.add_close("service clients", services)
    runtime.shutdown.add_close("engine status client", engines)
    runtime.shutdown.add_close("run store", store)
    server.start()
    log.info("serving the REST API on %s", server.url)
    return runtime.serve_until_stopped()


if __name__ == "__main__":
    sys.exit(main())
