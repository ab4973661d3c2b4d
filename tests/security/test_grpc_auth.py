"""Service-to-service gRPC authentication: real servers and channels on 127.0.0.1."""

from __future__ import annotations

import grpc
import pytest

from furlong import rpc

pytestmark = pytest.mark.integration

TOKEN = "internal-token-0123456789abcdef"


def _echo(request: bytes, context) -> bytes:
    return b"echo:" + request


def _repeat(request: bytes, context):
    for i in range(3):
        yield bytes([i]) + request


HANDLER = grpc.method_handlers_generic_handler(
    "test.Echo",
    {
        "Say": grpc.unary_unary_rpc_method_handler(_echo),
        "Repeat": grpc.unary_stream_rpc_method_handler(_repeat),
    },
)


@pytest.fixture
def server():
    running = rpc.start_server(
        [lambda s: s.add_generic_rpc_handlers((HANDLER,))], ["test.Echo"], auth_token=TOKEN
    )
    yield f"127.0.0.1:{running.port}"
    running.stop(0)


def say(ch: grpc.Channel) -> bytes:
    return rpc.call(ch.unary_unary("/test.Echo/Say"), b"hi", 5.0)


def test_calls_need_the_token_health_does_not(server):
    for token in (None, "wrong-token-0123456789abcdef", TOKEN + "x"):
        ch = rpc.channel(server, auth_token=token)
        with pytest.raises(PermissionError, match="missing or invalid service token"):
            say(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(ch.unary_stream("/test.Echo/Repeat")(b"x", timeout=5))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ch.close()
    assert rpc.check_health(server, "test.Echo")  # open without a token
    ch = rpc.channel(server, auth_token=TOKEN)
    assert say(ch) == b"echo:hi"
    assert list(ch.unary_stream("/test.Echo/Repeat")(b"x", timeout=5)) == [b"\0x", b"\1x", b"\2x"]
    ch.close()


def test_process_token_is_used_by_default_and_explicit_overrides(server):
    rpc.use_auth_token(TOKEN)
    try:
        ch = rpc.channel(server)
        assert say(ch) == b"echo:hi"
        ch.close()
        other = rpc.start_server([lambda s: s.add_generic_rpc_handlers((HANDLER,))], [])
        try:  # a server started without an explicit token also requires the process's token
            bare = rpc.channel(f"127.0.0.1:{other.port}", auth_token="another-token-0123456789")
            with pytest.raises(PermissionError):
                say(bare)
            bare.close()
        finally:
            other.stop(0)
    finally:
        rpc.use_auth_token(None)
    ch = rpc.channel(server)
    with pytest.raises(PermissionError):
        say(ch)
    ch.close()


@pytest.mark.unit
def test_token_validation_and_file(tmp_path):
    with pytest.raises(ValueError, match="at least 16"):
        rpc.use_auth_token("short")
    with pytest.raises(ValueError, match="at least 16"):
        rpc.check_auth_token("has space 0123456789abcdef")
    path = tmp_path / "internal-token"
    path.write_text(TOKEN + "\n")
    assert rpc.read_auth_token_file(path) == TOKEN
    assert rpc.read_auth_token_file(None) is None
    with pytest.raises(ValueError, match="cannot read --auth-token-file") as err:
        rpc.read_auth_token_file(tmp_path / "missing")
    path.write_text("tiny")
    with pytest.raises(ValueError) as err:
        rpc.read_auth_token_file(path)
    assert "tiny" not in str(err.value)
