"""The broker state machine with plain objects: versions, engines, acknowledgements, commits."""

from __future__ import annotations

import threading

import pytest
import torch
from prometheus_client import CollectorRegistry

from furlong.core.errors import ConflictError, NotFoundError
from furlong.core.weight_versions import EventKind, VersionAck, WeightSourceInfo
from furlong.core.weights import Manifest, WeightLayout
from furlong.weight_broker.core import BrokerCore, EventSubscription
from furlong.weight_broker.metrics import BrokerMetrics

pytestmark = pytest.mark.unit

LAYOUT = WeightLayout.from_state_dict({"w": torch.zeros(4, 4), "b": torch.zeros(4)})
SOURCE = WeightSourceInfo("trainer-0", b"agent-metadata", 0x10000, LAYOUT.total_bytes)
RUN = "run-1"


def manifest(version: int) -> Manifest:
    return Manifest(version, LAYOUT, f"{version:032x}")


def drain(sub: EventSubscription) -> list[tuple[EventKind, int]]:
    out = []
    while (event := sub.get(0.0)) is not None:
        out.append((event.kind, event.version))
    return out


def test_versions_strictly_increase_and_conflict_names_both():
    core = BrokerCore()
    assert core.begin_version(RUN, manifest(1), SOURCE) == []  # no engines: commits at once
    assert core.get_version(RUN).committed_version == 1
    with pytest.raises(ConflictError, match="version 1 is not newer than version 1"):
        core.begin_version(RUN, manifest(1), SOURCE)
    with pytest.raises(ConflictError, match="version 0 is not newer than version 1"):
        core.begin_version(RUN, manifest(0), SOURCE)
    assert core.begin_version(RUN, manifest(5), SOURCE) == []
    assert core.get_version(RUN).latest_version == 5


def test_commit_only_after_every_engine_acked():
    core = BrokerCore()
    for engine in ("e1", "e2"):
        assert core.register_engine(RUN, engine) == -1
    subs = {e: core.subscribe(RUN, e) for e in ("e1", "e2")}
    assert core.begin_version(RUN, manifest(1), SOURCE) == ["e1", "e2"]
    assert all(drain(s) == [(EventKind.PUBLISHED, 1)] for s in subs.values())
    with pytest.raises(ConflictError, match="while version 1 is pending on engines"):
        core.begin_version(RUN, manifest(2), SOURCE)

    assert core.ack_version(VersionAck(RUN, "e1", 1, True, transfer_seconds=0.1, transfer_bytes=80)) == -1
    status = core.get_version(RUN)
    assert (status.latest_version, status.committed_version) == (1, -1)
    assert status.pending_engine_ids == ("e2",)
    with pytest.raises(TimeoutError, match=r"pending engines \['e2'\]"):
        core.wait_committed(RUN, 1, 0.05)

    assert core.ack_version(VersionAck(RUN, "e2", 1, True)) == 1
    assert core.wait_committed(RUN, 1, 0.0).committed_version == 1
    assert all(drain(s) == [(EventKind.COMMITTED, 1)] for s in subs.values())
    assert core.begin_version(RUN, manifest(2), SOURCE) == ["e1", "e2"]


def test_wait_committed_wakes_when_commit_happens_in_another_thread():
    core = BrokerCore()
    core.register_engine(RUN, "e1")
    core.begin_version(RUN, manifest(1), SOURCE)
    acker = threading.Timer(0.1, core.ack_version, args=(VersionAck(RUN, "e1", 1, True),))
    acker.start()
    assert core.wait_committed(RUN, 1, 10.0).committed_version == 1
    acker.join()


def test_failed_ack_is_resent_twice_then_the_engine_is_fenced_and_the_rest_commit():
    core = BrokerCore(max_ack_attempts=3)
    core.register_engine(RUN, "e1")
    core.register_engine(RUN, "e2")
    sub = core.subscribe(RUN, "e1")
    core.begin_version(RUN, manifest(1), SOURCE)
    assert drain(sub) == [(EventKind.PUBLISHED, 1)]
    core.ack_version(VersionAck(RUN, "e2", 1, True))
    for _ in range(2):
        core.ack_version(VersionAck(RUN, "e1", 1, False, error="checksum mismatch"))
        assert drain(sub) == [(EventKind.PUBLISHED, 1)]  # re-sent
    core.ack_version(VersionAck(RUN, "e1", 1, False, error="checksum mismatch"))
    assert drain(sub) == [(EventKind.FENCED, 1)] and sub.ended
    status = core.wait_committed(RUN, 1, 1.0)
    assert status.committed_version == 1
    assert status.engine_ids == ("e2",) and status.fenced_engine_ids == ("e1",)
    with pytest.raises(NotFoundError, match="engine e1 is not registered"):
        core.ack_version(VersionAck(RUN, "e1", 1, True))
    # The fenced engine registers again and takes the next version with the others.
    core.register_engine(RUN, "e1")
    assert core.begin_version(RUN, manifest(2), SOURCE) == ["e1", "e2"]
    core.ack_version(VersionAck(RUN, "e1", 2, True))
    core.ack_version(VersionAck(RUN, "e2", 2, True))
    assert core.wait_committed(RUN, 2, 0.0).committed_version == 2


def test_when_every_engine_is_fenced_the_version_fails():
    core = BrokerCore(max_ack_attempts=2)
    core.register_engine(RUN, "e1")
    core.begin_version(RUN, manifest(1), SOURCE)
    core.ack_version(VersionAck(RUN, "e1", 1, False, error="bad layout"))
    core.ack_version(VersionAck(RUN, "e1", 1, False, error="bad layout"))
    with pytest.raises(
        ConflictError,
        match="every engine was fenced: engine e1 failed version 1 after 2 attempts: bad layout",
    ):
        core.wait_committed(RUN, 1, 1.0)
    assert core.get_version(RUN).committed_version == -1
    assert core.begin_version(RUN, manifest(2), SOURCE) == []  # a failed version is over


def test_unregister_during_a_version_lets_it_commit():
    core = BrokerCore()
    for engine in ("e1", "e2"):
        core.register_engine(RUN, engine)
    sub2 = core.subscribe(RUN, "e2")
    core.begin_version(RUN, manifest(1), SOURCE)
    core.ack_version(VersionAck(RUN, "e1", 1, True))
    core.unregister_engine(RUN, "e2")
    assert sub2.get(0.0).kind is EventKind.PUBLISHED  # queued events are still delivered
    assert sub2.ended
    status = core.wait_committed(RUN, 1, 0.0)
    assert status.committed_version == 1 and status.engine_ids == ("e1",)
    with pytest.raises(NotFoundError, match="engine e2 is not registered"):
        core.ack_version(VersionAck(RUN, "e2", 1, True))


def test_closing_the_watch_removes_the_engine():
    core = BrokerCore()
    core.register_engine(RUN, "e1")
    core.register_engine(RUN, "e2")
    sub2 = core.subscribe(RUN, "e2")
    core.begin_version(RUN, manifest(1), SOURCE)
    core.ack_version(VersionAck(RUN, "e1", 1, True))
    sub2.close()
    assert core.get_version(RUN).committed_version == 1
    assert core.get_version(RUN).engine_ids == ("e1",)


def test_a_newer_watch_replaces_the_older_without_unregistering():
    core = BrokerCore()
    core.register_engine(RUN, "e1")
    old = core.subscribe(RUN, "e1")
    new = core.subscribe(RUN, "e1")
    assert old.ended and not new.ended
    old.close()
    assert core.get_version(RUN).engine_ids == ("e1",)


def test_late_registration_gets_the_latest_version_and_must_ack_a_pending_one():
    core = BrokerCore()
    core.register_engine(RUN, "e1")
    core.begin_version(RUN, manifest(1), SOURCE)
    core.ack_version(VersionAck(RUN, "e1", 1, True))
    core.begin_version(RUN, manifest(2), SOURCE)

    assert core.register_engine(RUN, "late") == 1
    sub = core.subscribe(RUN, "late")
    event = sub.get(0.0)
    assert (event.kind, event.version) == (EventKind.PUBLISHED, 2)
    assert event.manifest == manifest(2) and event.source == SOURCE
    core.ack_version(VersionAck(RUN, "e1", 2, True))
    assert core.get_version(RUN).pending_engine_ids == ("late",)  # joined while 2 was pending
    core.ack_version(VersionAck(RUN, "late", 2, True))
    assert core.get_version(RUN).committed_version == 2

    # Joining after a commit: the committed version is sent; acking it is accepted.
    core.register_engine(RUN, "later")
    later = core.subscribe(RUN, "later")
    assert drain(later) == [(EventKind.PUBLISHED, 2)]
    assert core.ack_version(VersionAck(RUN, "later", 2, True)) == 2


def test_a_failed_latest_version_is_not_sent_to_new_watchers():
    core = BrokerCore(max_ack_attempts=1)
    core.register_engine(RUN, "e1")
    core.begin_version(RUN, manifest(1), SOURCE)
    core.ack_version(VersionAck(RUN, "e1", 1, False, error="boom"))
    core.register_engine(RUN, "e2")
    assert drain(core.subscribe(RUN, "e2")) == []


def test_stale_and_unknown_acks_and_unknown_runs():
    core = BrokerCore()
    core.register_engine(RUN, "e1")
    core.begin_version(RUN, manifest(1), SOURCE)
    core.ack_version(VersionAck(RUN, "e1", 1, True))
    core.begin_version(RUN, manifest(2), SOURCE)
    with pytest.raises(ConflictError, match="version 1 from engine e1 is stale; latest is version 2"):
        core.ack_version(VersionAck(RUN, "e1", 1, True))
    with pytest.raises(NotFoundError, match="version 3 was never begun"):
        core.ack_version(VersionAck(RUN, "e1", 3, True))
    with pytest.raises(NotFoundError, match="run nope is not known"):
        core.get_version("nope")
    with pytest.raises(NotFoundError, match="engine ghost is not registered"):
        core.subscribe(RUN, "ghost")
    with pytest.raises(ValueError, match="empty engine_id"):
        core.register_engine(RUN, "")
    with pytest.raises(ValueError, match="8 bytes is smaller than the 80 bytes version 9 stages"):
        core.begin_version(RUN, manifest(9), WeightSourceInfo("t", b"m", 0x1000, 8))


def test_end_run_ends_watchers_and_waiters_and_fences_the_run():
    core = BrokerCore()
    core.register_engine(RUN, "e1")
    sub = core.subscribe(RUN, "e1")
    core.begin_version(RUN, manifest(1), SOURCE)
    errors: list[Exception] = []

    def wait() -> None:
        try:
            core.wait_committed(RUN, 1, 10.0)
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion below
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    core.end_run(RUN)
    waiter.join(5.0)
    assert len(errors) == 1 and isinstance(errors[0], NotFoundError)
    assert "has ended" in str(errors[0])
    assert drain(sub) == [(EventKind.PUBLISHED, 1)] and sub.ended
    with pytest.raises(ConflictError, match="run run-1 has ended"):
        core.register_engine(RUN, "e1")
    with pytest.raises(ConflictError, match="has ended"):
        core.begin_version(RUN, manifest(2), SOURCE)
    core.end_run(RUN)  # idempotent


def test_metrics_observer_follows_the_state_machine():
    registry = CollectorRegistry()
    core = BrokerCore(max_ack_attempts=1, observer=BrokerMetrics(registry))
    core.register_engine(RUN, "e1")
    core.begin_version(RUN, manifest(1), SOURCE)
    core.ack_version(VersionAck(RUN, "e1", 1, True, transfer_seconds=0.25, transfer_bytes=80, lane="shm"))
    core.begin_version(RUN, manifest(2), SOURCE)
    core.ack_version(VersionAck(RUN, "e1", 2, False, error="bad"))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("furlong_broker_transfer_bytes_total", lane="shm") == 80
    assert value("furlong_broker_transfer_seconds_total", lane="shm") == 0.25
    assert value("furlong_broker_transfer_bytes_total", lane="nixl") is None  # the lane is as told
    assert value("furlong_broker_engines_fenced_total", run_id=RUN) == 1
    assert value("furlong_broker_committed_version", run_id=RUN) == 1
    assert value("furlong_broker_versions_committed_total", run_id=RUN) == 1
    assert value("furlong_broker_versions_failed_total", run_id=RUN) == 1
    assert value("furlong_broker_acks_total", result="error") == 1
    assert value("furlong_broker_registered_engines", run_id=RUN) == 0  # fenced out
    assert value("furlong_broker_commit_latency_seconds_count") == 1
    core.end_run(RUN)
    assert value("furlong_broker_committed_version", run_id=RUN) is None
