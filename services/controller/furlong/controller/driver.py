"""The synchronous RL loop of one run, driven through the service Protocols.

    configure: rollout.ConfigureRun -> trainer.ConfigureRun            (starting)
    each step: prompts -> rollout.Generate -> trainer.TrainStep
               -> trainer.PublishWeights -> broker.WaitCommitted -> record the step   (running)
    teardown:  rollout.EndRun, trainer.EndRun, broker.EndRun          (stopping)
    then succeeded, cancelled (a stop request was seen between phases) or failed (the first error,
    named by its phase, is the run's reason).
    pause:     a pause request seen before a step moves the run to `paused`; the driver polls the
               store every `DriverTimeouts.pause_poll_s` until the request is cleared (-> running,
               the step goes on) or a stop is requested (-> stopping -> cancelled).
    recovery:  a step that fails because a service or Redis went away (see `run_recovery`) resumes
               the run from its last checkpoint, at most `recovery.max_attempts` times per run;
               `resume` does the same for a run a previous controller process left active.

Every step is recorded in the run's sample ledger: the prompts submitted (only those without a
group in the stream yet, so a repeated step resubmits just what was lost), the groups generated
(scanned from the stream) and every committed policy version.

Every call has a deadline from `DriverTimeouts`. The driver is the only writer of a started run's
state; a stop request only sets `stop_requested`, which the driver checks between phases. Knows
nothing about gRPC, HTTP or how the run was submitted.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from furlong.controller.clients import BrokerClient, RolloutClient, TrainerClient
from furlong.controller.config import DriverTimeouts
from furlong.controller.core.run_state import Run, RunState
from furlong.controller.core.step_record import StepRecord, sampling_seed
from furlong.controller.metrics import ControllerMetrics
from furlong.controller.prompt_source import PromptSource
from furlong.controller.run_recovery import RecoveryFailed, RecoveryStopped, RunRecovery, recoverable
from furlong.controller.run_store import RunStore
from furlong.core.errors import ConflictError, FurlongError, NotFoundError, UnavailableError

log = logging.getLogger(__name__)

T = TypeVar("T")


class _Stopped(Exception):
    """A stop request was seen; `where` names the point between phases."""

    def __init__(self, where: str) -> None:
        super().__init__(where)
        self.where = where


class _PhaseFailed(Exception):
    def __init__(self, phase: str, cause: BaseException) -> None:
        super().__init__(f"{phase}: {type(cause).__name__}: {cause}")
        self.phase = phase
        self.cause = cause


class RunDriver:
    """Executes runs one call of `execute` at a time; not meant for concurrent calls."""

    def __init__(
        self,
        store: RunStore,
        trainer: TrainerClient,
        rollout: RolloutClient,
        broker: BrokerClient,
        prompts: PromptSource,
        timeouts: DriverTimeouts,
        metrics: ControllerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._trainer = trainer
        self._rollout = rollout
        self._broker = broker
        self._prompts = prompts
        self._timeouts = timeouts
        self._metrics = metrics or ControllerMetrics()
        self._clock = clock
        self._recovery = RunRecovery(store, trainer, rollout, broker, prompts, timeouts)

    def execute(self, run_id: str) -> Run:
        """Run a pending run to a terminal state and return it. A run that is no longer pending
        (cancelled meanwhile) is returned unchanged."""
        try:
            run = self._store.transition(run_id, RunState.STARTING, expected=RunState.PENDING)
        except ConflictError as exc:
            log.info("not starting run %s: %s", run_id, exc)
            return self._store.get(run_id)
        self._metrics.entered(RunState.STARTING.value)
        self._metrics.active_runs.inc()
        configured: list[str] = []
        try:
            outcome, reason = self._drive(run, configured)
            return self._finish(run_id, outcome, reason, configured)
        finally:
            self._metrics.active_runs.dec()

    def resume(self, run_id: str) -> Run:
        """Continue a run a previous controller process left active: from its last checkpoint when
        its spec allows recovery, else (or when it was already stopping) end it."""
        run = self._store.get(run_id)
        if run.state.terminal or run.state == RunState.PENDING:
            return run
        configured = ["rollout", "trainer", "broker"]
        self._metrics.active_runs.inc()
        try:
            if run.state == RunState.STOPPING or run.spec.recovery.max_attempts == 0:
                if run.stop_requested:
                    outcome, reason = RunState.CANCELLED, "stopped by request"
                elif run.state == RunState.STOPPING and run.current_step >= run.spec.steps:
                    outcome, reason = RunState.SUCCEEDED, ""
                else:
                    outcome = RunState.FAILED
                    reason = f"controller restarted while the run was {run.state.value}"
                return self._finish(run_id, outcome, reason, configured)
            outcome, reason = self._drive(run, configured, resume=True)
            return self._finish(run_id, outcome, reason, configured)
        finally:
            self._metrics.active_runs.dec()

    def _drive(self, run: Run, configured: list[str], resume: bool = False) -> tuple[RunState, str]:
        attempts = 0
        try:
            if resume:
                attempts = 1
                step, version = self._recover(
                    run, f"controller restarted while the run was {run.state.value}"
                )
            else:
                step, version = 0, -1
            while True:
                try:
                    if version < 0:
                        version = self._configure(run, configured)
                        self._check_stop(run.run_id, "after configure")
                        self._store.transition(run.run_id, RunState.RUNNING)
                        self._metrics.entered(RunState.RUNNING.value)
                    for current in range(step + 1, run.spec.steps + 1):
                        version = self._step(run, current, version)
                    return RunState.SUCCEEDED, ""
                except (_PhaseFailed, UnavailableError) as exc:
                    cause = exc.cause if isinstance(exc, _PhaseFailed) else exc
                    if not recoverable(cause):
                        raise
                    if attempts >= run.spec.recovery.max_attempts:
                        if not attempts:
                            raise
                        log.warning("run %s failed after %d recoveries: %s", run.run_id, attempts, exc)
                        return RunState.FAILED, (
                            f"{_describe(exc)} (after {attempts} recoveries; "
                            f"recovery.max_attempts="
                            f"{run.spec.recovery.max_attempts})"
                        )
                    attempts += 1
                    step, version = self._recover(run, _describe(exc))
        except RecoveryStopped as stop:
            log.info("run %s stopped by request %s", run.run_id, stop)
            return RunState.CANCELLED, f"stopped by request {stop}"
        except RecoveryFailed as exc:
            log.warning("run %s failed: %s", run.run_id, exc)
            return RunState.FAILED, str(exc)
        except _Stopped as stop:
            log.info("run %s stopped by request %s", run.run_id, stop.where)
            return RunState.CANCELLED, f"stopped by request {stop.where}"
        except _PhaseFailed as exc:
            log.warning("run %s failed: %s", run.run_id, exc)
            return RunState.FAILED, str(exc)
        except Exception as exc:  # noqa: BLE001 - any error must end the run, never wedge it
            log.exception("run %s failed outside a service call", run.run_id)
            return RunState.FAILED, f"controller: {type(exc).__name__}: {exc}"

    def _recover(self, run: Run, cause: str) -> tuple[int, int]:
        """Resume from the last checkpoint (RecoveryFailed if impossible); (step, version)."""
        resumed = self._recovery.resume(run, cause, lambda: self._store.get(run.run_id).stop_requested)
        current = self._store.get(run.run_id)
        if current.state in (RunState.STARTING, RunState.PAUSED):
            self._store.transition(run.run_id, RunState.RUNNING)
            self._metrics.entered(RunState.RUNNING.value)
        return resumed.step, resumed.version

    def _call(self, phase: str, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - named by phase and stored as the run's reason
            raise _PhaseFailed(phase, exc) from exc

    def _check_stop(self, run_id: str, where: str) -> None:
        if self._store.get(run_id).stop_requested:
            raise _Stopped(where)

    def _between_steps(self, run_id: str, where: str) -> None:
        run = self._store.get(run_id)
        if run.stop_requested:
            raise _Stopped(f"before {where}")
        if not run.pause_requested:
            return
        self._store.transition(run_id, RunState.PAUSED, expected=RunState.RUNNING)
        self._metrics.entered(RunState.PAUSED.value)
        log.info("run %s paused before %s", run_id, where)
        while True:
            time.sleep(self._timeouts.pause_poll_s)
            run = self._store.get(run_id)
            if run.stop_requested:
                raise _Stopped(f"while paused before {where}")
            if not run.pause_requested:
                break
        self._store.transition(run_id, RunState.RUNNING, expected=RunState.PAUSED)
        self._metrics.entered(RunState.RUNNING.value)
        log.info("run %s resumed before %s", run_id, where)

    def _configure(self, run: Run, configured: list[str]) -> int:
        spec, t = run.spec, self._timeouts
        reward = self._call("task", self._prompts.reward_name, spec.task)
        configured.append("rollout")
        rollout_version = self._call(
            "rollout.ConfigureRun",
            self._rollout.configure_run,
            run.run_id,
            spec.model,
            reward,
            spec.rollout.num_engines,
            spec.seed,
            t.configure_s,
        )
        self._check_stop(run.run_id, "after rollout.ConfigureRun")
        configured.append("trainer")
        configured.append("broker")
        self._call("ledger", self._store.ledger(run.run_id).set_every_steps, spec.checkpoint.every_steps)
        trainer_version = self._call(
            "trainer.ConfigureRun",
            self._trainer.configure_run,
            run.run_id,
            spec.model,
            spec.algorithm,
            spec.seed,
            spec.steps,
            spec.sampling.temperature,
            t.configure_s,
        )
        if rollout_version != trainer_version:
            raise _PhaseFailed(
                "configure",
                ConflictError(
                    f"rollout serves policy version {rollout_version} but the trainer starts from "
                    f"{trainer_version}"
                ),
            )
        self._call("ledger", self._store.ledger(run.run_id).record_committed, trainer_version)
        return trainer_version

    def _step(self, run: Run, step: int, version: int) -> int:
        spec, t, rid = run.spec, self._timeouts, run.run_id
        where = f"step {step}"
        self._between_steps(rid, where)
        started = self._clock()
        prompts = self._call(
            f"{where} prompts",
            self._prompts.prompts,
            spec.task,
            spec.seed,
            step,
            spec.rollout.prompts_to_request(spec.prompts_per_step),
        )
        prompt_ids = [p.prompt_id for p in prompts]
        ledger = self._store.ledger(rid)
        done = self._call(f"{where} ledger", ledger.generated_ids, step, prompt_ids)
        missing = [p for p in prompts if p.prompt_id not in done]
        need = spec.prompts_per_step - len(done)
        gen = None
        if need > 0 and missing:  # after a recovery, groups already in the stream are kept
            self._call(f"{where} ledger", ledger.submit, step, [p.prompt_id for p in missing])
            keep = need if len(missing) > need else 0  # over-sampling: first `need` to complete
            gen = self._call(
                f"{where} rollout.Generate",
                functools.partial(
                    self._rollout.generate, max_refill_rounds=spec.rollout.max_refill_rounds, keep_groups=keep
                ),
                rid,
                step,
                missing,
                spec.samples_per_prompt,
                spec.sampling,
                sampling_seed(spec.seed, step),
                version,
                t.generate_s,
            )
            expected = min(need, len(missing))
            if gen.num_groups > expected or (
                gen.num_groups < expected and not spec.rollout.max_refill_rounds
            ):
                raise _PhaseFailed(
                    f"{where} rollout.Generate",
                    ConflictError(f"rollout wrote {gen.num_groups} groups for {expected} prompts"),
                )
        self._call(f"{where} ledger", ledger.scan_stream)
        num_groups = len(done) + (gen.num_groups if gen else 0)
        if gen is not None and gen.num_groups < len(missing):
            # over-sampling surplus and groups dynamic sampling dropped: never trained
            asked = [p.prompt_id for p in missing]
            kept = self._call(f"{where} ledger", ledger.generated_ids, step, asked)
            self._call(f"{where} ledger", ledger.cut, step, [i for i in asked if i not in kept])
        if num_groups == 0:
            raise _PhaseFailed(
                f"{where} rollout.Generate",
                ConflictError(
                    f"no group left to train: dynamic sampling dropped all {len(missing)} groups "
                    f"(equal rewards after {spec.rollout.max_refill_rounds} refill rounds)"
                ),
            )
        generated = self._clock()
        self._check_stop(rid, f"after {where} rollout.Generate")
        train = self._call(
            f"{where} trainer.TrainStep", self._trainer.train_step, rid, step, num_groups, t.train_s
        )
        if train.policy_version <= version:
            raise _PhaseFailed(
                f"{where} trainer.TrainStep",
                ConflictError(f"trainer produced policy version {train.policy_version} after {version}"),
            )
        trained = self._clock()
        self._check_stop(rid, f"after {where} trainer.TrainStep")
        new_version = train.policy_version
        self._call(
            f"{where} trainer.PublishWeights", self._trainer.publish_weights, rid, new_version, t.publish_s
        )
        status = self._call(
            f"{where} broker.WaitCommitted", self._broker.wait_committed, rid, new_version, t.commit_s
        )
        if status.committed_version < new_version:
            raise _PhaseFailed(
                f"{where} broker.WaitCommitted",
                TimeoutError(
                    f"version {new_version} not committed (committed {status.committed_version}, "
                    f"pending engines {list(status.pending_engine_ids)})"
                ),
            )
        self._call(f"{where} ledger", ledger.record_committed, new_version)
        synced = self._clock()
        record = StepRecord(
            step=step,
            reward_mean=gen.reward_mean if gen else train.metrics.get("reward_mean", 0.0),
            loss=train.loss,
            policy_version=new_version,
            samples=gen.num_samples if gen else train.num_samples,
            step_seconds=synced - started,
            generate_seconds=generated - started,
            train_seconds=trained - generated,
            sync_seconds=synced - trained,
            num_tokens=gen.num_tokens if gen else 0,
            sampled_policy_version=gen.policy_version if gen else version,
            trainer_metrics=dict(train.metrics),
        )
        self._store.record_step(rid, record)
        self._observe(rid, record)
        return new_version

    def _observe(self, run_id: str, record: StepRecord) -> None:
        m = self._metrics
        m.steps_total.inc()
        m.step_seconds.observe(record.step_seconds)
        m.phase_seconds.labels(phase="generate").observe(record.generate_seconds)
        m.phase_seconds.labels(phase="train").observe(record.train_seconds)
        m.phase_seconds.labels(phase="sync").observe(record.sync_seconds)
        m.reward_mean.labels(run_id=run_id).set(record.reward_mean)
        m.loss.labels(run_id=run_id).set(record.loss)
        m.policy_version.labels(run_id=run_id).set(record.policy_version)
        if record.generate_seconds > 0:
            m.tokens_per_second.labels(run_id=run_id).set(record.num_tokens / record.generate_seconds)

    def _finish(self, run_id: str, outcome: RunState, reason: str, configured: list[str]) -> Run:
        try:
            self._store.transition(run_id, RunState.STOPPING)
            self._metrics.entered(RunState.STOPPING.value)
        except FurlongError as exc:
            log.warning("run %s: could not enter stopping: %s", run_id, exc)
        problems = self._teardown(run_id, configured)
        if problems:
            note = "teardown: " + "; ".join(problems)
            reason = f"{reason}; {note}" if reason else note
            if outcome == RunState.SUCCEEDED:
                outcome = RunState.FAILED
        run = self._store.transition(run_id, outcome, reason=reason)
        self._metrics.entered(outcome.value)
        return run

    def end_on_services(self, run_id: str) -> list[str]:
        """EndRun on every service for a run whose driver is gone (a previous controller process
        died mid-run), so no service keeps its state; the problems, as text (also logged)."""
        problems = self._teardown(run_id, ["rollout", "trainer", "broker"])
        for problem in problems:
            log.warning("run %s: ending an orphaned run: %s", run_id, problem)
        return problems

    def _teardown(self, run_id: str, configured: list[str]) -> list[str]:
        """EndRun on every service the run touched, in order; the problems, as text."""
        ends = {
            "rollout": self._rollout.end_run,
            "trainer": self._trainer.end_run,
            "broker": self._broker.end_run,
        }
        problems = []
        for name in ("rollout", "trainer", "broker"):
            if name not in configured:
                continue
            try:
                ends[name](run_id, self._timeouts.end_s)
            except NotFoundError:
                log.info("run %s: %s had nothing to end", run_id, name)
            except Exception as exc:  # noqa: BLE001 - every service must get its EndRun
                problems.append(f"{name}.EndRun: {type(exc).__name__}: {exc}")
        return problems


def _describe(exc: BaseException) -> str:
    """The failure that started a recovery, as the run's events and reason name it."""
    if isinstance(exc, _PhaseFailed):
        return str(exc)
    return f"controller: {type(exc).__name__}: {exc}"
