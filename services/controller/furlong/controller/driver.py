"""The RL loop of one run, driven through the services' own clients (`services`).

    configure: rollout.ConfigureRun -> trainer.ConfigureRun            (starting)
    each step: rollout.Generate -> trainer.TrainStep
               -> trainer.PublishWeights -> broker.WaitCommitted
               -> rollout.Evaluate after the last step and every `eval.every_steps`-th (when
                  `eval` is on; the committed policy on `data.eval`, nothing trained)
               -> record the step   (running)
               -> trainer.ExportPolicy after the last step and every
                  `checkpoint.export_every_steps`-th (a Hugging Face directory, recorded in the run)
    teardown:  rollout.EndRun, trainer.EndRun, broker.EndRun          (stopping)
    then succeeded, cancelled (a stop request was seen between phases) or failed (the first error,
    named by its phase, is the run's reason).
    pause:     a pause request seen before a step moves the run to `paused`; the driver polls the
               store every `DriverTimeouts.pause_poll_s` until the request is cleared (-> running,
               the step goes on) or a stop is requested (-> stopping -> cancelled).
    recovery:  a step that fails because a service or Redis went away (see `run_recovery`) resumes
               the run from its last checkpoint, at most `recovery.max_attempts` times per run;
               `resume` does the same for a run a previous controller process left active.
    asynchronous mode (`rollout.max_staleness` K > 0): the same calls, but a worker thread issues
               rollout.Generate for steps s+1 .. s+K (in step order, each with at least the
               version committed when it is issued) while this thread trains, publishes and
               records step s (`core.step_pacing`), so no trained sample is more than K versions
               old; engines take each new version between generations. A generation in flight
               ends before an evaluation, a recovery or the teardown.

Rollout owns a step's groups: it draws the prompts, decides which groups are written (over-sampling,
dynamic sampling, the groups an earlier attempt at the step wrote) and records them in the run's
group ledger; the driver asks for `prompts_per_step` groups and trains on the groups rollout says
the step has. The driver records every committed policy version in the group ledger.

Every call has a deadline from `DriverTimeouts` (the services' clients carry them). The driver is
the only writer of a started run's state; a stop request only sets `stop_requested`, which the
driver checks between phases. Knows nothing about gRPC, HTTP or how the run was submitted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TypeVar

from furlong.controller.config import DriverTimeouts
from furlong.controller.core.eval_metrics import PASS_AT_1, PASS_AT_K, REWARD_MEAN, SECONDS, eval_metrics
from furlong.controller.core.run_state import PolicyRef, Run, RunState
from furlong.controller.core.step_pacing import steps_to_generate
from furlong.controller.core.step_record import StepRecord
from furlong.controller.metrics import ControllerMetrics
from furlong.controller.run_recovery import RecoveryFailed, RecoveryStopped, RunRecovery, recoverable
from furlong.controller.run_requests import (
    evaluate_request,
    generate_request,
    rollout_config,
    train_request,
    trainer_config,
)
from furlong.controller.run_store import RunStore
from furlong.controller.services import Services
from furlong.core.errors import ConflictError, FurlongError, NotFoundError, UnavailableError
from furlong.rollout.api import GenerateResult
from furlong.trainer.api import STALENESS_MAX, STALENESS_MEAN

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


@dataclass(frozen=True)
class _Timing:
    """When a step started and its generation was in hand (controller clock), and how long
    generating it took (asynchronous mode: while earlier steps trained)."""

    started: float
    generated: float
    generate_seconds: float


class RunDriver:
    """Executes runs one call of `execute` at a time; not meant for concurrent calls."""

    def __init__(
        self,
        store: RunStore,
        services: Services,
        timeouts: DriverTimeouts,
        metrics: ControllerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._trainer = services.trainer
        self._rollout = services.rollout
        self._broker = services.broker
        self._timeouts = timeouts
        self._metrics = metrics or ControllerMetrics()
        self._clock = clock
        self._recovery = RunRecovery(store, services, timeouts)

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
                    if run.spec.rollout.max_staleness:
                        version = self._steps_overlapped(run, step, version)
                    else:
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
        except Exception as exc:
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
        except Exception as exc:
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
        configured.append("rollout")
        rollout = self._call(
            "rollout.ConfigureRun", self._rollout.configure_run, rollout_config(run.run_id, run.spec)
        )
        self._check_stop(run.run_id, "after rollout.ConfigureRun")
        configured.append("trainer")
        configured.append("broker")
        trainer = self._call(
            "trainer.ConfigureRun", self._trainer.configure_run, trainer_config(run.run_id, run.spec)
        )
        if rollout.policy_version != trainer.policy_version:
            raise _PhaseFailed(
                "configure",
                ConflictError(
                    f"rollout serves policy version {rollout.policy_version} but the trainer starts "
                    f"from {trainer.policy_version}"
                ),
            )
        self._call("ledger", self._store.ledger(run.run_id).record_committed, trainer.policy_version)
        return trainer.policy_version

    def _step(self, run: Run, step: int, version: int) -> int:
        """One step of the synchronous loop: generate with `version`, train, publish, record."""
        self._between_steps(run.run_id, f"step {step}")
        started = self._clock()
        gen = self._generate(run, step, version)
        generated = self._clock()
        return self._train_step(run, step, version, gen, _Timing(started, generated, generated - started))

    def _steps_overlapped(self, run: Run, done: int, version: int) -> int:
        """The steps after `done` in asynchronous mode (`rollout.max_staleness` K > 0): one worker
        thread generates the steps in order, up to K steps ahead of the one being trained
        (`core.step_pacing`), each with at least the version committed when it was requested; this
        thread trains, publishes and records them. Returns the last committed version."""
        spec, rid = run.spec, run.run_id
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"generate-{rid}")
        requested: dict[int, Future[tuple[GenerateResult, float]]] = {}
        next_unrequested = done + 1
        try:
            for step in range(done + 1, spec.steps + 1):
                self._between_steps(rid, f"step {step}")
                started = self._clock()
                window = steps_to_generate(step, next_unrequested, spec.steps, spec.rollout.max_staleness)
                for ahead in window:
                    requested[ahead] = pool.submit(self._timed_generate, run, ahead, version)
                    next_unrequested = ahead + 1
                gen, generate_s = requested.pop(step).result()
                generated = self._clock()
                self._check_staleness(run, step, version, gen)
                if spec.eval.evaluates_at(step, spec.steps):
                    # rollout evaluates between generations, not during one
                    wait(requested.values())
                version = self._train_step(run, step, version, gen, _Timing(started, generated, generate_s))
            return version
        finally:
            for future in requested.values():
                future.cancel()
            pool.shutdown(wait=True)  # a generation in flight ends (or fails) before recovery or teardown

    def _timed_generate(self, run: Run, step: int, min_version: int) -> tuple[GenerateResult, float]:
        started = self._clock()
        gen = self._generate(run, step, min_version)
        return gen, self._clock() - started

    def _check_staleness(self, run: Run, step: int, version: int, gen: GenerateResult) -> None:
        """The step's newly drawn samples are at most `rollout.max_staleness` versions behind the
        version that trains them (`version`, the trainer's now)."""
        limit = run.spec.rollout.max_staleness
        if gen.num_samples and version - gen.policy_version > limit:
            raise _PhaseFailed(
                f"step {step} rollout.Generate",
                ConflictError(
                    f"samples drawn with version {gen.policy_version} would be trained with version "
                    f"{version}, {version - gen.policy_version} versions later "
                    f"(rollout.max_staleness {limit})"
                ),
            )

    def _generate(self, run: Run, step: int, min_version: int) -> GenerateResult:
        """Rollout draws the step's prompts and decides which groups are written; after a recovery
        the groups an earlier attempt wrote count (num_groups_resumed) and are not drawn again
        (in asynchronous mode: unless drawn with a version older than `min_version`)."""
        spec, where = run.spec, f"step {step}"
        gen = self._call(
            f"{where} rollout.Generate",
            self._rollout.generate,
            generate_request(run.run_id, spec, step, min_version, self._timeouts),
        )
        if gen.num_groups == 0:
            raise _PhaseFailed(
                f"{where} rollout.Generate",
                ConflictError(
                    f"no group left to train: dynamic sampling dropped all {gen.num_groups_dropped} groups "
                    f"(equal rewards after {spec.rollout.max_refill_rounds} refill rounds)"
                    + (
                        f"; {gen.num_reward_failures} groups' rewards failed"
                        if gen.num_reward_failures
                        else ""
                    )
                ),
            )
        return gen

    def _train_step(self, run: Run, step: int, version: int, gen: GenerateResult, timing: _Timing) -> int:
        """Train the step's groups with `version`, publish and commit the new version, evaluate and
        export when due, record the step; returns the new version."""
        spec, t, rid = run.spec, self._timeouts, run.run_id
        where = f"step {step}"
        # "during step N": step N did not complete, so the reason never names it as done
        self._check_stop(rid, f"during {where} (after rollout.Generate; last completed step {step - 1})")
        train = self._call(
            f"{where} trainer.TrainStep",
            self._trainer.train_step,
            train_request(rid, spec, step, gen.num_groups, t),
        )
        if train.policy_version <= version:
            raise _PhaseFailed(
                f"{where} trainer.TrainStep",
                ConflictError(f"trainer produced policy version {train.policy_version} after {version}"),
            )
        trained = self._clock()
        self._check_stop(rid, f"during {where} (after trainer.TrainStep; last completed step {step - 1})")
        new_version = train.policy_version
        self._call(f"{where} trainer.PublishWeights", self._trainer.publish_weights, rid, new_version)
        self._wait_committed(rid, step, new_version)
        self._call(f"{where} ledger", self._store.ledger(rid).record_committed, new_version)
        synced = self._clock()
        evaluated = self._evaluate(run, step, new_version) if spec.eval.evaluates_at(step, spec.steps) else {}
        fresh = gen.num_samples > 0  # else every group was written by an earlier attempt
        sampled = gen.policy_version if fresh else version
        record = StepRecord(
            step=step,
            reward_mean=gen.reward_mean if fresh else train.metrics.get("reward_mean", 0.0),
            loss=train.loss,
            policy_version=new_version,
            samples=gen.num_samples if fresh else train.num_samples,
            step_seconds=synced - timing.started,
            generate_seconds=timing.generate_seconds,
            train_seconds=trained - timing.generated,
            sync_seconds=synced - trained,
            num_tokens=gen.num_tokens,
            sampled_policy_version=sampled,
            trainer_metrics=dict(train.metrics),
            reward_failures=gen.num_reward_failures,
            eval_metrics=evaluated,
            # a trainer that does not report them: the oldest sample the step drew bounds both
            staleness_mean=train.metrics.get(STALENESS_MEAN, float(version - sampled)),
            staleness_max=int(train.metrics.get(STALENESS_MAX, version - sampled)),
        )
        self._store.record_step(rid, record)
        self._observe(rid, record)
        if spec.checkpoint.exports_at(step, spec.steps):
            self._export(rid, step, spec.checkpoint.export_max_shard_bytes)
        return new_version

    def _wait_committed(self, run_id: str, step: int, version: int) -> None:
        """Wait until every engine acknowledged `version`. When it fails, the engines may have lost
        their source: a trainer killed after PublishWeights answered and before the engines pulled
        the weights. Asking the trainer for the same version again tells: a trainer that still holds
        the run refuses it (the version is published) or ignores it, and the failure stands; a
        restarted one does not know the run (NotFoundError) and a dead one cannot be reached
        (UnavailableError), and that recoverable error is the step's failure instead."""
        phase = f"step {step} broker.WaitCommitted"
        try:
            status = self._call(phase, self._broker.wait_committed, run_id, version, self._timeouts.commit_s)
            if status.committed_version < version:
                raise _PhaseFailed(
                    phase,
                    TimeoutError(
                        f"version {version} not committed (committed {status.committed_version}, "
                        f"pending engines {list(status.pending_engine_ids)})"
                    ),
                )
        except _PhaseFailed as failed:
            if recoverable(failed.cause):
                raise
            try:
                self._trainer.publish_weights(run_id, version)
            except Exception as probe:  # noqa: BLE001 - only a recoverable answer changes the outcome
                if recoverable(probe):
                    log.warning(
                        "run %s: version %d failed and the trainer is gone: %s", run_id, version, probe
                    )
                    raise _PhaseFailed(f"{phase} (trainer.PublishWeights)", probe) from failed
            raise

    def _evaluate(self, run: Run, step: int, version: int) -> dict[str, float]:
        """The metrics of the committed policy `version` on the run's evaluation rows."""
        phase = f"step {step} rollout.Evaluate"
        started = self._clock()
        request = evaluate_request(run.run_id, run.spec, step, version, self._timeouts)
        result = self._call(phase, self._rollout.evaluate, request)
        if result.policy_version < version:
            raise _PhaseFailed(
                phase,
                ConflictError(f"evaluated policy version {result.policy_version}, not {version}"),
            )
        settings = run.spec.eval
        groups = [g.rewards for g in result.groups]
        metrics = self._call(
            phase, eval_metrics, groups, settings.pass_threshold, settings.samples_per_prompt
        )
        metrics[SECONDS] = self._clock() - started
        log.info("run %s step %d evaluation: %s", run.run_id, step, metrics)
        return metrics

    def _export(self, run_id: str, step: int, max_shard_bytes: int) -> None:
        """Have the trainer write the policy of `step` under its policy directory; record where."""
        exported = self._call(
            f"step {step} trainer.ExportPolicy", self._trainer.export_policy, run_id, "", max_shard_bytes
        )
        if exported.step != step:
            raise _PhaseFailed(
                f"step {step} trainer.ExportPolicy",
                ConflictError(f"the trainer exported the policy of step {exported.step}, not {step}"),
            )
        ref = PolicyRef(
            step=exported.step,
            path=exported.path,
            policy_version=exported.policy_version,
            final=exported.final,
            shards=exported.shards,
            created_at=time.time(),
        )
        self._call(f"step {step} record policy", self._store.record_policy, run_id, ref)

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
        m.staleness_mean.labels(run_id=run_id).set(record.staleness_mean)
        m.staleness_max.labels(run_id=run_id).set(record.staleness_max)
        if record.eval_metrics:
            m.eval_reward_mean.labels(run_id=run_id).set(record.eval_metrics[REWARD_MEAN])
            m.eval_pass_at_1.labels(run_id=run_id).set(record.eval_metrics[PASS_AT_1])
            m.eval_pass_at_k.labels(run_id=run_id).set(record.eval_metrics[PASS_AT_K])
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
                ends[name](run_id)
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
