"""The run state machine: every pair of states is either in the table or a ConflictError."""

from __future__ import annotations

import itertools

import pytest

from furlong.controller.core.run_state import TRANSITIONS, Run, RunState, check_transition
from furlong.controller.run_spec import parse_run_spec
from furlong.core.errors import ConflictError

S = RunState
LEGAL = {
    (S.PENDING, S.STARTING),
    (S.PENDING, S.CANCELLED),
    (S.PENDING, S.FAILED),
    (S.STARTING, S.RUNNING),
    (S.STARTING, S.STOPPING),
    (S.STARTING, S.FAILED),
    (S.RUNNING, S.PAUSED),
    (S.RUNNING, S.STOPPING),
    (S.RUNNING, S.FAILED),
    (S.PAUSED, S.RUNNING),
    (S.PAUSED, S.STOPPING),
    (S.PAUSED, S.FAILED),
    (S.STOPPING, S.SUCCEEDED),
    (S.STOPPING, S.FAILED),
    (S.STOPPING, S.CANCELLED),
}


def make_run(state: RunState = S.PENDING) -> Run:
    spec = parse_run_spec({"name": "r", "model": "/m", "task": "addition", "steps": 3})
    return Run(run_id="r-1", spec=spec, state=state, created_at=100.0, updated_at=100.0)


@pytest.mark.unit
def test_table_is_exactly_the_documented_one():
    assert {(a, b) for a, targets in TRANSITIONS.items() for b in targets} == LEGAL


@pytest.mark.unit
@pytest.mark.parametrize("current, target", list(itertools.product(RunState, RunState)))
def test_every_pair(current, target):
    if (current, target) in LEGAL:
        check_transition("r-1", current, target)
    else:
        with pytest.raises(ConflictError, match=f"{current.value} -> {target.value}"):
            check_transition("r-1", current, target)


@pytest.mark.unit
def test_terminal_states_have_no_way_out():
    for state in (S.SUCCEEDED, S.FAILED, S.CANCELLED):
        assert state.terminal
        assert TRANSITIONS[state] == frozenset()
    assert not S.STOPPING.terminal


@pytest.mark.unit
def test_transitioned_stamps_times_and_reason():
    run = make_run()
    started = run.transitioned(S.STARTING, 110.0)
    assert (started.state, started.started_at, started.finished_at) == (S.STARTING, 110.0, None)
    failed = started.transitioned(S.FAILED, 120.0, reason="boom")
    assert (failed.state, failed.reason, failed.finished_at, failed.started_at) == (
        S.FAILED,
        "boom",
        120.0,
        110.0,
    )
    with pytest.raises(ConflictError):
        failed.transitioned(S.RUNNING, 130.0)


@pytest.mark.unit
def test_run_dict_round_trip():
    run = make_run(S.RUNNING)
    data = run.to_dict()
    assert data["state"] == "running" and data["total_steps"] == 3 and data["name"] == "r"
    assert Run.from_dict(data) == run


@pytest.mark.unit
def test_unknown_state_is_rejected():
    with pytest.raises(ValueError, match="'sleeping'"):
        RunState.parse("sleeping")
