"""The gRPC part of a service's start-up scaffold (the rest, gRPC-free, is `furlong.service_main`):
the credential flags every process that speaks gRPC shares (trainer, rollout, weight broker,
controller), added and validated here, and a gRPC server's place in the graceful shutdown.

    add_credential_flags(command.parser)
    config, flags = command.parse(argv, lambda args, flags: Config(..., **credential_fields(args)))
    runtime = start(...)
    command.check(lambda: install_credentials(config.auth_token_file, config.tls))
    server = start_server(...)
    drain_on_shutdown(runtime.shutdown, server)

A bad combination of the flags (`--tls-cert-file` without `--tls-key-file`, ...) or a file that
cannot be read exits like argparse: status 2 and one line naming the flag.
"""

from __future__ import annotations

import argparse
from typing import Any

from furlong.rpc import RunningServer, add_tls_arguments, install_credentials
from furlong.rpc.tls import TlsFiles
from furlong.service_main.shutdown import GracefulShutdown

__all__ = ["add_credential_flags", "credential_fields", "drain_on_shutdown", "install_credentials"]


def add_credential_flags(parser: argparse.ArgumentParser) -> None:
    """--auth-token-file and the --tls-* flags (`furlong.rpc.add_tls_arguments`)."""
    group = parser.add_argument_group("gRPC credentials (shared by every Furlong process that speaks gRPC)")
    group.add_argument(
        "--auth-token-file",
        default="",
        help="file with the shared token every gRPC call (served and made) must carry",
    )
    add_tls_arguments(group)


def credential_fields(args: argparse.Namespace) -> dict[str, Any]:
    """`auth_token_file` and `tls` (a TlsFiles) of the parsed flags, as config fields; ValueError
    naming the flags when the TLS files are not given all three or none."""
    return {
        "auth_token_file": args.auth_token_file,
        "tls": TlsFiles(args.tls_ca_file, args.tls_cert_file, args.tls_key_file, args.tls_server_name),
    }


def drain_on_shutdown(shutdown: GracefulShutdown, server: RunningServer, name: str = "gRPC server") -> None:
    """Stop `server` as the next shutdown step: NOT_SERVING, no new calls, the calls in flight get
    what is left of the grace period; the calls still running are quoted if the deadline passes."""
    shutdown.add(name, lambda left_s: server.stop(grace_s=left_s))
    shutdown.probe("gRPC calls in flight", server.in_flight.describe)
