"""The broker state machine for versions staged in rounds: ordering, late joiners, re-sends, fencing
on repeated failure and on timeout. Plain objects and a fake clock."""

from __future__ import annotations

import pytest
import torch

from furlong.core.errors import ConflictError
from furlong.core.weight_versions import EventKind, RoundAck, VersionAck, WeightSourceInfo
from furlong.core.weights import Manifest, WeightLayout, combine_checksums, plan_buckets, round_checksums
from furlong.weight_broker.core import BrokerCore, EventSubscription

pytestmark = pytest.mark.unit

STATE = {f"w{i}": torch.full((16,), float(i)) for i in range(3)}  # 64 bytes each
LAYOUT = WeightLayout.from_state_dict(STATE)
PLAN = plan_buckets(LAYOUT, 64)  # three rounds
DIGESTS = round_checksums(LAYOUT, PLAN, STATE)
SOURCE = WeightSourceInfo("trainer", b"meta", 0x10000, 64)
RELAY = WeightSourceInfo("relay", b"meta", 0x20000, LAYOUT.total_bytes, holds_all_rounds=True)
RUN = "run-rounds"


def manifest(version: int) -> Manifest:
    return Manifest(version, LAYOUT, combine_checksums(DIGESTS), PLAN.with_checksums(DIGESTS))


def drain(sub: EventSubscription) -> list[tuple[EventKind, int, int]]:
    out = []
    while (event := sub.get(0.0)) is not None:
        out.append((event.kind, event.version, event.round))
    return out


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rounds_are_staged_in_order_once_every_engine_pulled_the_previous_one():
    core = BrokerCore()
    core.register_engine(RUN, "e1")
    core.register_engine(RUN, "e2")
    sub = core.subscribe(RUN, "e1")
    assert core.begin_version(RUN, manifest(1), SOURCE) == ["e1", "e2"]
    with pytest.raises(ConflictError, match="cannot stage round 1 after round -1 of 3"):
        core.stage_round(RUN, 1, 1)
    assert core.stage_round(RUN, 1, 0) == ["e1", "e2"]
    assert drain(sub) == [(EventKind.PUBLISHED, 1, 0), (EventKind.ROUND_READY, 1, 0)]
    core.ack_round(RoundAck(RUN, "e1", 1, 0, True))
    with pytest.raises(ConflictError, match=r"round 0 is still being pulled by engines \['e2'\]"):
        core.stage_round(RUN, 1, 1)
    with pytest.raises(ConflictError, match="acknowledged round 2 of version 1, staged up to 0"):
        core.ack_round(RoundAck(RUN, "e2", 1, 2, True))
    core.ack_round(RoundAck(RUN, "e2", 1, 0, True))
    assert core.wait_round(RUN, 1, 0, 0.0) == []
    for index in (1, 2):
        core.stage_round(RUN, 1, index)
        for engine in ("e1", "e2"):
            core.ack_round(RoundAck(RUN, engine, 1, index, True))
    assert drain(sub) == [(EventKind.ROUND_READY, 1, 1), (EventKind.ROUND_READY, 1, 2)]
    core.ack_version(VersionAck(RUN, "e1", 1, True))
    core.ack_version(VersionAck(RUN, "e2", 1, True))
    assert core.wait_committed(RUN, 1, 0.0).committed_version == 1


def test_a_late_engine_joins_only_while_it_can_still_take_every_round():
    core = BrokerCore()
    core.register_engine(RUN, "e1")
    core.begin_version(RUN, manifest(1), SOURCE)
    core.stage_round(RUN, 1, 0)
    core.register_engine(RUN, "early")  # round 0 is still staged: it joins
    early = core.subscribe(RUN, "early")
    assert drain(early) == [(EventKind.PUBLISHED, 1, 0), (EventKind.ROUND_READY, 1, 0)]
    for engine in ("e1", "early"):
        core.ack_round(RoundAck(RUN, engine, 1, 0, True))
    core.stage_round(RUN, 1, 1)
    core.register_engine(RUN, "late")  # round 0 is gone: it waits for the next version
    late = core.subscribe(RUN, "late")
    assert drain(late) == []
    for index in (1, 2):
        if index == 2:
            core.stage_round(RUN, 1, 2)
        for engine in ("e1", "early"):
            core.ack_round(RoundAck(RUN, engine, 1, index, True))
    core.ack_version(VersionAck(RUN, "e1", 1, True))
    core.ack_version(VersionAck(RUN, "early", 1, True))
    assert core.wait_committed(RUN, 1, 0.0).committed_version == 1  # "late" was not waited for
    assert drain(late) == [(EventKind.COMMITTED, 1, 0)]


def test_a_source_that_holds_all_rounds_serves_late_engines_everything():
    core = BrokerCore()
    core.begin_version(RUN, manifest(1), RELAY)  # no engines: commits at once
    for index in range(3):
        core.stage_round(RUN, 1, index)  # no waiting between rounds for a relay
    core.register_engine(RUN, "late")
    sub = core.subscribe(RUN, "late")
    assert drain(sub) == [(EventKind.PUBLISHED, 1, 0)] + [(EventKind.ROUND_READY, 1, r) for r in range(3)]


def test_a_bad_round_is_resent_then_the_engine_is_fenced_and_the_round_moves_on():
    core = BrokerCore(max_ack_attempts=2)
    for engine in ("good", "bad"):
        core.register_engine(RUN, engine)
    bad = core.subscribe(RUN, "bad")
    core.begin_version(RUN, manifest(1), SOURCE)
    core.stage_round(RUN, 1, 0)
    core.ack_round(RoundAck(RUN, "good", 1, 0, True))
    drain(bad)
    core.ack_round(RoundAck(RUN, "bad", 1, 0, False, "IntegrityError: checksum mismatch"))
    assert drain(bad) == [(EventKind.ROUND_READY, 1, 0)]  # re-sent: pull it again
    core.ack_round(RoundAck(RUN, "bad", 1, 0, False, "IntegrityError: checksum mismatch"))
    assert drain(bad) == [(EventKind.FENCED, 1, 0)] and bad.ended
    assert core.wait_round(RUN, 1, 0, 0.0) == ["bad"]
    core.stage_round(RUN, 1, 1)
    status = core.get_version(RUN)
    assert status.engine_ids == ("good",) and status.fenced_engine_ids == ("bad",)


def test_an_engine_that_never_answers_is_fenced_after_the_round_timeout():
    core = BrokerCore()
    for engine in ("fast", "mute"):
        core.register_engine(RUN, engine)
    core.begin_version(RUN, manifest(1), SOURCE)
    core.stage_round(RUN, 1, 0)
    core.ack_round(RoundAck(RUN, "fast", 1, 0, True))
    assert core.wait_round(RUN, 1, 0, 0.05) == ["mute"]  # waited 50 ms, then fenced it
    assert core.get_version(RUN).engine_ids == ("fast",)


def test_the_ack_timeout_fences_an_engine_that_does_not_acknowledge_the_version():
    clock = Clock()
    core = BrokerCore(ack_timeout_s=30.0, clock=clock)
    for engine in ("fast", "mute"):
        core.register_engine(RUN, engine)
    core.begin_version(RUN, manifest(1), SOURCE)
    for index in range(3):
        core.stage_round(RUN, 1, index)
        for engine in ("fast", "mute"):
            core.ack_round(RoundAck(RUN, engine, 1, index, True))
    core.ack_version(VersionAck(RUN, "fast", 1, True))
    assert core.get_version(RUN).committed_version == -1
    clock.now += 29.0
    assert core.get_version(RUN).fenced_engine_ids == ()
    clock.now += 2.0
    status = core.get_version(RUN)
    assert status.fenced_engine_ids == ("mute",) and status.committed_version == 1
