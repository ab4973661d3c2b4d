"""Over-sampling and the sample ledger in the rollout service (real Redis, in-process engines):
a request for fewer groups (num_groups) than it has prompts keeps the first groups to complete,
writes only those, closes the rest in the ledger as surplus (none left pending or in flight) and
counts them in the result, the status and the metrics; the ledger refuses second results and
counts them."""

from __future__ import annotations

import pytest
import redis
from prometheus_client import CollectorRegistry
from rollout_models import write_checkpoint

from furlong.core.samples import STREAM_FIELD, SampleGroup, stream_key
from furlong.core.settings import RolloutSettings
from furlong.rollout.core.groups import OverSampling
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.service import RolloutService
from furlong.rollout.core.types import GenerateRequest, LedgerCounts, Prompt, RolloutRunConfig
from furlong.rollout.metrics import GROUPS_SURPLUS_TOTAL, RolloutMetrics
from furlong.rollout.run_records import redis_records
from furlong.rollout.sample_ledger import DONE, PENDING, SURPLUS, RedisSampleLedger

pytestmark = pytest.mark.integration

PROMPTS = [Prompt(f"o{i}", f"{i}+1=", str(i + 1)) for i in range(6)]
SAMPLING = SamplingConfig(temperature=1.0, top_k=8, max_new_tokens=8, seed=4)


@pytest.fixture
def env(redis_url, tmp_path):
    red = redis.Redis.from_url(redis_url)
    registry = CollectorRegistry()
    metrics = RolloutMetrics(registry)
    service = RolloutService(redis_records(red), None, max_batch_size=8, observer=metrics)
    metrics.watch_engines(service.status)
    service.configure_run(
        RolloutRunConfig(
            run_id="over",
            model_dir=str(write_checkpoint(tmp_path / "policy", seed=81)),
            reward="addition_exact_match",
            seed=1,
            rollout=RolloutSettings(num_engines=2),
        )
    )
    yield service, red, registry
    service.close()
    red.close()


def request(
    step: int, prompts: list[Prompt], samples_per_prompt: int, num_groups: int = 0
) -> GenerateRequest:
    return GenerateRequest(
        run_id="over",
        step=step,
        samples_per_prompt=samples_per_prompt,
        sampling=SAMPLING,
        num_groups=num_groups,
        timeout_s=30.0,
        prompts=tuple(prompts),
    )


def written(red, step: int) -> list[SampleGroup]:
    return [
        g
        for g in (SampleGroup.decode(f[STREAM_FIELD]) for _, f in red.xrange(stream_key("over")))
        if g.step == step
    ]


def test_num_groups_writes_the_first_complete_groups_and_closes_the_rest(env):
    service, red, registry = env
    # 12 rows over 2 engines: engine 0 completes o0..o2, engine 1 then o3..o5; keep 4 of 6.
    result = service.generate(request(0, PROMPTS, 2, num_groups=4))
    assert (result.num_groups, result.num_samples, result.num_groups_surplus) == (4, 8, 2)
    assert [g.prompt_id for g in written(red, 0)] == ["o0", "o1", "o2", "o3"]
    states = RedisSampleLedger(red, scope="over").states(result.request_id)
    assert result.request_id == "over/0/1"
    assert {s: v for s, v in states.items() if v == SURPLUS} == {
        f"o{p}/{i}": SURPLUS for p in (4, 5) for i in range(2)
    }
    assert sum(v == DONE for v in states.values()) == 8
    assert service.status("over").ledger == LedgerCounts(done=8, surplus=4)
    assert registry.get_sample_value(GROUPS_SURPLUS_TOTAL, {"run_id": "over"}) == 2.0
    assert (
        registry.get_sample_value("furlong_rollout_ledger_samples", {"run_id": "over", "state": "surplus"})
        == 4.0
    )

    # Enough groups after engine 0's share: engine 1's rows never start; closed, not in flight.
    early = service.generate(request(1, PROMPTS, 2, num_groups=3))
    assert (early.num_groups, early.num_groups_surplus) == (3, 3)
    assert early.num_tokens <= result.num_tokens
    assert [g.prompt_id for g in written(red, 1)] == ["o0", "o1", "o2"]
    states = RedisSampleLedger(red, scope="over").states(early.request_id)
    assert all(states[f"o{p}/{i}"] == SURPLUS for p in (3, 4, 5) for i in range(2))
    assert service.status("over").ledger == LedgerCounts(done=14, surplus=10)
    assert registry.get_sample_value(GROUPS_SURPLUS_TOTAL, {"run_id": "over"}) == 5.0

    # Same step again: a new attempt with its own ledger; every sample exactly once.
    again = service.generate(request(1, PROMPTS[:2], 3))
    assert again.request_id == "over/1/2" and again.num_groups_surplus == 0
    assert sorted(RedisSampleLedger(red, scope="over").states(again.request_id)) == sorted(
        f"o{p}/{i}" for p in (0, 1) for i in range(3)
    )


def test_num_groups_is_checked(env):
    service, red, _ = env
    with pytest.raises(ValueError, match=r"num_groups must be an integer \[0, 6\], got 7"):
        service.generate(request(0, PROMPTS, 2, num_groups=7))
    with pytest.raises(ValueError, match=r"num_groups must be an integer \[0, 6\], got -1"):
        service.generate(request(0, PROMPTS, 2, num_groups=-1))
    assert written(red, 0) == [] and service.status("over").ledger == LedgerCounts()


@pytest.mark.unit
def test_over_sampling_sizes_requests():
    assert RolloutSettings(over_sampling=1.5).prompts_to_draw(8) == 12
    assert RolloutSettings().prompts_to_draw(8) == 8
    assert RolloutSettings(over_sampling=1.2).prompts_to_draw(3) == 4
    assert OverSampling(2).keep([5, 1, 3]) == [5, 1]
    assert OverSampling(0).keep([5, 1, 3]) == [5, 1, 3]
    with pytest.raises(ValueError, match=r"over_sampling: must be in \[1, 4\], got 0.5"):
        RolloutSettings(over_sampling=0.5)


def test_ledger_counts_and_refusals(redis_url):
    red = redis.Redis.from_url(redis_url)
    ledger = RedisSampleLedger(red, scope="s")
    ledger.open("s/0/1", ["a", "b", "c"])
    ledger.dispatch("s/0/1", ["a", "b"], "e0")
    ledger.dispatch("s/0/1", ["a"], "e1")  # retried elsewhere: still one in flight
    assert ledger.counts() == LedgerCounts(pending=1, in_flight=2)
    assert ledger.finish("s/0/1", "a") is True
    assert ledger.finish("s/0/1", "a") is False  # a second result is refused and counted
    assert ledger.finish("s/0/1", "zz") is False  # never opened: refused, not counted
    assert ledger.close("s/0/1", ["b", "c"]) == 2
    assert ledger.finish("s/0/1", "b") is False  # closed as surplus: refused
    assert ledger.states("s/0/1") == {"a": DONE, "b": SURPLUS, "c": SURPLUS}
    assert ledger.counts() == LedgerCounts(done=1, surplus=2, duplicates_refused=1)
    assert ledger.unfinished("s/0/1") == []
    assert ledger.new_request("s/0") == "s/0/1" and ledger.new_request("s/0") == "s/0/2"
    ledger.open("s/0/2", ["a"])
    assert ledger.states("s/0/2") == {"a": PENDING}
    with pytest.raises(ValueError, match="scope must not be empty"):
        RedisSampleLedger(red, scope="")
    red.close()
