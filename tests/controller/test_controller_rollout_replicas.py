"""Rollout replicas behind the controller's `ReplicatedRollout`, with real rollout services (their
in-process twins), real Redis and, for whole runs, the real trainer and broker in one process:
each step is split into one share per live replica; a replica that loses the run (as a restarted
one does) has its share served by another, nothing is lost or written twice, and it joins again;
engine status and draining reach every replica."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import redis
import yaml

from furlong.controller.core.run_state import RunState
from furlong.controller.in_process import InProcessStack
from furlong.controller.rollout_replicas import ReplicatedRollout
from furlong.controller.run_spec import parse_run_spec
from furlong.core.errors import NotFoundError
from furlong.core.samples import STREAM_FIELD, SampleGroup, stream_key
from furlong.core.settings import RolloutSettings
from furlong.ledger.group_ledger import audit
from furlong.rollout import client as rollout_client
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.service import RolloutService
from furlong.rollout.core.types import GenerateRequest, RolloutRunConfig
from furlong.rollout.run_records import redis_records

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
from rollout_models import write_checkpoint

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "addition"
RUN = "replicated"
SAMPLING = SamplingConfig(temperature=1.0, top_k=8, max_new_tokens=6, seed=2)


def wait_for(predicate, timeout_s: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s}s"
        time.sleep(0.05)


@pytest.fixture
def replicated(redis_url, tmp_path):
    red = redis.Redis.from_url(redis_url)
    services = [RolloutService(redis_records(red), None, max_batch_size=8, replica_id=k) for k in range(2)]
    client = ReplicatedRollout([rollout_client.make_client(s) for s in services], rejoin_interval_s=0.05)
    config = RolloutRunConfig(
        run_id=RUN,
        model_dir=str(write_checkpoint(tmp_path / "policy", seed=9)),
        seed=4,
        task="addition",
        rollout=RolloutSettings(num_engines=2),
    )
    yield client, services, red, config
    client.close()
    for s in services:
        s.close()
    red.close()


def request(step: int, num_groups: int) -> GenerateRequest:
    return GenerateRequest(
        run_id=RUN, step=step, samples_per_prompt=2, sampling=SAMPLING, num_groups=num_groups, timeout_s=30.0
    )


def written(red, step: int) -> list[str]:
    groups = (SampleGroup.decode(f[STREAM_FIELD]) for _, f in red.xrange(stream_key(RUN)))
    return [g.prompt_id for g in groups if g.step == step]


def shares(client: ReplicatedRollout) -> list[int]:
    return [int(r["shares"]) for r in client.replicas()]  # type: ignore[call-overload]


def test_a_step_is_split_over_the_replicas_and_merged(replicated):
    client, services, red, config = replicated
    info = client.configure_run(config)
    assert info.engine_ids == [f"{RUN}-r{k}-engine-{i}" for k in range(2) for i in range(2)]
    result = client.generate(request(1, 5))
    assert (result.num_groups, result.num_samples) == (5, 10)
    assert shares(client) == [1, 1]
    ids = written(red, 1)
    assert len(ids) == 5 == len(set(ids))
    assert len(result.request_id.split(",")) == 2  # each share's ledger request
    status = client.status(RUN)
    assert [e.engine_id for e in status.engines] == info.engine_ids
    assert status.ledger.done == 10
    drained = client.drain_engine(RUN, f"{RUN}-r1-engine-0")  # the replica that has it
    assert drained.engine_id == f"{RUN}-r1-engine-0"
    with pytest.raises(NotFoundError, match="no rollout replica has engine 'nope'"):
        client.drain_engine(RUN, "nope")


def test_a_replica_that_lost_the_run_has_its_share_served_elsewhere_and_rejoins(replicated):
    client, services, red, config = replicated
    client.configure_run(config)
    services[1].end_run(RUN)  # replica 1 restarted: it no longer knows the run
    result = client.generate(request(1, 4))
    assert result.num_groups == 4 and len(written(red, 1)) == 4 == len(set(written(red, 1)))
    assert shares(client) == [2, 1]  # replica 0 served its own share and replica 1's
    assert client.replicas()[1]["failures"] == 1
    # the background rejoin configures it again; then it takes shares again
    wait_for(lambda: client.replicas()[1]["live"], what="replica 1 live again")
    assert services[1].status(RUN).engines  # configured again
    client.generate(request(2, 4))
    assert shares(client) == [3, 2]
    ledger = audit(red, RUN)
    assert ledger.generated == 8 and ledger.trained_twice == 0


def test_bad_input_is_raised_not_failed_over(replicated):
    client, _, _, config = replicated
    client.configure_run(config)
    with pytest.raises(ValueError, match="samples_per_prompt"):
        client.generate(
            GenerateRequest(run_id=RUN, step=1, samples_per_prompt=0, sampling=SAMPLING, num_groups=2)
        )
    assert all(r["live"] for r in client.replicas())


@pytest.mark.e2e
@pytest.mark.slow
def test_a_run_through_two_replicas_one_losing_the_run_mid_way(tmp_path, redis_url):
    data = yaml.safe_load((EXAMPLE / "run.yaml").read_text())
    data.update(steps=6, model=str((EXAMPLE / data["model"]).resolve()))
    with InProcessStack(redis_url, tmp_path / "checkpoints", torch_threads=1, rollout_replicas=2) as stack:
        run = stack.store.create(parse_run_spec(data))

        def lose_it() -> None:  # replica 1 loses the run at step 3, as a restart would
            wait_for(lambda: stack.store.get(run.run_id).current_step >= 2, 300, "step 2")
            stack.rollouts[1].end_run(run.run_id)

        fault = threading.Thread(target=lose_it)
        fault.start()
        done = stack.driver.execute(run.run_id)
        fault.join()
        assert done.state == RunState.SUCCEEDED, done.reason
        ledger = stack.store.ledger(run.run_id).audit(finished_step=6)
        replicas = stack.services.rollout.replicas()  # type: ignore[attr-defined]
    assert ledger.lost == ledger.trained_twice == 0 and ledger.versions_ok
    assert ledger.trained == 6 * data["prompts_per_step"]
    assert ledger.recoveries == 0  # the other replica served the share: no recovery needed
    assert replicas[1]["failures"] == 1
