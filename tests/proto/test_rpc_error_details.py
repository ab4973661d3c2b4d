"""A domain error whose message echoes a huge bad value reaches the client as its own status code,
with the message clipped, not as RESOURCE_EXHAUSTED from oversized trailing metadata."""

from concurrent import futures

import grpc
import pytest

from furlong.rpc import MAX_DETAILS_CHARS, clip_details, rpc_errors

pytestmark = pytest.mark.unit


class Echo:
    @rpc_errors
    def refuse(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        raise ValueError(f"run_id {request.decode()!r} is not a run name")


def test_a_huge_bad_value_comes_back_clipped_with_its_own_code():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    echo = Echo()
    handler = grpc.unary_unary_rpc_method_handler(echo.refuse)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.Echo", {"Refuse": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t.Echo/Refuse")
            for value in ("r" * 100_000, "é" * 20_000):
                with pytest.raises(grpc.RpcError) as err:
                    call(value.encode(), timeout=30)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                details = err.value.details()
                assert details.startswith("run_id '" + value[:10])
                assert "characters cut" in details and len(details) <= MAX_DETAILS_CHARS + 60
    finally:
        server.stop(0)


def test_short_messages_are_untouched():
    assert clip_details("bad value 3") == "bad value 3"
