"""The RL loop driver with in-process fakes of the services and a real Redis store."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from controller_fakes import fake_stack

from furlong.controller.config import DriverTimeouts
from furlong.controller.core.run_state import RunState
from furlong.controller.core.step_record import sampling_seed
from furlong.controller.driver import RunDriver
from furlong.controller.executor import RunExecutor
from furlong.controller.metrics import ControllerMetrics
from furlong.controller.run_events import RecoveryEvent
from furlong.controller.run_spec import parse_run_spec
from furlong.controller.run_store import RunStore
from furlong.core.errors import UnavailableError
from furlong.core.settings import RolloutSettings, SettingError
from furlong.rollout.core.types import RolloutRunConfig
from furlong.trainer.api import TrainerRunConfig

pytestmark = pytest.mark.integration


def make_spec(steps: int = 3, **extra):
    return parse_run_spec(
        {
            "name": "add",
            "model": "/models/tiny",
            "task": "addition",
            "steps": steps,
            "seed": 7,
            "prompts_per_step": 4,
            "samples_per_prompt": 2,
            **extra,
        }
    )


@pytest.fixture
def env(redis_url):
    store = RunStore.from_url(redis_url)
    fakes = fake_stack()
    metrics = ControllerMetrics()
    driver = RunDriver(store, fakes.services, DriverTimeouts(end_s=1.0), metrics)
    yield store, fakes, driver, metrics
    store.close()


def sample(metrics: ControllerMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_steps_advance_and_metrics_are_recorded(env):
    store, fakes, driver, metrics = env
    run = store.create(make_spec(steps=3))
    final = driver.execute(run.run_id)
    assert final.state == RunState.SUCCEEDED and final.reason == ""
    assert (final.current_step, final.policy_version) == (3, 3)
    steps = store.metrics(run.run_id)
    assert [s.step for s in steps] == [1, 2, 3]
    assert [s.policy_version for s in steps] == [1, 2, 3]
    assert [s.sampled_policy_version for s in steps] == [0, 1, 2]
    assert [s.reward_mean for s in steps] == pytest.approx([0.1, 0.2, 0.3])
    assert [s.loss for s in steps] == pytest.approx([1.0, 0.5, 1 / 3])
    assert all(s.samples == 8 and s.num_tokens == 24 for s in steps)
    assert steps[1].trainer_metrics == {"grad_norm": 1.0, "clip_fraction": 0.0}
    for s in steps:
        assert s.step_seconds >= s.generate_seconds + s.train_seconds + s.sync_seconds - 1e-9
    # what the services were asked
    assert fakes.rollout.configured[run.run_id] == RolloutRunConfig(
        run_id=run.run_id, model_dir="/models/tiny", seed=7, task="addition", rollout=RolloutSettings()
    )
    assert fakes.trainer.configured[run.run_id] == TrainerRunConfig(
        run_id=run.run_id,
        model_dir="/models/tiny",
        algorithm=run.spec.algorithm,
        sampling_temperature=1.0,
        seed=7,
        total_steps=3,
        checkpoint=run.spec.checkpoint,
    )
    calls = fakes.rollout.generate_calls
    assert [c.min_policy_version for c in calls] == [0, 1, 2]
    assert [c.sampling.seed for c in calls] == [sampling_seed(7, s) for s in (1, 2, 3)]
    assert [c.sampling.settings() for c in calls] == [run.spec.sampling] * 3
    assert [(c.num_groups, c.samples_per_prompt, c.prompts) for c in calls] == [(4, 2, ())] * 3
    assert fakes.rollout.ended == fakes.trainer.ended == fakes.broker.ended == [run.run_id]
    # Prometheus
    assert sample(metrics, "furlong_controller_runs_total", state="succeeded") == 1
    assert sample(metrics, "furlong_controller_reward_mean", run_id=run.run_id) == pytest.approx(0.3)
    assert sample(metrics, "furlong_controller_policy_version", run_id=run.run_id) == 3
    assert sample(metrics, "furlong_controller_step_seconds_count") == 3
    assert sample(metrics, "furlong_controller_active_runs") == 0


def test_service_error_fails_the_run_with_reason(env):
    store, fakes, driver, metrics = env
    fakes.faults.raise_in["train_step"] = UnavailableError("trainer went away")
    run = store.create(make_spec(recovery={"max_attempts": 0}))
    final = driver.execute(run.run_id)
    assert final.state == RunState.FAILED
    assert final.reason == "step 1 trainer.TrainStep: UnavailableError: trainer went away"
    assert store.metrics(run.run_id) == []
    assert fakes.trainer.ended == [run.run_id]  # teardown still ran
    assert sample(metrics, "furlong_controller_runs_total", state="failed") == 1


def test_configure_error_and_unknown_task(env):
    store, fakes, driver, _ = env
    fakes.faults.raise_in["rollout.configure_run"] = ValueError("no such checkpoint /models/tiny")
    run = store.create(make_spec())
    final = driver.execute(run.run_id)
    assert final.state == RunState.FAILED
    assert final.reason.startswith("rollout.ConfigureRun: ValueError: no such checkpoint")
    assert fakes.trainer.runs == {}  # the trainer was never configured
    fakes.faults.raise_in.clear()
    with pytest.raises(SettingError, match="task: must be one of") as info:
        parse_run_spec({"name": "x", "model": "/m", "task": "sorting", "steps": 1})
    assert info.value.field == "task"


def test_teardown_error_turns_success_into_failure(env):
    store, fakes, driver, _ = env
    fakes.faults.raise_in["broker.end_run"] = UnavailableError("broker gone")
    run = store.create(make_spec(steps=1))
    final = driver.execute(run.run_id)
    assert final.state == RunState.FAILED
    assert final.reason == "teardown: broker.EndRun: UnavailableError: broker gone"
    assert final.current_step == 1


def test_uncommitted_version_fails(env):
    store, fakes, driver, _ = env
    fakes.broker.commit = lambda run_id, version: None  # engines never acknowledge
    run = store.create(make_spec(steps=2))
    final = driver.execute(run.run_id)
    assert final.state == RunState.FAILED
    assert final.reason.startswith("step 1 broker.WaitCommitted: TimeoutError: version 1 not committed")


def test_stop_between_phases_cancels(env):
    store, fakes, driver, metrics = env
    gate = threading.Event()
    fakes.faults.gates["generate"] = gate
    run = store.create(make_spec(steps=5))
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("run", driver.execute(run.run_id)))
    worker.start()
    assert fakes.faults.entered.setdefault("generate", threading.Event()).wait(10)
    assert store.get(run.run_id).state == RunState.RUNNING
    flagged = store.request_stop(run.run_id)
    assert flagged.stop_requested and flagged.state == RunState.RUNNING
    gate.set()
    worker.join(10)
    final = result["run"]
    assert final.state == RunState.CANCELLED
    # the reason names the step in progress and the last completed one, which is current_step
    assert final.reason == "stopped by request during step 1 (after rollout.Generate; last completed step 0)"
    assert final.current_step == 0 and store.metrics(run.run_id) == []
    assert fakes.rollout.ended == [run.run_id]
    assert sample(metrics, "furlong_controller_runs_total", state="cancelled") == 1


def test_cancelled_before_start_is_not_started(env):
    store, fakes, driver, _ = env
    run = store.create(make_spec())
    store.request_stop(run.run_id)
    final = driver.execute(run.run_id)
    assert final.state == RunState.CANCELLED
    assert fakes.rollout.configured == {} and fakes.rollout.ended == []


def test_timestamps_are_ordered(env):
    store, _, driver, _ = env
    run = store.create(make_spec(steps=1))
    final = driver.execute(run.run_id)
    assert run.created_at <= final.started_at <= final.finished_at


def test_executor_recovers_orphans_and_runs_pending_in_order(env):
    store, fakes, driver, _ = env
    orphan = store.create(make_spec())
    store.transition(orphan.run_id, RunState.STARTING)
    store.transition(orphan.run_id, RunState.RUNNING)
    first = store.create(make_spec(steps=1))
    second = store.create(make_spec(steps=1))
    executor = RunExecutor(store, driver)
    assert executor.recover() == [first.run_id, second.run_id]
    executor.start()
    deadline = time.monotonic() + 10
    while store.get(second.run_id).state != RunState.SUCCEEDED and time.monotonic() < deadline:
        time.sleep(0.02)
    assert executor.close(5)
    # the orphan resumed (from step 0: no checkpoint) and finished before the queued runs started
    resumed = store.get(orphan.run_id)
    assert resumed.state == RunState.SUCCEEDED, resumed.reason
    assert resumed.current_step == 3
    assert store.get(first.run_id).state == store.get(second.run_id).state == RunState.SUCCEEDED
    assert list(fakes.rollout.configured) == [orphan.run_id, first.run_id, second.run_id]
    assert fakes.rollout.ended[0] == fakes.trainer.ended[0] == orphan.run_id
    assert [e.TYPE.value for _, e in store.events(orphan.run_id).events].count("recovery") == 1


def test_executor_ends_orphans_whose_spec_allows_no_recovery(env):
    store, fakes, driver, _ = env
    orphan = store.create(make_spec(recovery={"max_attempts": 0}))
    store.transition(orphan.run_id, RunState.STARTING)
    store.transition(orphan.run_id, RunState.RUNNING)
    executor = RunExecutor(store, driver)
    assert executor.recover() == []
    executor.start()
    deadline = time.monotonic() + 10
    while not store.get(orphan.run_id).state.terminal and time.monotonic() < deadline:
        time.sleep(0.02)
    assert executor.close(5)
    failed = store.get(orphan.run_id)
    assert failed.state == RunState.FAILED
    assert failed.reason == "controller restarted while the run was running"
    assert fakes.rollout.ended == fakes.trainer.ended == fakes.broker.ended == [orphan.run_id]


def test_a_service_that_goes_away_once_is_recovered_from(env):
    store, fakes, driver, _ = env
    real_train_step = fakes.trainer.train_step
    failures = []

    def flaky(request):
        if request.step == 2 and not failures:
            failures.append(request.step)
            fakes.trainer.runs.pop(request.run_id)  # the trainer "restarted": it forgot the run
            raise UnavailableError("trainer went away")
        return real_train_step(request)

    fakes.trainer.train_step = flaky
    run = store.create(make_spec(steps=3))
    final = driver.execute(run.run_id)
    assert final.state == RunState.SUCCEEDED, final.reason
    assert final.current_step == 3
    assert [r.step for r in store.metrics(run.run_id)] == [1, 2, 3]
    recovery = [e for _, e in store.events(run.run_id).events if isinstance(e, RecoveryEvent)]
    assert len(recovery) == 1
    assert "step 2 trainer.TrainStep: UnavailableError: trainer went away" in recovery[0].reason
    # the fakes keep no checkpoint: the run went back to step 0 and asked for steps 1-2 again
    assert [c.step for c in fakes.rollout.generate_calls] == [1, 2, 1, 2, 3]
    assert store.ledger(run.run_id).audit(finished_step=3).recoveries == 1


def test_a_service_that_stays_away_fails_the_run_after_max_attempts(env):
    store, fakes, driver, _ = env
    fakes.faults.raise_in["train_step"] = UnavailableError("trainer went away")
    run = store.create(make_spec(recovery={"max_attempts": 2, "timeout_s": 5.0}))
    final = driver.execute(run.run_id)
    assert final.state == RunState.FAILED
    assert final.reason == (
        "step 1 trainer.TrainStep: UnavailableError: trainer went away "
        "(after 2 recoveries; recovery.max_attempts=2)"
    )


def test_recovery_times_out_naming_the_service_that_did_not_come_back(env):
    store, fakes, driver, _ = env
    real_train_step = fakes.trainer.train_step

    def dies(request):
        if request.step == 2:
            fakes.faults.raise_in["rollout.end_run"] = UnavailableError("rollout is down")
            raise UnavailableError("rollout is down")
        return real_train_step(request)

    fakes.trainer.train_step = dies
    run = store.create(make_spec(recovery={"max_attempts": 1, "timeout_s": 1.0}))
    final = driver.execute(run.run_id)
    assert final.state == RunState.FAILED
    assert final.reason.startswith(
        "step 2 trainer.TrainStep: UnavailableError: rollout is down; "
        "the services were not back within recovery.timeout_s=1 (the same error); teardown: "
    ), final.reason  # the recovery's last error is not said again


def test_closing_executor_stops_the_active_run_and_leaves_queued_ones_pending(env):
    store, fakes, driver, _ = env
    gate = threading.Event()
    fakes.faults.gates["generate"] = gate
    executor = RunExecutor(store, driver).start()
    active, queued = store.create(make_spec()), store.create(make_spec())
    executor.submit(active.run_id)
    executor.submit(queued.run_id)
    assert fakes.faults.entered.setdefault("generate", threading.Event()).wait(10)
    closer = threading.Thread(target=executor.close, args=(10,))
    closer.start()
    deadline = time.monotonic() + 10
    while not store.get(active.run_id).stop_requested and time.monotonic() < deadline:
        time.sleep(0.02)
    gate.set()
    closer.join(10)
    assert store.get(active.run_id).state == RunState.CANCELLED
    assert store.get(queued.run_id).state == RunState.PENDING


def test_rollout_settings_go_to_rollout_which_decides_the_groups(env):
    store, fakes, driver, _ = env
    run = store.create(make_spec(steps=2, rollout={"over_sampling": 1.5, "max_refill_rounds": 2}))
    final = driver.execute(run.run_id)
    assert final.state == RunState.SUCCEEDED, final.reason
    assert fakes.rollout.configured[run.run_id].rollout == RolloutSettings(
        over_sampling=1.5, max_refill_rounds=2
    )
    # the driver asks for the step's groups; how many prompts to draw and which to cut is rollout's
    assert [(c.num_groups, c.prompts) for c in fakes.rollout.generate_calls] == [(4, ()), (4, ())]
    assert [s.samples for s in store.metrics(run.run_id)] == [8, 8]  # 4 groups x 2 trained


def test_a_step_trains_the_groups_rollout_says_it_has(env):
    store, fakes, driver, _ = env
    original = fakes.rollout.generate

    def fewer(request):  # dynamic sampling dropped one group
        return dataclasses.replace(original(request), num_groups=3, num_groups_dropped=1)

    fakes.rollout.generate = fewer
    run = store.create(make_spec(steps=1, rollout={"max_refill_rounds": 1}))
    assert driver.execute(run.run_id).state == RunState.SUCCEEDED
    assert store.metrics(run.run_id)[0].trainer_metrics["grad_norm"] == 0.5
    fakes.rollout.generate = lambda request: dataclasses.replace(original(request), num_groups=0)
    none_left = store.create(make_spec(steps=1, rollout={"max_refill_rounds": 1}))
    final = driver.execute(none_left.run_id)
    assert final.state == RunState.FAILED and "no group left to train" in final.reason


@pytest.mark.parametrize(
    "rollout, field",
    [
        ({"over_sampling": 0.5}, "rollout.over_sampling"),
        ({"over_sampling": 5.0}, "rollout.over_sampling"),
        ({"max_refill_rounds": -1}, "rollout.max_refill_rounds"),
        ({"max_refill_rounds": 17}, "rollout.max_refill_rounds"),
    ],
)
def test_bad_rollout_filters_are_named(rollout, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        make_spec(rollout=rollout)


def test_dynamic_sampling_needs_groups_of_two():
    with pytest.raises(ValueError, match="samples_per_prompt >= 2"):
        make_spec(rollout={"max_refill_rounds": 1}, samples_per_prompt=1)


def test_policies_are_exported_after_the_last_step_and_every_nth(env):
    store, fakes, driver, _ = env
    run = store.create(
        make_spec(steps=5, checkpoint={"export_every_steps": 2, "export_max_shard_bytes": 4096})
    )
    final = driver.execute(run.run_id)
    assert final.state == RunState.SUCCEEDED, final.reason
    assert [(e.step, e.final) for e in fakes.trainer.exports] == [(2, False), (4, False), (5, True)]
    assert {e.num_bytes for e in fakes.trainer.exports} == {4096}  # the spec's shard size was sent
    root = fakes.trainer.policy_root / run.run_id
    assert [(p.step, p.final, p.path) for p in final.policies] == [
        (2, False, str(root / "checkpoints" / "step-2")),
        (4, False, str(root / "checkpoints" / "step-4")),
        (5, True, str(root / "final")),
    ]
    assert [p["policy_version"] for p in store.get(run.run_id).to_dict()["policies"]] == [2, 4, 5]


def test_by_default_only_the_final_policy_is_exported(env):
    store, fakes, driver, _ = env
    final = driver.execute(store.create(make_spec(steps=3)).run_id)
    assert [(p.step, p.final) for p in final.policies] == [(3, True)]
    assert fakes.trainer.exports[0].num_bytes == 5_000_000_000


def test_a_failed_export_fails_the_run_naming_the_phase(env):
    store, fakes, driver, _ = env
    fakes.trainer.faults.raise_in["trainer.export_policy"] = ValueError("disk full")
    final = driver.execute(store.create(make_spec(steps=2)).run_id)
    assert final.state == RunState.FAILED
    assert final.reason.startswith("step 2 trainer.ExportPolicy: ValueError: disk full")
    assert final.policies == ()


def test_a_step_checkpointed_but_not_recorded_before_a_controller_crash_gets_its_one_record(env):
    """The controller died between the trainer's checkpoint of step 3 and its own record of it: the
    resumed run records step 3 from the trainer's summary, so steps 1..5 have one record each."""
    store, fakes, driver, _ = env
    run = store.create(make_spec(steps=5))
    store.transition(run.run_id, RunState.STARTING)
    store.transition(run.run_id, RunState.RUNNING)
    for step in (1, 2):
        store.record_step(run.run_id, _record(step))
    real_configure = fakes.trainer.configure_run

    def configure_from_checkpoint(config: TrainerRunConfig):
        out = real_configure(config)  # the real trainer resumes from its checkpoint of step 3
        fakes.trainer.runs[config.run_id].update(step=3, version=4)
        ledger = store.ledger(config.run_id)
        ledger.commit_trained([], 3, 3, reconcile=True)
        ledger.record_checkpoint_result(
            3, {"loss": 0.25, "num_samples": 8, "num_tokens": 40, "metrics": {"reward_mean": 0.5}}
        )
        return dataclasses.replace(out, policy_version=4)

    fakes.trainer.configure_run = configure_from_checkpoint
    final = driver.resume(run.run_id)
    assert final.state == RunState.SUCCEEDED, final.reason
    records = store.metrics(run.run_id)
    assert [r.step for r in records] == [1, 2, 3, 4, 5]
    assert (records[2].loss, records[2].samples, records[2].reward_mean) == (0.25, 8, 0.5)
    assert [c.step for c in fakes.rollout.generate_calls] == [4, 5]


def _record(step: int):
    from furlong.controller.core.step_record import StepRecord

    return StepRecord(
        step=step,
        reward_mean=0.0,
        loss=1.0,
        policy_version=step,
        samples=8,
        step_seconds=0.1,
        generate_seconds=0.0,
        train_seconds=0.1,
        sync_seconds=0.0,
    )
