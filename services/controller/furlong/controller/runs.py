"""The controller's operations on runs, shared by the REST API and the in-process client.

Validates a submitted spec completely (including that its task exists) before anything is stored,
so a bad spec creates nothing. Knows nothing about HTTP.
"""

from __future__ import annotations

from typing import Any, Protocol

from furlong.controller.core.run_state import Run, RunState
from furlong.controller.core.step_record import StepRecord
from furlong.controller.metrics import ControllerMetrics
from furlong.controller.prompt_source import PromptSource
from furlong.controller.run_spec import SpecError, parse_run_spec
from furlong.controller.run_store import RunStore


class RunSubmitter(Protocol):
    def submit(self, run_id: str) -> None:
        """Queue a pending run for execution; returns at once."""


class RunService:
    def __init__(self, store: RunStore, submitter: RunSubmitter, prompts: PromptSource,
                 metrics: ControllerMetrics) -> None:
        self._store = store
        self._submitter = submitter
        self._prompts = prompts
        self._metrics = metrics

    def create_run(self, data: Any) -> Run:
        """Validate a spec dict, store the run as pending and queue it. SpecError names the bad
        field; nothing is stored then."""
        spec = parse_run_spec(data)
        try:
            self._prompts.reward_name(spec.task)
        except ValueError as exc:
            raise SpecError("task", str(exc)) from None
        run = self._store.create(spec)
        self._metrics.entered(RunState.PENDING.value)
        self._submitter.submit(run.run_id)
        return run

    def list_runs(self, state: str | None = None) -> list[Run]:
        return self._store.list_runs(RunState.parse(state) if state else None)

    def get_run(self, run_id: str) -> Run:
        return self._store.get(run_id)

    def stop_run(self, run_id: str) -> Run:
        """Cancel a pending run, or ask a started one to stop (it reaches `cancelled` after its
        teardown). ConflictError for a finished run; NotFoundError for an unknown one."""
        run = self._store.request_stop(run_id)
        if run.state == RunState.CANCELLED:
            self._metrics.entered(RunState.CANCELLED.value)
        return run

    def step_metrics(self, run_id: str, since: int = 0) -> list[StepRecord]:
        return self._store.metrics(run_id, since)
