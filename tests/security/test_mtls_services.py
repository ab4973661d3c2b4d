"""Mutual TLS as the services' command lines configure it: a real weight-broker process serving
mutual TLS plus the shared token, and every service's flags parsed into its config."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pki import make_ca, make_cert
from polling import wait_until

from furlong import rpc
from furlong.core.errors import UnavailableError
from furlong.rpc.ports import free_port
from furlong.rpc.tls import TlsFiles
from furlong.transfer.broker_client import GrpcBrokerClient

TOKEN = "internal-token-0123456789abcdef"
SHARED_NAME = "furlong-internal"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = make_ca(d, "ca")
    token_file = d / "internal-token"
    token_file.write_text(TOKEN + "\n")
    return {
        "dir": d,
        "ca": ca,
        "token": token_file,
        "service": make_cert(ca, d, "service", dns=(SHARED_NAME,), ips=()),
        "stranger": make_cert(make_ca(d, "other-ca"), d, "stranger"),
    }


def tls_flags(pki, who: str = "service") -> list[str]:
    return [
        "--tls-ca-file",
        str(pki["ca"].cert),
        "--tls-cert-file",
        str(pki[who].cert),
        "--tls-key-file",
        str(pki[who].key),
        "--tls-server-name",
        SHARED_NAME,
    ]


@pytest.mark.integration
@pytest.mark.slow
def test_broker_process_serves_only_mtls_with_the_token(pki, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    log_path = tmp_path / "broker.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "furlong.weight_broker",
                "--port",
                address.rsplit(":", 1)[1],
                "--metrics-port",
                str(free_port()),
                "--auth-token-file",
                str(pki["token"]),
                *tls_flags(pki),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        probe = [
            sys.executable,
            "-m",
            "furlong.rpc.health_probe",
            "--address",
            address,
            "--service",
            "furlong.v1.WeightBroker",
        ]
        wait_until(
            lambda: subprocess.run(probe + tls_flags(pki), capture_output=True, timeout=60).returncode == 0,
            timeout_s=60,
            what="broker answers the mTLS health probe",
        )
        assert subprocess.run(probe, capture_output=True, timeout=60).returncode == 1

        plain = GrpcBrokerClient(address, timeout_s=5)
        with pytest.raises(UnavailableError):
            plain.register_engine("run-mtls", "engine-0")
        plain.close()

        service_tls = TlsFiles(*tls_flags(pki)[1::2]).load()
        rpc.use_auth_token(TOKEN)
        rpc.use_tls(service_tls)
        try:
            client = GrpcBrokerClient(address, timeout_s=5)
            assert client.register_engine("run-mtls", "engine-0") == -1  # nothing committed yet
            client.close()
            rpc.use_auth_token(None)
            tokenless = GrpcBrokerClient(address, timeout_s=5)
            with pytest.raises(PermissionError):
                tokenless.register_engine("run-mtls", "engine-1")
            tokenless.close()
            rpc.use_auth_token(TOKEN)
            rpc.use_tls(TlsFiles(*tls_flags(pki, "stranger")[1::2]).load())
            stranger = GrpcBrokerClient(address, timeout_s=5)
            with pytest.raises(UnavailableError):
                stranger.register_engine("run-mtls", "engine-2")
            stranger.close()
        finally:
            rpc.use_auth_token(None)
            rpc.use_tls(None)
        assert proc.poll() is None, "the broker must keep serving after refused handshakes"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = log_path.read_text()
    assert "gRPC mutual TLS on (server name furlong-internal)" in text
    assert TOKEN not in text and pki["service"].key.read_text().strip() not in text


@pytest.mark.integration
@pytest.mark.slow
def test_incomplete_tls_flags_stop_a_service_at_start(pki):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "furlong.weight_broker",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--tls-ca-file",
            str(pki["ca"].cert),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "missing --tls-cert-file, --tls-key-file" in result.stderr


@pytest.mark.unit
def test_every_service_parses_the_tls_flags(pki):
    from furlong.controller.__main__ import load_config
    from furlong.controller.__main__ import parse_args as controller_args
    from furlong.rollout.config import RolloutServerConfig
    from furlong.trainer.__main__ import parse_args as trainer_args
    from furlong.weight_broker.config import BrokerConfig

    expected = TlsFiles(*tls_flags(pki)[1::2])
    endpoints = ["--redis-url", "redis://127.0.0.1:6379/0", "--broker", "127.0.0.1:1"]
    trainer = trainer_args(endpoints + tls_flags(pki))
    rollout = RolloutServerConfig.from_args(
        ["--port", "0", "--metrics-port", "0", *endpoints, *tls_flags(pki)]
    )
    broker = BrokerConfig.from_args(["--port", "0", "--metrics-port", "0", *tls_flags(pki)])
    token_file = pki["dir"] / "admin-token"
    token_file.write_text("admin-token-0123456789abcdef")
    controller = load_config(
        controller_args(
            [
                "--port",
                "0",
                "--redis-url",
                "redis://127.0.0.1:6379/0",
                "--trainer",
                "127.0.0.1:1",
                "--rollout",
                "127.0.0.1:2",
                "--broker",
                "127.0.0.1:3",
                "--token-file",
                str(token_file),
                *tls_flags(pki),
            ]
        )
    )
    for config in (trainer, rollout, broker, controller):
        assert config.tls == expected and config.tls.load().server_name == SHARED_NAME
    assert trainer_args(endpoints).tls == TlsFiles() and TlsFiles().load() is None
    assert "PRIVATE KEY" not in repr(controller) and "admin-token" not in repr(controller)
