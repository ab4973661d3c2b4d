"""The engines' acknowledgements (RoundAck, VersionAck): what they refuse to hold, and their wire
conversion both ways."""

from __future__ import annotations

import math

import pytest

from furlong.core.weight_versions import LANE_NAMES, RoundAck, VersionAck
from furlong.transfer.wire import (
    round_ack_from_proto,
    round_ack_to_proto,
    version_ack_from_proto,
    version_ack_to_proto,
)
from furlong.v1 import weight_broker_pb2 as pb

pytestmark = pytest.mark.unit

RUN = "run-acks"


def test_defaults_are_a_bare_verdict():
    ack = VersionAck(RUN, "e1", 3, True)
    assert (ack.error, ack.transfer_seconds, ack.transfer_bytes, ack.lane) == ("", 0.0, 0, "")
    rnd = RoundAck(RUN, "e1", 3, 0, False, "IntegrityError: checksum mismatch")
    assert (rnd.index, rnd.ok, rnd.error, rnd.lane) == (0, False, "IntegrityError: checksum mismatch", "")


@pytest.mark.parametrize("lane", [*LANE_NAMES, ""])
def test_every_known_lane_and_none_are_accepted(lane):
    assert VersionAck(RUN, "e1", 0, True, lane=lane).lane == lane
    assert RoundAck(RUN, "e1", 0, 0, True, lane=lane).lane == lane


BAD_FIELDS = [
    ({"run_id": ""}, "empty run_id"),
    ({"engine_id": ""}, "empty engine_id"),
    ({"version": -1}, "version -1 < 0"),
    ({"transfer_seconds": -0.5}, "transfer_seconds -0.5 is not a finite number >= 0"),
    ({"transfer_seconds": math.nan}, "transfer_seconds nan is not a finite number >= 0"),
    ({"transfer_seconds": math.inf}, "transfer_seconds inf is not a finite number >= 0"),
    ({"transfer_bytes": -1}, "transfer_bytes -1 < 0"),
    ({"lane": "rdma"}, "lane 'rdma' is not one of"),
    ({"lane": "NIXL"}, "lane 'NIXL' is not one of"),
]


@pytest.mark.parametrize(("bad", "message"), BAD_FIELDS)
def test_version_ack_refuses_a_bad_field_naming_it(bad, message):
    fields = {"run_id": RUN, "engine_id": "e1", "version": 1, "ok": True} | bad
    with pytest.raises(ValueError, match=message):
        VersionAck(**fields)


@pytest.mark.parametrize(("bad", "message"), [*BAD_FIELDS, ({"index": -1}, "index -1 < 0")])
def test_round_ack_refuses_a_bad_field_naming_it(bad, message):
    fields = {"run_id": RUN, "engine_id": "e1", "version": 1, "index": 2, "ok": True} | bad
    with pytest.raises(ValueError, match=message):
        RoundAck(**fields)


def test_acks_are_frozen():
    ack = VersionAck(RUN, "e1", 1, True)
    with pytest.raises(AttributeError):
        ack.ok = False


def test_round_ack_round_trips_through_its_proto():
    ack = RoundAck(RUN, "e1", 7, 3, False, "IntegrityError: x", 0.25, 1 << 33, "shm")
    msg = round_ack_to_proto(ack)
    assert isinstance(msg, pb.AckRoundRequest)
    assert (msg.run_id, msg.engine_id, msg.version, msg.round, msg.ok) == (RUN, "e1", 7, 3, False)
    assert (msg.error, msg.transfer_seconds, msg.transfer_bytes, msg.lane) == (
        "IntegrityError: x",
        0.25,
        1 << 33,
        "shm",
    )
    wired = pb.AckRoundRequest.FromString(msg.SerializeToString())
    assert round_ack_from_proto(wired) == ack
    assert round_ack_from_proto(round_ack_to_proto(RoundAck(RUN, "e2", 0, 0, True))) == RoundAck(
        RUN, "e2", 0, 0, True
    )


def test_version_ack_round_trips_through_its_proto():
    ack = VersionAck(RUN, "e1", 9, True, "", 1.5, 4096, "grpc")
    msg = version_ack_to_proto(ack)
    assert isinstance(msg, pb.AckVersionRequest)
    assert (msg.run_id, msg.engine_id, msg.version, msg.ok) == (RUN, "e1", 9, True)
    assert (msg.error, msg.transfer_seconds, msg.transfer_bytes, msg.lane) == ("", 1.5, 4096, "grpc")
    wired = pb.AckVersionRequest.FromString(msg.SerializeToString())
    assert version_ack_from_proto(wired) == ack
    failed = VersionAck(RUN, "e2", 0, False, "ValueError: bad layout")
    assert version_ack_from_proto(version_ack_to_proto(failed)) == failed


def test_a_hostile_message_is_a_value_error_naming_the_field():
    with pytest.raises(ValueError, match="lane 'carrier-pigeon'"):
        version_ack_from_proto(
            pb.AckVersionRequest(run_id=RUN, engine_id="e1", version=1, lane="carrier-pigeon")
        )
    with pytest.raises(ValueError, match="transfer_seconds nan"):
        round_ack_from_proto(pb.AckRoundRequest(run_id=RUN, engine_id="e1", transfer_seconds=math.nan))
    with pytest.raises(ValueError, match="empty engine_id"):
        round_ack_from_proto(pb.AckRoundRequest(run_id=RUN, version=1))
