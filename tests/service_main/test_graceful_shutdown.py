"""Graceful shutdown within a deadline: the stop steps run in order with the time left, a gRPC server
lets its calls in flight finish and refuses new ones, and work that outlives the deadline is named
in one log line."""

from __future__ import annotations

import logging
import threading

import grpc
import pytest
from polling import wait_until

from furlong import rpc
from furlong.rpc.service_main import drain_on_shutdown
from furlong.service_main import GracefulShutdown
from furlong.service_main.shutdown import EXIT_OK, EXIT_UNCLEAN

SLOW_METHOD = "/test.Slow/Wait"


def test_steps_run_in_order_with_the_time_left_and_a_reserve_for_the_rest():
    shutdown = GracefulShutdown("svc", grace_s=5.0)
    calls: list[tuple[str, float]] = []
    shutdown.add("first", lambda left_s: calls.append(("first", left_s)))
    shutdown.add("second", lambda left_s: calls.append(("second", left_s)))
    shutdown.add_close("resource", type("R", (), {"close": lambda self: calls.append(("closed", 0.0))})())
    shutdown.request("test")
    assert shutdown.requested and shutdown.wait(0.0)
    stopped = shutdown.run()
    assert (stopped.exit_code, stopped.in_time) == (EXIT_OK, True)
    assert [name for name, _ in calls] == ["first", "second", "closed"]
    first_left = calls[0][1]
    assert 3.5 < first_left <= 4.5  # 5 s less the reserve (0.5 s) kept for the later steps


def test_wait_returns_false_without_a_request():
    assert GracefulShutdown("svc", grace_s=1.0).wait(0.1) is False


def test_a_failing_step_does_not_stop_the_others_and_fails_the_exit(caplog):
    shutdown = GracefulShutdown("svc", grace_s=2.0)
    ran = []

    def broken(left_s: float) -> None:
        raise RuntimeError("boom")

    shutdown.add("broken", broken)
    shutdown.add("after", lambda left_s: ran.append("after"))
    with caplog.at_level(logging.ERROR):
        stopped = shutdown.run()
    assert ran == ["after"]
    assert (stopped.exit_code, stopped.in_time) == (EXIT_UNCLEAN, True)
    assert "these stop steps failed: broken" in caplog.text


def test_past_the_deadline_one_line_names_what_still_runs(caplog):
    shutdown = GracefulShutdown("svc", grace_s=0.3)
    never = threading.Event()
    shutdown.add("drain", lambda left_s: never.wait(10))
    shutdown.add("close clients", lambda left_s: None)
    shutdown.probe("calls in flight", lambda: "/pkg.Svc/Method x2")
    shutdown.probe("idle", lambda: "")
    with caplog.at_level(logging.ERROR):
        stopped = shutdown.run()
    never.set()
    assert (stopped.exit_code, stopped.in_time) == (EXIT_UNCLEAN, False)
    (line,) = [r.getMessage() for r in caplog.records if "deadline" in r.getMessage()]
    assert line == (
        "svc: shutdown deadline of 0.3s passed; exiting anyway; still running: drain "
        "[calls in flight: /pkg.Svc/Method x2]; not reached: close clients"
    )


@pytest.fixture
def slow_server():
    """A gRPC server with one method that blocks until its event is set."""
    release = threading.Event()
    entered = threading.Event()

    def wait(request: bytes, context: grpc.ServicerContext) -> bytes:
        entered.set()
        release.wait(30)
        return b"done"

    handler = grpc.method_handlers_generic_handler(
        "test.Slow", {"Wait": grpc.unary_unary_rpc_method_handler(wait)}
    )
    server = rpc.start_server([lambda s: s.add_generic_rpc_handlers((handler,))], ["test.Slow"])
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield server, channel, entered, release
    release.set()
    channel.close()
    server.stop(grace_s=0)


def _call_in_background(channel: grpc.Channel) -> tuple[threading.Thread, list]:
    results: list = []

    def call() -> None:
        try:
            results.append(channel.unary_unary(SLOW_METHOD)(b"", timeout=30))
        except grpc.RpcError as err:
            results.append(err.code())

    thread = threading.Thread(target=call)
    thread.start()
    return thread, results


@pytest.mark.integration
def test_a_grpc_call_in_flight_finishes_and_new_calls_are_refused(slow_server):
    server, channel, entered, release = slow_server
    thread, results = _call_in_background(channel)
    assert entered.wait(10)
    wait_until(lambda: server.in_flight.running() == {SLOW_METHOD: 1}, what="the call counted")
    shutdown = GracefulShutdown("svc", grace_s=20.0)
    drain_on_shutdown(shutdown, server)
    outcome = []
    stopper = threading.Thread(target=lambda: outcome.append(shutdown.run()))
    stopper.start()
    wait_until(lambda: not rpc.check_health(f"127.0.0.1:{server.port}", timeout_s=0.5), what="NOT_SERVING")
    late = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    with pytest.raises(grpc.RpcError) as refused:
        late.unary_unary(SLOW_METHOD)(b"", timeout=5)
    late.close()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert stopper.is_alive()  # still draining the call in flight
    release.set()
    thread.join(10)
    stopper.join(10)
    assert results == [b"done"]
    assert outcome[0].exit_code == EXIT_OK and outcome[0].in_time
    assert server.in_flight.running() == {}


@pytest.mark.integration
def test_a_grpc_call_past_the_grace_period_is_cancelled_and_named(slow_server, caplog):
    server, channel, entered, release = slow_server
    thread, results = _call_in_background(channel)
    assert entered.wait(10)
    shutdown = GracefulShutdown("svc", grace_s=1.0)
    drain_on_shutdown(shutdown, server)
    shutdown.add("after the server", lambda left_s: release.wait(30))  # the handler still runs
    with caplog.at_level(logging.ERROR):
        stopped = shutdown.run()
    assert not stopped.in_time and stopped.exit_code == EXIT_UNCLEAN
    thread.join(10)
    assert results[0] in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)  # cut off, not answered
    assert f"still running: after the server [gRPC calls in flight: {SLOW_METHOD} x1]" in caplog.text
