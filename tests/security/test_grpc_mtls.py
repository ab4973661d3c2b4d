"""Mutual TLS between services: real gRPC servers and channels on 127.0.0.1 with certificates made
at test time by a throwaway CA."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
from pki import make_ca, make_cert

from furlong import rpc
from furlong.rpc.tls import TlsConfig, TlsFiles

pytestmark = pytest.mark.integration

TOKEN = "internal-token-0123456789abcdef"
ECHO = "test.Echo"


def _echo(request: bytes, context) -> bytes:
    return b"echo:" + request


def _repeat(request: bytes, context):
    for i in range(3):
        yield bytes([i]) + request


HANDLER = grpc.method_handlers_generic_handler(
    ECHO,
    {
        "Say": grpc.unary_unary_rpc_method_handler(_echo),
        "Repeat": grpc.unary_stream_rpc_method_handler(_repeat),
    },
)


def _add(server: grpc.Server) -> None:
    server.add_generic_rpc_handlers((HANDLER,))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Two CAs; a server and a client certificate from the first, a client from the second, and a
    certificate naming only `furlong-internal` (no loopback address)."""
    d = tmp_path_factory.mktemp("pki")
    ca, other_ca = make_ca(d, "ca"), make_ca(d, "other-ca")
    return {
        "ca": ca,
        "other_ca": other_ca,
        "server": make_cert(ca, d, "server"),
        "client": make_cert(ca, d, "client", dns=("client",), ips=()),
        "stranger": make_cert(other_ca, d, "stranger"),
        "named": make_cert(ca, d, "named", dns=("furlong-internal",), ips=()),
    }


def tls(pki, who: str, ca: str = "ca", server_name: str = "") -> TlsConfig:
    files = TlsFiles(str(pki[ca].cert), str(pki[who].cert), str(pki[who].key), server_name)
    config = files.load()
    assert config is not None
    return config


@pytest.fixture
def server(pki):
    running = rpc.start_server([_add], [ECHO], auth_token=TOKEN, tls=tls(pki, "server"))
    yield f"127.0.0.1:{running.port}"
    running.stop(0)


def say(ch: grpc.Channel) -> bytes:
    return rpc.call(ch.unary_unary(f"/{ECHO}/Say"), b"hi", 5.0)


def rpc_code(ch: grpc.Channel) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        ch.unary_unary(f"/{ECHO}/Say")(b"hi", timeout=5)
    return err.value.code()


def test_a_client_with_a_certificate_of_the_ca_and_the_token_gets_through(pki, server):
    ch = rpc.channel(server, auth_token=TOKEN, tls=tls(pki, "client"))
    assert say(ch) == b"echo:hi"
    assert list(ch.unary_stream(f"/{ECHO}/Repeat")(b"x", timeout=5)) == [b"\0x", b"\1x", b"\2x"]
    ch.close()


def test_token_auth_still_applies_over_mtls(pki, server):
    for token in (None, "wrong-token-0123456789abcdef"):
        ch = rpc.channel(server, auth_token=token, tls=tls(pki, "client"))
        assert rpc_code(ch) == grpc.StatusCode.UNAUTHENTICATED
        ch.close()


def test_plaintext_and_certificateless_clients_fail_the_handshake(pki, server):
    plain = grpc.insecure_channel(server)
    assert rpc_code(plain) == grpc.StatusCode.UNAVAILABLE
    plain.close()
    # TLS that trusts the server but presents no client certificate
    no_cert = grpc.secure_channel(
        server, grpc.ssl_channel_credentials(root_certificates=pki["ca"].cert.read_bytes())
    )
    assert rpc_code(no_cert) == grpc.StatusCode.UNAVAILABLE
    no_cert.close()
    assert not rpc.check_health(server)  # health checks need TLS too


def test_a_client_certificate_of_another_ca_is_refused(pki, server):
    # trusts the server's CA, presents a certificate the server's CA did not sign
    stranger = TlsConfig(
        ca_cert=pki["ca"].cert.read_bytes(),
        cert=pki["stranger"].cert.read_bytes(),
        key=pki["stranger"].key.read_bytes(),
    )
    ch = rpc.channel(server, auth_token=TOKEN, tls=stranger)
    assert rpc_code(ch) == grpc.StatusCode.UNAVAILABLE
    ch.close()


def test_a_server_of_another_ca_is_not_trusted(pki):
    running = rpc.start_server([_add], [ECHO], tls=tls(pki, "stranger", ca="other_ca"))
    try:
        ch = rpc.channel(f"127.0.0.1:{running.port}", tls=tls(pki, "client"))
        assert rpc_code(ch) == grpc.StatusCode.UNAVAILABLE
        ch.close()
    finally:
        running.stop(0)


def test_server_name_verifies_a_shared_name_instead_of_the_address(pki):
    running = rpc.start_server([_add], [ECHO], tls=tls(pki, "named"))
    address = f"127.0.0.1:{running.port}"
    try:
        by_address = rpc.channel(address, tls=tls(pki, "client"))
        assert rpc_code(by_address) == grpc.StatusCode.UNAVAILABLE  # 127.0.0.1 not in the cert
        by_address.close()
        by_name = rpc.channel(address, tls=tls(pki, "client", server_name="furlong-internal"))
        assert say(by_name) == b"echo:hi"
        by_name.close()
        wrong = rpc.channel(address, tls=tls(pki, "client", server_name="somebody-else"))
        assert rpc_code(wrong) == grpc.StatusCode.UNAVAILABLE
        wrong.close()
    finally:
        running.stop(0)


def test_process_tls_is_used_by_default(pki):
    rpc.use_tls(tls(pki, "server"))
    try:
        running = rpc.start_server([_add], [ECHO])  # no explicit tls: the process's
        address = f"127.0.0.1:{running.port}"
        try:
            assert rpc.check_health(address, ECHO)
            ch = rpc.channel(address)
            assert say(ch) == b"echo:hi"
            ch.close()
        finally:
            running.stop(0)
    finally:
        rpc.use_tls(None)
    assert not rpc.check_health(address, ECHO, timeout_s=1.0)


def test_health_probe_command(pki, server):
    base = [sys.executable, "-m", "furlong.rpc.health_probe", "--address", server, "--service", ECHO]
    files = [
        "--tls-ca-file",
        str(pki["ca"].cert),
        "--tls-cert-file",
        str(pki["client"].cert),
        "--tls-key-file",
        str(pki["client"].key),
    ]
    ok = subprocess.run(base + files, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    unknown = subprocess.run(base[:-1] + ["no.Such"] + files, capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr
    plain = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr


@pytest.mark.unit
def test_tls_files_are_all_or_none_and_checked(pki, tmp_path):
    assert TlsFiles().load() is None
    with pytest.raises(ValueError, match="missing --tls-key-file"):
        TlsFiles(str(pki["ca"].cert), str(pki["client"].cert))
    with pytest.raises(ValueError, match="--tls-server-name 'x' given without"):
        TlsFiles(server_name="x")
    with pytest.raises(ValueError, match="cannot read --tls-ca-file .*missing"):
        TlsFiles(str(tmp_path / "missing"), str(pki["client"].cert), str(pki["client"].key)).load()
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ValueError, match="--tls-ca-file .*garbage.pem: not a usable CA"):
        TlsFiles(str(garbage), str(pki["client"].cert), str(pki["client"].key)).load()
    with pytest.raises(ValueError, match="not a certificate with its private key"):
        TlsFiles(str(pki["ca"].cert), str(pki["client"].cert), str(pki["server"].key)).load()
    config = tls(pki, "client")
    key_text = pki["client"].key.read_text()
    assert "PRIVATE" not in repr(config) and key_text not in repr(config)
    with pytest.raises(ValueError, match="TlsConfig.key is not PEM"):
        TlsConfig(ca_cert=config.ca_cert, cert=config.cert, key=b"secret")
    with pytest.raises(TypeError):
        rpc.use_tls("ca.crt")  # type: ignore[arg-type]
