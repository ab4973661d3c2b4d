"""`python -m furlong.rpc.health_probe`: ask a gRPC server's grpc.health.v1 whether a service is
SERVING, over mutual TLS when TLS files are given. Exit status 0 when it is, 1 when it is not or
the call fails (the reason on stderr).

Kubernetes' built-in gRPC probe cannot present a client certificate, so a server that requires
mutual TLS is probed with this command as an exec probe instead:

    python -m furlong.rpc.health_probe --address 127.0.0.1:50051 --service furlong.v1.Trainer \
        --tls-ca-file ca.crt --tls-cert-file tls.crt --tls-key-file tls.key \
        --tls-server-name furlong-internal
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from furlong import rpc


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m furlong.rpc.health_probe",
        description="gRPC health check, with mutual TLS if configured",
    )
    parser.add_argument("--address", required=True, help="HOST:PORT of the server")
    parser.add_argument("--service", default="", help="service name to check ('' = whole server)")
    parser.add_argument("--timeout-s", type=float, default=2.0)
    rpc.add_tls_arguments(parser)
    args = parser.parse_args(argv)
    try:
        tls = rpc.TlsFiles(
            args.tls_ca_file, args.tls_cert_file, args.tls_key_file, args.tls_server_name
        ).load()
    except ValueError as exc:
        parser.error(str(exc))
    ch = rpc.channel(args.address, tls=tls)
    try:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout_s
        )
    except grpc.RpcError as err:
        print(
            f"{args.address} {args.service or '<server>'}: {err.code().name}: {err.details()}",
            file=sys.stderr,
        )
        return 1
    finally:
        ch.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"{args.address} {args.service or '<server>'}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
