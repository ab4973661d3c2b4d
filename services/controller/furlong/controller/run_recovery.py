"""Resuming a run from its last training checkpoint after a service, Redis or the controller failed.

A failure is recoverable when its cause says a dependency went away: `UnavailableError` (a service
or Redis cannot be reached) or `NotFoundError` (a restarted service no longer knows the run). The
services themselves are restarted by their supervisor (the local stack's restart policy, a
Kubernetes Deployment); recovery only waits for them, bounded by the run's `recovery.timeout_s`,
retrying the whole sequence below while the errors stay recoverable:

    rollout.EndRun, trainer.EndRun         (a surviving service drops its state of the run)
    trainer.ConfigureRun                   (reloads the last checkpoint; its version is new)
    trainer.PublishWeights, broker.WaitCommitted   (that checkpoint's weights, under the new version)
    rollout.ConfigureRun                   (fresh engines; they take the committed version)
    rollout.DrainEngine                    (again, for each engine drained through the REST API)
    store.rewind                           (the run's step goes back to the checkpoint's)

A checkpoint one step past the run's last record (the controller died after the trainer's checkpoint
of a step and before recording it) brings that step's record back: the trainer keeps its summary of
the checkpointed step in the ledger (`checkpoint_result`), and `rewind` appends the record rebuilt
from it (generation and sync times unknown: 0), so no step that ran is without its one record.

The broker's run is never ended (an ended run id cannot come back); a restarted broker learns the
run again from the first registration or version. Afterwards the driver repeats the steps after the
checkpoint: rollout does not generate again the prompts whose group is already in the stream (it
recorded each group generated as it wrote it; the trainer replays those pending entries), the others
are drawn again once, and groups already trained are
refused by the trainer's ledger check. Recovery is impossible when steps were trained but no
checkpoint holds them (the trainer has no checkpoint directory): that is a `RecoveryFailed`.
Knows nothing about gRPC, HTTP or processes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from furlong.controller.config import DriverTimeouts
from furlong.controller.core.run_state import Run
from furlong.controller.core.step_record import StepRecord
from furlong.controller.run_requests import rollout_config, trainer_config
from furlong.controller.run_store import RunStore
from furlong.controller.services import Services
from furlong.core.errors import ConflictError, NotFoundError, UnavailableError
from furlong.ledger.group_ledger import RECOVERIES
from furlong.trainer.api import STALENESS_MAX, STALENESS_MEAN

log = logging.getLogger(__name__)

RETRY_S = 0.5


class RecoveryFailed(Exception):
    """The run cannot resume; the message names the cause (and the service)."""


class RecoveryStopped(RecoveryFailed):
    """A stop was requested while the run was recovering."""


def recoverable(exc: BaseException) -> bool:
    """Whether exc means a dependency went away (and may come back)."""
    return isinstance(exc, (UnavailableError, NotFoundError, redis.ConnectionError, redis.TimeoutError))


@dataclass(frozen=True)
class Resumed:
    step: int  # the last step the checkpoint holds (0: none)
    version: int  # the policy version every engine will serve


class RunRecovery:
    def __init__(
        self,
        store: RunStore,
        services: Services,
        timeouts: DriverTimeouts,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._store = store
        self._trainer = services.trainer
        self._rollout = services.rollout
        self._broker = services.broker
        self._timeouts = timeouts
        self._clock = clock
        self._sleep = sleep

    def resume(self, run: Run, cause: str, stop_requested: Callable[[], bool]) -> Resumed:
        """Bring every service back to the run's last checkpoint; RecoveryFailed when impossible
        or when the services are not back within the run's recovery.timeout_s. Returns early
        (RecoveryFailed "stopped") if stop_requested() turns true."""
        timeout_s = run.spec.recovery.timeout_s
        deadline = self._clock() + timeout_s
        log.warning("run %s: recovering from %s (up to %.0f s)", run.run_id, cause, timeout_s)
        attempt = 0
        while True:
            attempt += 1
            try:
                if stop_requested():
                    raise RecoveryStopped("during recovery")
                resumed = self._resume_once(run, cause)
                log.warning(
                    "run %s: resumed at step %d, version %d after %d attempt(s)",
                    run.run_id,
                    resumed.step,
                    resumed.version,
                    attempt,
                )
                return resumed
            except RecoveryFailed:
                raise
            except Exception as exc:
                if not recoverable(exc):
                    raise RecoveryFailed(f"{cause}; recovery failed: {type(exc).__name__}: {exc}") from exc
                if self._clock() >= deadline:
                    last = f"{type(exc).__name__}: {exc}"
                    # the cause usually is the error recovery kept meeting: say it once
                    tail = " (the same error)" if last in cause else f": {last}"
                    raise RecoveryFailed(
                        f"{cause}; the services were not back within recovery.timeout_s={timeout_s:g}{tail}"
                    ) from exc
                log.info("run %s: recovery attempt %d: %s; retrying", run.run_id, attempt, exc)
                self._sleep(RETRY_S)

    def _resume_once(self, run: Run, cause: str) -> Resumed:
        spec, t, rid = run.spec, self._timeouts, run.run_id
        for name, end in (("rollout", self._rollout.end_run), ("trainer", self._trainer.end_run)):
            try:
                end(rid)
            except NotFoundError:
                log.info("run %s: %s had no state of the run", rid, name)
        ledger = self._store.ledger(rid)
        version = self._trainer.configure_run(trainer_config(run.run_id, run.spec)).policy_version
        checkpoint = ledger.checkpoint()  # the trainer re-recorded the one it resumed from
        step = 0 if checkpoint is None else checkpoint[0]
        if checkpoint is None and ledger.audit(finished_step=spec.steps).trained:
            raise RecoveryFailed(
                f"{cause}; no training checkpoint holds the steps already trained "
                "(start the trainer with --checkpoint-dir)"
            )
        if version > 0:
            self._trainer.publish_weights(rid, version)
            status = self._broker.wait_committed(rid, version, t.commit_s)
            if status.committed_version < version:
                raise TimeoutError(f"version {version} not committed after recovery")
        ledger.record_committed(version)
        self._rollout.configure_run(rollout_config(run.run_id, run.spec))
        self._drain_again(rid)
        restored = _restored_record(ledger.checkpoint_result(step), step, checkpoint)
        self._store.rewind(rid, step, version, f"resumed from step {step} after {cause}", restored)
        ledger.count(RECOVERIES)
        return Resumed(step=step, version=version)

    def _drain_again(self, run_id: str) -> None:
        """The fresh engines of a recovered run are all serving: drain again the ones drained
        through the REST API before (an engine the new set lacks, or the last serving one, is
        left as it is, with a warning)."""
        for engine_id in self._store.drained_engines(run_id):
            try:
                self._rollout.drain_engine(run_id, engine_id)
            except (NotFoundError, ConflictError) as exc:
                log.warning("run %s: %s not drained again after the recovery: %s", run_id, engine_id, exc)
            else:
                log.info("run %s: %s drained again after the recovery", run_id, engine_id)


def _restored_record(
    result: dict[str, Any] | None, step: int, checkpoint: tuple[int, int] | None
) -> StepRecord | None:
    """The record of the checkpointed step rebuilt from the trainer's summary of it (None without one)."""
    if result is None or checkpoint is None or step < 1:
        return None
    metrics = {str(k): float(v) for k, v in dict(result.get("metrics", {})).items()}
    train_s = float(result.get("train_seconds", 0.0))
    return StepRecord(
        step=step,
        reward_mean=metrics.get("reward_mean", 0.0),
        loss=float(result["loss"]),
        policy_version=checkpoint[1],
        samples=int(result.get("num_samples", 0)),
        step_seconds=train_s,
        generate_seconds=0.0,
        train_seconds=train_s,
        sync_seconds=0.0,
        num_tokens=int(result.get("num_tokens", 0)),
        sampled_policy_version=int(result.get("sampled_policy_version", 0)),
        trainer_metrics=metrics,
        staleness_mean=metrics.get(STALENESS_MEAN, 0.0),
        staleness_max=int(metrics.get(STALENESS_MAX, 0.0)),
    )
