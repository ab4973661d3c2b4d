"""Shares of a step (rollout replicas) in the rollout service, with real Redis and in-process
engines: two services with replica ids 0 and 1 serve one run; share k of 2 generates the prompts at
positions k, k + 2, ... of those the step draws and keeps its part of the step's groups, so the two
shares together write exactly the groups one whole request would have drawn; a share sent again,
to the other replica, writes nothing twice; engine ids of the replicas differ."""

from __future__ import annotations

import pytest
import redis
from rollout_models import write_checkpoint

from furlong.core import tasks
from furlong.core.samples import STREAM_FIELD, SampleGroup, stream_key
from furlong.core.settings import RolloutSettings
from furlong.ledger.group_ledger import audit
from furlong.rollout.core.active_run import share_seed
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.service import RolloutService
from furlong.rollout.core.types import GenerateRequest, Prompt, RolloutRunConfig, share_of
from furlong.rollout.run_records import redis_records

pytestmark = pytest.mark.integration

RUN = "shares"
SEED = 3
SAMPLING = SamplingConfig(temperature=1.0, top_k=8, max_new_tokens=6, seed=11)


@pytest.fixture
def replicas(redis_url, tmp_path):
    red = redis.Redis.from_url(redis_url)
    model_dir = str(write_checkpoint(tmp_path / "policy", seed=5))
    services = [RolloutService(redis_records(red), None, max_batch_size=8, replica_id=k) for k in range(2)]
    config = RolloutRunConfig(
        run_id=RUN,
        model_dir=model_dir,
        seed=SEED,
        task="addition",
        rollout=RolloutSettings(num_engines=2, over_sampling=1.5),
    )
    infos = [s.configure_run(config) for s in services]
    yield services, red, infos
    for s in services:
        s.close()
    red.close()


def request(step: int, num_groups: int, share: int = 0, num_shares: int = 1, **fields) -> GenerateRequest:
    return GenerateRequest(
        run_id=RUN,
        step=step,
        samples_per_prompt=2,
        sampling=SAMPLING,
        num_groups=num_groups,
        timeout_s=30.0,
        share=share,
        num_shares=num_shares,
        **fields,
    )


def written(red, step: int) -> list[SampleGroup]:
    groups = (SampleGroup.decode(f[STREAM_FIELD]) for _, f in red.xrange(stream_key(RUN)))
    return [g for g in groups if g.step == step]


def test_replica_engines_have_distinct_ids(replicas):
    _, _, infos = replicas
    assert [i.engine_ids for i in infos] == [
        [f"{RUN}-r0-engine-0", f"{RUN}-r0-engine-1"],
        [f"{RUN}-r1-engine-0", f"{RUN}-r1-engine-1"],
    ]


def test_two_shares_write_the_step_once_and_a_share_sent_again_resumes(replicas):
    services, red, _ = replicas
    need = 5  # over-sampling 1.5: the step draws 8 prompts; share 0 keeps 3 of 4, share 1 2 of 4
    drawn = [str(p.prompt_id) for p in tasks.get_task("addition").prompts(SEED, 1, 8)]
    first = services[0].generate(request(1, need, share=0, num_shares=2))
    second = services[1].generate(request(1, need, share=1, num_shares=2))
    assert (first.num_groups, second.num_groups) == (3, 2)
    by_share = [{g.prompt_id for g in written(red, 1)} & set(drawn[k::2]) for k in range(2)]
    assert [len(s) for s in by_share] == [3, 2]
    ids = [g.prompt_id for g in written(red, 1)]
    assert len(ids) == need == len(set(ids)) and set(ids) <= set(drawn)
    assert first.num_groups_surplus == 1 and second.num_groups_surplus == 2

    # share 1 again, now on replica 0 (its replica went away after writing): nothing new
    again = services[0].generate(request(1, need, share=1, num_shares=2))
    assert (again.num_groups, again.num_samples, again.num_groups_resumed) == (2, 0, 2)
    assert len(written(red, 1)) == need
    ledger = audit(red, RUN)
    assert ledger.trained_twice == 0 and ledger.generated == need


def test_a_share_beyond_the_groups_needed_keeps_nothing(replicas):
    services, red, _ = replicas
    result = services[1].generate(request(2, 1, share=1, num_shares=2))
    assert (result.num_groups, result.num_samples) == (0, 0)
    assert written(red, 2) == []


def test_explicit_prompts_are_split_by_position(replicas):
    services, red, _ = replicas
    prompts = tuple(Prompt(f"p{i}", f"{i}+1=", str(i + 1)) for i in range(5))
    results = [services[k].generate(request(0, 0, share=k, num_shares=2, prompts=prompts)) for k in range(2)]
    assert [r.num_groups for r in results] == [3, 2]
    assert sorted(g.prompt_id for g in written(red, 0)) == [p.prompt_id for p in prompts]


def test_shares_sample_with_their_own_seeds():
    seeds = {share_seed(11, k, 2) for k in range(2)} | {share_seed(11, 0, 3)}
    assert len(seeds) == 3 and 11 not in seeds
    assert share_seed(11, 1, 2) == share_seed(11, 1, 2)


@pytest.mark.parametrize("total,shares", [(5, 2), (1, 3), (7, 7), (16, 3)])
def test_share_parts_sum_to_the_total(total, shares):
    parts = [share_of(total, k, shares) for k in range(shares)]
    assert sum(parts) == total and max(parts) - min(parts) <= 1


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(share=2, num_shares=2), r"share must be an integer \[0, 1\], got 2"),
        (dict(share=-1, num_shares=2), r"share must be an integer \[0, 1\], got -1"),
        (dict(num_shares=0), r"num_shares must be an integer"),
    ],
)
def test_bad_shares_are_refused_by_name(replicas, fields, message):
    services, red, _ = replicas
    with pytest.raises(ValueError, match=message):
        services[0].generate(request(3, 2, **fields))
    assert written(red, 3) == []
