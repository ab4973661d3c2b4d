"""Asynchronous mode (`rollout.max_staleness` K > 0) of the RL loop driver, with the in-process fakes
of the services and a real Redis store: generation of the next K steps overlaps the training of a
step, every generation asks for the version committed when it was issued, and no step trains
samples more than K versions old."""

from __future__ import annotations

import threading

import pytest
from controller_fakes import fake_stack
from polling import wait_until

from furlong.controller.config import DriverTimeouts
from furlong.controller.core.run_state import RunState
from furlong.controller.core.step_pacing import steps_to_generate
from furlong.controller.driver import RunDriver
from furlong.controller.metrics import ControllerMetrics
from furlong.controller.run_events import RecoveryEvent
from furlong.controller.run_spec import parse_run_spec
from furlong.controller.run_store import RunStore
from furlong.core.errors import ConflictError, UnavailableError


def async_spec(steps: int, max_staleness: int, **extra):
    return parse_run_spec(
        {
            "name": "add-async",
            "model": "/models/tiny",
            "task": "addition",
            "steps": steps,
            "seed": 7,
            "prompts_per_step": 4,
            "samples_per_prompt": 2,
            "rollout": {"max_staleness": max_staleness},
            "algorithm": {"off_policy": "tis"},
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


@pytest.mark.unit
def test_steps_to_generate_run_at_most_max_staleness_ahead():
    assert list(steps_to_generate(1, 1, 10, 0)) == [1]
    assert list(steps_to_generate(1, 1, 10, 1)) == [1, 2]
    assert list(steps_to_generate(2, 3, 10, 1)) == [3]
    assert list(steps_to_generate(2, 3, 10, 2)) == [3, 4]
    assert list(steps_to_generate(9, 11, 10, 2)) == []  # never past the last step
    assert list(steps_to_generate(4, 2, 10, 0)) == [2, 3, 4]  # a step not requested yet is requested now
    with pytest.raises(ValueError, match="max_staleness must be >= 0, got -1"):
        steps_to_generate(1, 1, 10, -1)
    with pytest.raises(ValueError, match=r"step must be in \[1, 10\], got 11"):
        steps_to_generate(11, 1, 10, 1)


@pytest.mark.integration
def test_the_next_step_is_generated_while_a_step_trains(env):
    store, fakes, driver, metrics = env
    gate = fakes.faults.gates["train_step"] = threading.Event()
    run = store.create(async_spec(steps=4, max_staleness=1))
    result = {}
    thread = threading.Thread(target=lambda: result.update(final=driver.execute(run.run_id)))
    thread.start()
    try:
        assert fakes.faults.entered.setdefault("train_step", threading.Event()).wait(30)
        # step 1 is training (blocked) and step 2 is generated meanwhile
        wait_until(lambda: len(fakes.rollout.generate_calls) >= 2, 30, "the generation of step 2")
        assert [c.step for c in fakes.rollout.generate_calls] == [1, 2]
        assert fakes.trainer.runs[run.run_id]["step"] == 0  # step 1 is not trained yet
    finally:
        gate.set()
        thread.join(60)
    final = result["final"]
    assert final.state == RunState.SUCCEEDED, final.reason
    calls = fakes.rollout.generate_calls
    assert [c.step for c in calls] == [1, 2, 3, 4]
    # step m is requested while step m-1 trains, with the version committed before that step
    assert [c.min_policy_version for c in calls] == [0, 0, 1, 2]
    records = store.metrics(run.run_id)
    assert [r.policy_version for r in records] == [1, 2, 3, 4]
    assert [r.sampled_policy_version for r in records] == [0, 0, 1, 2]
    assert [r.staleness_max for r in records] == [0, 1, 1, 1]
    assert [r.staleness_mean for r in records] == [0.0, 1.0, 1.0, 1.0]
    labels = {"run_id": run.run_id}
    assert metrics.registry.get_sample_value("furlong_controller_staleness_max_versions", labels) == 1
    assert metrics.registry.get_sample_value("furlong_controller_staleness_mean_versions", labels) == 1


@pytest.mark.integration
def test_generation_runs_at_most_max_staleness_steps_ahead(env):
    store, fakes, driver, _ = env
    run = store.create(async_spec(steps=5, max_staleness=2))
    final = driver.execute(run.run_id)
    assert final.state == RunState.SUCCEEDED, final.reason
    assert [c.min_policy_version for c in fakes.rollout.generate_calls] == [0, 0, 0, 1, 2]
    records = store.metrics(run.run_id)
    assert [r.staleness_max for r in records] == [0, 1, 2, 2, 2]
    assert max(r.policy_version - 1 - r.sampled_policy_version for r in records) == 2


@pytest.mark.integration
def test_a_synchronous_run_is_unchanged(env):
    store, fakes, driver, _ = env
    spec = async_spec(steps=3, max_staleness=0)
    run = store.create(spec)
    final = driver.execute(run.run_id)
    assert final.state == RunState.SUCCEEDED, final.reason
    assert [c.min_policy_version for c in fakes.rollout.generate_calls] == [0, 1, 2]
    assert [r.staleness_max for r in store.metrics(run.run_id)] == [0, 0, 0]


@pytest.mark.integration
def test_an_asynchronous_run_recovers_and_generates_again_from_the_checkpoint(env):
    store, fakes, driver, _ = env
    real_train_step = fakes.trainer.train_step
    failures = []

    def flaky(request):
        if request.step == 3 and not failures:
            failures.append(request.step)
            fakes.trainer.runs.pop(request.run_id)  # the trainer "restarted": it forgot the run
            raise UnavailableError("trainer went away")
        return real_train_step(request)

    fakes.trainer.train_step = flaky
    run = store.create(async_spec(steps=4, max_staleness=1))
    final = driver.execute(run.run_id)
    assert final.state == RunState.SUCCEEDED, final.reason
    assert [r.step for r in store.metrics(run.run_id)] == [1, 2, 3, 4]
    recovery = [e for _, e in store.events(run.run_id).events if isinstance(e, RecoveryEvent)]
    assert len(recovery) == 1 and "step 3 trainer.TrainStep" in recovery[0].reason
    # steps 3 and 4 were generated before the failure; the fakes keep no checkpoint, so the run
    # went back to step 0 and generated from step 1 again, never more than one step ahead
    assert [c.step for c in fakes.rollout.generate_calls] == [1, 2, 3, 4, 1, 2, 3, 4]
    assert all(r.staleness_max <= 1 for r in store.metrics(run.run_id))


@pytest.mark.integration
def test_a_version_lost_with_its_trainer_is_recovered_from_and_a_failed_one_with_a_live_trainer_is_not(
    env,
):
    store, fakes, driver, _ = env
    real_wait = fakes.broker.wait_committed
    failures = []

    def engines_lost_their_source(run_id, version, timeout_s):
        if version == 2 and not failures:
            failures.append(version)
            fakes.trainer.runs.pop(run_id)  # the trainer died after PublishWeights answered
            raise ConflictError("every engine was fenced: round 0: NIXL_ERR_REMOTE_DISCONNECT")
        return real_wait(run_id, version, timeout_s)

    fakes.broker.wait_committed = engines_lost_their_source
    run = store.create(async_spec(steps=3, max_staleness=1))
    final = driver.execute(run.run_id)
    assert final.state == RunState.SUCCEEDED, final.reason
    recovery = [e for _, e in store.events(run.run_id).events if isinstance(e, RecoveryEvent)]
    assert len(recovery) == 1
    assert "step 2 broker.WaitCommitted (trainer.PublishWeights): NotFoundError" in recovery[0].reason

    # the same failure while the trainer still holds the run is the run's failure
    def always_fenced(run_id, version, timeout_s):
        raise ConflictError("every engine was fenced")

    fakes.broker.wait_committed = always_fenced
    other = store.create(async_spec(steps=2, max_staleness=1, recovery={"max_attempts": 2}))
    failed = driver.execute(other.run_id)
    assert failed.state == RunState.FAILED
    assert failed.reason.startswith("step 1 broker.WaitCommitted: ConflictError: every engine was fenced")
