"""Following a run from the CLI with what the stack's supervisor reports: a dead service is named at
once with its log tail, a spent restart budget stops the run with one short reason, and an
unreachable controller is waited for. A fake controller client; real event files."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from furlong.controller import stack_events
from furlong.controller.run_follow import FollowOptions, Interrupts, follow_run
from furlong.controller.stack_events import StackEvent, StackEventKind, StackEventTail
from furlong.core.errors import UnavailableError

pytestmark = pytest.mark.unit


class FakeClient:
    def __init__(self, unreachable_polls: int = 0) -> None:
        self.run: dict[str, Any] = {
            "run_id": "r-1",
            "state": "running",
            "current_step": 0,
            "total_steps": 3,
            "policy_version": 0,
            "stop_requested": False,
        }
        self.stops = 0
        self.unreachable_polls = unreachable_polls

    def get_run(self, run_id: str) -> dict[str, Any]:
        if self.unreachable_polls:
            self.unreachable_polls -= 1
            raise UnavailableError("controller: connection refused")
        if self.stops:
            self.run = {**self.run, "state": "cancelled", "stop_requested": True}
        return dict(self.run)

    def run_metrics(self, run_id: str, since: int = 0) -> list[dict[str, Any]]:
        return []

    def stop_run(self, run_id: str) -> dict[str, Any]:
        self.stops += 1
        return dict(self.run)


def _exited(kind: StackEventKind, message: str) -> StackEvent:
    return StackEvent(
        kind,
        1.0,
        message,
        service="trainer",
        pid=7,
        signal="SIGKILL",
        log_path="/s/logs/trainer.log",
        log_tail="INFO loading\nINFO step 2 trained",
    )


def test_a_spent_budget_stops_the_run_once_with_one_reason_and_deaths_are_named(tmp_path: Path):
    stack_events.reset(tmp_path)
    tail = StackEventTail(tmp_path)
    stack_events.append(
        tmp_path, _exited(StackEventKind.EXITED, "trainer (pid 7) killed by SIGKILL; restarting")
    )
    gave_up = "trainer killed by SIGKILL after 1 restarts within 600s (the restart budget)"
    stack_events.append(tmp_path, _exited(StackEventKind.GAVE_UP, gave_up))
    out = io.StringIO()
    client = FakeClient(unreachable_polls=2)
    result = follow_run(
        client,
        dict(client.run),
        tmp_path / "out",
        Console(file=out, force_terminal=False, width=80),
        Interrupts(),
        stack_events=tail,
        options=FollowOptions(poll_s=0.01),
    )
    text = out.getvalue()
    assert "trainer (pid 7) killed by SIGKILL; restarting" in text
    assert "last lines of /s/logs/trainer.log:" in text and "INFO step 2 trained" in text
    assert text.count(gave_up) == 2  # the event, then "stopping run r-1: <it>"; never more
    assert client.stops == 1 and result.stack_failure == gave_up
    assert "controller unreachable" in text and "controller reachable again" in text
    assert result.run["state"] == "cancelled"
