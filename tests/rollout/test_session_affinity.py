"""The placement of a request's rows and of gateway calls (`core.session_affinity`), on synthetic
engines and loads: bound rows follow their engine, the rest go least-loaded; a request without
bound rows is the even split a request without affinity gets; a drained or unknown engine's rows
and sessions are placed again; the gateway's sessions stick and their map is bounded."""

from __future__ import annotations

import random

import pytest

from furlong.rollout.core.checks import split_evenly
from furlong.rollout.core.session_affinity import (
    Chunk,
    EngineLoad,
    GatewaySessions,
    SessionAffinity,
    Share,
    place_rows,
    pool_chunks,
)

pytestmark = pytest.mark.unit

E = ["e0", "e1", "e2"]


def loads(*in_flight: int) -> list[EngineLoad]:
    return [EngineLoad(f"e{i}", n) for i, n in enumerate(in_flight)]


def ids(n: int) -> list[str]:
    return [f"p{i // 2}/{i % 2}" for i in range(n)]


def engine_of_rows(shares: list[Share]) -> dict[int, str]:
    return {row: s.engine_id for s in shares for row in s.rows}


@pytest.mark.parametrize("num_rows", [0, 1, 2, 5, 7, 9, 64])
@pytest.mark.parametrize("in_flight", [(0, 0, 0), (0, 3, 0), (9, 0, 1)])
def test_no_bound_row_is_the_even_split_whatever_the_loads(num_rows, in_flight):
    shares = place_rows(ids(num_rows), loads(*in_flight), {})
    expected = [
        Share(E[k], tuple(range(start, end))) for k, (start, end) in enumerate(split_evenly(num_rows, 3))
    ]
    assert shares == expected
    # bindings of other sessions, or to engines that do not serve, change nothing
    unrelated = {"other/0": "e1", ids(num_rows)[0] if num_rows else "x/0": "gone"}
    assert place_rows(ids(num_rows), loads(*in_flight), unrelated) == expected


def test_bound_rows_follow_their_engine_and_the_rest_go_least_loaded():
    rows = ids(8)
    bound = {rows[0]: "e2", rows[1]: "e2", rows[5]: "e0"}
    shares = place_rows(rows, loads(0, 0, 0), bound)
    where = engine_of_rows(shares)
    assert where[0] == where[1] == "e2" and where[5] == "e0"
    # loads after the bound rows: e0 1, e1 0, e2 2; five free rows fill e1, e0, e1, e0, e1 -> e0 3,
    # e1 3, e2 2; handed out in request order, engine after engine: e0 gets rows 2, 3; e1 4, 6, 7
    assert shares == [Share("e0", (2, 3, 5)), Share("e1", (4, 6, 7)), Share("e2", (0, 1))]
    assert sorted(where) == list(range(8))


def test_load_counts_work_in_flight_and_ties_go_to_the_earlier_engine():
    rows = ids(6)
    shares = place_rows(rows, loads(4, 0, 1), {rows[0]: "e1"})
    # loads with the bound row: e0 4, e1 1, e2 1; the five free rows go e1 (tie), e2, e1 (tie),
    # e2, e1 (tie): e1 3, e2 2, e0 none, handed out in request order engine after engine
    assert engine_of_rows(shares) == {0: "e1", 1: "e1", 2: "e1", 3: "e1", 4: "e2", 5: "e2"}
    assert [s.engine_id for s in shares] == ["e1", "e2"]  # no empty share
    # with e0 idle it takes its part: loads e0 0, e1 1, e2 1 -> e0, e0 (e0 1 ties e1 1 -> e0),
    # e1, e2, e0
    assert place_rows(rows, loads(0, 0, 1), {rows[0]: "e1"}) == [
        Share("e0", (1, 2, 3)),
        Share("e1", (0, 4)),
        Share("e2", (5,)),
    ]


def test_rows_of_a_drained_or_unknown_engine_are_placed_again_least_loaded():
    rows = ids(4)
    bound = {rows[0]: "e1", rows[1]: "e1", rows[2]: "e0", rows[3]: "e-gone"}
    serving = [EngineLoad("e0", 0), EngineLoad("e2", 0)]  # e1 drained
    shares = place_rows(rows, serving, bound)
    # e0 holds its bound row 2; rows 0, 1, 3 are free: e2, then a tie at 1 -> e0, then e2
    assert shares == [Share("e0", (0, 2)), Share("e2", (1, 3))]


def test_placement_is_a_function_of_its_inputs():
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randrange(0, 40)
        rows = ids(n)
        engines = [EngineLoad(f"e{i}", rng.randrange(0, 4)) for i in range(rng.randrange(1, 5))]
        bound = {sid: f"e{rng.randrange(0, 6)}" for sid in rows if rng.random() < 0.5}
        shares = place_rows(rows, engines, bound)
        shuffled = dict(sorted(bound.items(), key=lambda _: rng.random()))
        assert place_rows(rows, engines, shuffled) == shares
        where = engine_of_rows(shares)
        assert sorted(where) == list(range(n))  # every row exactly once
        serving = {e.engine_id for e in engines}
        for i, sid in enumerate(rows):
            if bound.get(sid) in serving:
                assert where[i] == bound[sid]
        for s in shares:
            assert s.rows and list(s.rows) == sorted(s.rows)


def test_no_engine_or_repeated_engines_are_refused():
    with pytest.raises(ValueError, match="at least one serving engine, got none"):
        place_rows(ids(2), [], {})
    with pytest.raises(ValueError, match=r"engine ids repeat: \['e0', 'e0'\]"):
        place_rows(ids(2), [EngineLoad("e0"), EngineLoad("e0")], {})
    with pytest.raises(ValueError, match="chunk_rows must be >= 1, got 0"):
        pool_chunks(ids(2), ["e0"], {}, 0)


def test_pool_chunks_without_bound_rows_are_todays_chunks():
    rows = ids(7)
    assert pool_chunks(rows, ["e0", "e1"], {}, 3) == [
        Chunk(None, (0, 1, 2)),
        Chunk(None, (3, 4, 5)),
        Chunk(None, (6,)),
    ]


def test_pool_chunks_send_bound_rows_to_their_engine():
    rows = ids(7)
    bound = {rows[0]: "e1", rows[2]: "e1", rows[3]: "e1", rows[4]: "e0", rows[6]: "e-down"}
    assert pool_chunks(rows, ["e0", "e1"], bound, 2) == [
        Chunk("e0", (4,)),
        Chunk("e1", (0, 2)),
        Chunk("e1", (3,)),
        Chunk(None, (1, 5)),
        Chunk(None, (6,)),  # bound to an engine that does not serve: routed least-loaded
    ]


def test_session_affinity_records_the_last_engine():
    affinity = SessionAffinity()
    affinity.bind(["a", "b"], "e0")
    affinity.bind(["b"], "e1")
    assert affinity.engines_of(["a", "b", "c"]) == {"a": "e0", "b": "e1"}
    assert len(affinity) == 2


def test_gateway_sessions_stick_and_new_ones_go_least_loaded():
    sessions = GatewaySessions()
    idle = loads(0, 0)
    assert sessions.place("s1", idle) == "e0"
    assert sessions.place("s2", idle) == "e1"  # equal calls in flight: fewer sessions bound
    assert sessions.place("s3", idle) == "e0"
    assert sessions.place(None, idle) == "e1"  # a call without a session binds nothing
    assert len(sessions) == 3
    busy = loads(0, 5)
    assert sessions.place("s2", busy) == "e1"  # sticky, however loaded its engine
    assert sessions.place("s4", loads(2, 1)) == "e1"  # calls in flight first
    assert sessions.place(None, loads(1, 1)) == "e0"  # then sessions bound: e0 2, e1 2 -> e0
    # e1 drained: its sessions move to a serving engine and stay there
    assert sessions.place("s2", [EngineLoad("e0", 0)]) == "e0"
    assert sessions.engine_of("s2") == "e0"
    assert sessions.place("s2", idle) == "e0"


def test_gateway_sessions_forget_deleted_and_least_recently_used_sessions():
    sessions = GatewaySessions(max_sessions=2)
    idle = loads(0, 0)
    sessions.place("a", idle)  # e0
    sessions.place("b", idle)  # e1
    sessions.place("a", idle)  # a used again: b is the least recently used
    assert sessions.place("c", idle) == "e0"  # sessions bound e0 1, e1 1 -> e0; evicts b
    assert (sessions.engine_of("a"), sessions.engine_of("b"), sessions.engine_of("c")) == ("e0", None, "e0")
    assert sessions.place("d", idle) == "e1"  # the evicted b no longer counts on e1; evicts a
    assert sessions.engine_of("a") is None and len(sessions) == 2
    sessions.forget("c")
    sessions.forget("c")  # idempotent
    assert sessions.engine_of("c") is None and len(sessions) == 1
    assert sessions.place("c", idle) == "e0"  # placed afresh: e0 0 bound, e1 1
    with pytest.raises(ValueError, match="max_sessions must be an integer >= 1, got 0"):
        GatewaySessions(max_sessions=0)
