"""The controller's operations on runs, shared by the REST API and the in-process client.

Validates a submitted spec completely (its task among the registered ones included) before anything
is stored, so a bad spec creates nothing. Knows nothing about HTTP.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any, Protocol

from furlong.controller.core.run_state import CheckpointRef, Run, RunState
from furlong.controller.core.step_record import StepRecord
from furlong.controller.metrics import ControllerMetrics
from furlong.controller.run_data import check_run_data
from furlong.controller.run_events import EventPage
from furlong.controller.run_spec import parse_run_spec
from furlong.controller.run_store import RunStore
from furlong.core.errors import ConflictError, NotFoundError, UnavailableError
from furlong.trainer.api import CheckpointResult

log = logging.getLogger(__name__)

_RECORDED_POLL_S = 0.02


class RunSubmitter(Protocol):
    def submit(self, run_id: str) -> None:
        """Queue a pending run for execution; returns at once."""


class RunCheckpointer(Protocol):
    def checkpoint(self, run_id: str, directory: str = "") -> CheckpointResult:
        """Have the trainer write the run's training state now (see `TrainerClient.checkpoint`);
        called from request threads, concurrently with the run's driver."""

    def delete_checkpoints(self, run_id: str) -> int:
        """Have the trainer remove a finished run's training checkpoints; how many there were."""


# A checkpoint needs the run's state on the trainer: configured (running) and not torn down yet.
CHECKPOINT_STATES = frozenset({RunState.RUNNING, RunState.PAUSED})


class RunService:
    def __init__(
        self,
        store: RunStore,
        submitter: RunSubmitter,
        metrics: ControllerMetrics,
        checkpointer: RunCheckpointer | None = None,
        checkpoint_timeout_s: float = 300.0,
    ) -> None:
        self._store = store
        self._submitter = submitter
        self._metrics = metrics
        self._checkpointer = checkpointer
        self._checkpoint_timeout_s = checkpoint_timeout_s

    def create_run(self, data: Any, idempotency_key: str | None = None) -> Run:
        """Validate a spec dict, store the run as pending and queue it. SettingError names the bad
        field; nothing is stored then."""
        return self.create_run_idempotent(data, idempotency_key)[0]

    def create_run_idempotent(self, data: Any, idempotency_key: str | None) -> tuple[Run, bool]:
        """create_run; with an idempotency key, the same key and body again return the run it
        created (and True: replayed), the same key with another body is a ConflictError."""
        spec = parse_run_spec(data)
        check_run_data(spec)  # every row of a dataset file the controller can read
        fingerprint = hashlib.sha256(
            json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
        ).hexdigest()
        run, replayed = self._store.create_idempotent(spec, idempotency_key, fingerprint)
        if not replayed:
            self._metrics.entered(RunState.PENDING.value)
            self._submitter.submit(run.run_id)
        return run, replayed

    def list_runs(self, state: str | None = None) -> list[Run]:
        return self._store.list_runs(RunState.parse(state) if state else None)

    def list_page(self, state: str | None, limit: int, cursor: str | None) -> tuple[list[Run], str | None]:
        """One page of runs, newest first, and the next page's cursor (None at the end)."""
        return self._store.list_page(RunState.parse(state) if state else None, limit, cursor)

    def pause_run(self, run_id: str) -> Run:
        """Ask a started run to pause before its next step (idempotent)."""
        return self._store.request_pause(run_id)

    def resume_run(self, run_id: str) -> Run:
        """Clear a pause request; the run continues with its next step."""
        return self._store.request_resume(run_id)

    def checkpoint_run(self, run_id: str) -> Run:
        """Have the trainer checkpoint a running or paused run now (after a step in progress) and
        return the run with that checkpoint recorded. ConflictError for a run in any other state
        or one the trainer cannot checkpoint (its reason in the message), NotFoundError for an
        unknown run, UnavailableError when the trainer does not answer in time."""
        run = self._store.get(run_id)
        if run.state not in CHECKPOINT_STATES:
            raise ConflictError(
                f"run {run_id} is {run.state.value}; only a running or paused run can be checkpointed"
            )
        if self._checkpointer is None:
            raise UnavailableError("checkpoints: this controller has no trainer client")
        try:
            result = self._checkpointer.checkpoint(run_id)
        except NotFoundError as exc:  # the trainer restarted, or the run was torn down meanwhile
            raise ConflictError(
                f"run {run_id}: the trainer has no state of this run to checkpoint ({exc})"
            ) from None
        except ConflictError as exc:
            raise ConflictError(f"run {run_id}: the trainer cannot checkpoint it: {exc}") from None
        except TimeoutError as exc:
            raise UnavailableError(
                f"run {run_id}: the trainer did not finish the checkpoint "
                f"within {self._checkpoint_timeout_s:g}s ({exc})"
            ) from None
        ref = CheckpointRef(
            step=result.step, path=result.path, policy_version=result.policy_version, created_at=time.time()
        )
        self._wait_recorded(run_id, result.step)
        return self._store.record_checkpoint(run_id, ref)

    def _wait_recorded(self, run_id: str, step: int) -> None:
        """Wait (bounded) until the driver recorded `step`: the trainer checkpoints the step it
        trained last, which the driver records only after publishing it, and the checkpoint's run
        and event must not show a `current_step` behind the checkpoint's own step."""
        deadline = time.monotonic() + self._checkpoint_timeout_s
        while True:
            run = self._store.get(run_id)
            if run.current_step >= step or run.state.terminal or time.monotonic() > deadline:
                return
            time.sleep(_RECORDED_POLL_S)

    def delete_run(self, run_id: str, keep_checkpoints: bool = False) -> None:
        """Remove a finished run, its metrics and events, and (unless `keep_checkpoints`) its
        training checkpoints on the trainer; ConflictError for an unfinished one. The checkpoints go
        first: when the trainer cannot be reached (UnavailableError) nothing is deleted."""
        run = self._store.get(run_id)
        if not run.state.terminal:
            raise ConflictError(
                f"run {run_id} is {run.state.value}; only finished runs can be deleted (stop it first)"
            )
        if not keep_checkpoints and self._checkpointer is not None:
            removed = self._checkpointer.delete_checkpoints(run_id)
            log.info("run %s: the trainer removed %d checkpoint(s)", run_id, removed)
        self._store.delete(run_id)

    def events(self, run_id: str, after: str = "0-0", count: int = 100) -> EventPage:
        """The events of up to count stream entries of a run after stream id after; NotFoundError
        for an unknown run with none."""
        page = self._store.events(run_id, after, count)
        if not page.events:
            self._store.get(run_id)
        return page

    def get_run(self, run_id: str) -> Run:
        return self._store.get(run_id)

    def remember_drained(self, run_id: str, engine_id: str) -> None:
        """Record a drain of engine_id so that a recovery of the run drains it again; a run this
        controller does not hold (engines configured on the rollout service directly) is skipped."""
        try:
            self._store.record_drained(run_id, engine_id)
        except NotFoundError:
            log.info("drain of %s: run %s is not one of this controller's runs", engine_id, run_id)

    def stop_run(self, run_id: str) -> Run:
        """Cancel a pending run, or ask a started one to stop (it reaches `cancelled` after its
        teardown). ConflictError for a finished run; NotFoundError for an unknown one."""
        run = self._store.request_stop(run_id)
        if run.state == RunState.CANCELLED:
            self._metrics.entered(RunState.CANCELLED.value)
        return run

    def step_metrics(self, run_id: str, since: int = 0) -> list[StepRecord]:
        return self._store.metrics(run_id, since)
