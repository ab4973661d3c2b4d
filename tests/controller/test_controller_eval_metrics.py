"""Evaluation metrics and settings: pass@k is the unbiased estimator (checked against counting every
k-subset of the samples), the metrics are means over prompts, and a bad `eval` setting is refused
naming its field."""

from __future__ import annotations

import itertools

import pytest

from furlong.controller.core.eval_metrics import eval_metrics, pass_at_k
from furlong.controller.run_spec import parse_run_spec
from furlong.core.settings import EvalSettings, SettingError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample(n):
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            expected = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match="1 <= k <= n, got k=3, n=2"):
        pass_at_k(2, 1, 3)
    with pytest.raises(ValueError, match="0 <= c <= n, got c=3, n=2"):
        pass_at_k(2, 3, 1)


def test_eval_metrics_are_means_over_prompts_with_the_threshold():
    groups = [(1.0, 0.0, 0.0, 0.0), (0.5, 0.5, 1.5, 0.0), (0.0, 0.0, 0.0, 0.0)]
    metrics = eval_metrics(groups, pass_threshold=1.0, k=4)
    assert metrics["eval/reward_mean"] == pytest.approx(3.5 / 12)
    assert metrics["eval/pass@1"] == pytest.approx((0.25 + 0.25 + 0.0) / 3)
    assert metrics["eval/pass@k"] == pytest.approx(2 / 3)
    assert (metrics["eval/k"], metrics["eval/num_prompts"]) == (4.0, 3.0)
    low = eval_metrics(groups, pass_threshold=0.5, k=2)
    assert low["eval/pass@1"] == pytest.approx((0.25 + 0.75 + 0.0) / 3)
    assert low["eval/pass@k"] == pytest.approx((pass_at_k(4, 1, 2) + pass_at_k(4, 3, 2)) / 3)
    with pytest.raises(ValueError, match="at least one prompt"):
        eval_metrics([], 1.0, 1)
    with pytest.raises(ValueError, match="prompt 1 has 1 rewards, fewer than k=2"):
        eval_metrics([(1.0, 1.0), (1.0,)], 1.0, 2)


SPEC = {
    "name": "eval-spec",
    "model": "/models/tiny",
    "steps": 2,
    "data": {"train": "/data/train.jsonl", "eval": "/data/eval.jsonl"},
    "reward": {"exact_match": {"weight": 1.0}},
}


def test_the_eval_section_is_parsed_with_its_defaults_and_checked():
    spec = parse_run_spec({**SPEC, "eval": {"every_steps": 5, "samples_per_prompt": 4, "temperature": 0.7}})
    assert spec.eval == EvalSettings(every_steps=5, samples_per_prompt=4, temperature=0.7)
    assert spec.to_dict()["eval"] == {
        "every_steps": 5,
        "samples_per_prompt": 4,
        "temperature": 0.7,
        "max_prompts": 0,
        "pass_threshold": 1.0,
    }
    assert [s for s in range(1, 13) if spec.eval.evaluates_at(s, 12)] == [5, 10, 12]
    assert not parse_run_spec(SPEC).eval.evaluates_at(2, 2)  # off by default
    bad = {
        "eval.every_steps": ({"every_steps": -1}, "must be an integer in [0, 10000000], got -1"),
        "eval.temperature": ({"temperature": -0.5}, "must be in [0, 100], got -0.5"),
        "eval.max_prompts": ({"max_prompts": 1.5}, "must be an integer, got 1.5"),
        "eval.pass_threshold": ({"pass_threshold": "high"}, "must be a number, got 'high'"),
        "eval.samples_per_prompt": ({"samples_per_prompt": 3}, "3 greedy responses (temperature 0)"),
        "eval.k": ({"k": 3}, "unknown field"),
    }
    for field, (section, message) in bad.items():
        with pytest.raises(SettingError) as err:
            parse_run_spec({**SPEC, "eval": section})
        assert err.value.field == field and message in str(err.value), (field, str(err.value))
    no_rows = {**SPEC, "data": {"train": "/data/train.jsonl"}, "eval": {"every_steps": 2}}
    with pytest.raises(SettingError) as err:
        parse_run_spec(no_rows)
    assert err.value.field == "eval.every_steps" and "data.eval is not set" in str(err.value)


def test_furlong_run_prints_a_line_for_each_evaluated_step():
    from furlong.controller.run_follow import describe_eval

    metrics = {"eval/reward_mean": 0.5, "eval/pass@1": 0.5, "eval/pass@k": 0.875, "eval/k": 4.0}
    line = describe_eval({"step": 10, "eval_metrics": {**metrics, "eval/num_prompts": 100.0}})
    assert line == "eval after step 10: reward 0.5000  pass@1 0.5000  pass@4 0.8750  (100 prompts)"
    assert describe_eval({"step": 9, "eval_metrics": {}}) is None
    assert describe_eval({"step": 9}) is None  # a record written before evaluation existed


@pytest.mark.integration
def test_the_driver_evaluates_every_n_steps_and_the_last_with_the_committed_policy(redis_url):
    from controller_fakes import fake_stack

    from furlong.controller.config import DriverTimeouts
    from furlong.controller.core.run_state import RunState
    from furlong.controller.driver import RunDriver
    from furlong.controller.metrics import EVAL_PASS_AT_K, ControllerMetrics
    from furlong.controller.run_store import RunStore
    from furlong.core.errors import UnavailableError

    store = RunStore.from_url(redis_url)
    fakes = fake_stack()
    metrics = ControllerMetrics()
    driver = RunDriver(store, fakes.services, DriverTimeouts(end_s=1.0), metrics)
    evaluation = {"every_steps": 2, "samples_per_prompt": 4, "temperature": 0.5, "max_prompts": 5}
    body = {**SPEC, "steps": 5, "sampling": {"max_new_tokens": 6}, "eval": evaluation}
    try:
        run = driver.execute(store.create(parse_run_spec(body)).run_id)
        assert run.state == RunState.SUCCEEDED, run.reason
        calls = fakes.rollout.evaluate_calls
        assert [c.step for c in calls] == [2, 4, 5]
        assert [c.min_policy_version for c in calls] == [2, 4, 5]  # what the step committed
        assert all(c.samples_per_prompt == 4 and c.max_prompts == 5 for c in calls)
        assert all(c.sampling.temperature == 0.5 and c.sampling.max_new_tokens == 6 for c in calls)
        generate_seeds = {c.sampling.seed for c in fakes.rollout.generate_calls}
        seeds = [c.sampling.seed for c in calls]
        assert len(set(seeds)) == 3 and not generate_seeds & set(seeds)
        records = store.metrics(run.run_id)
        assert [bool(r.eval_metrics) for r in records] == [False, True, False, True, True]
        # prompt p of the fake has min(p, 4) of 4 responses at reward 1
        expected = {"eval/reward_mean": 0.5, "eval/pass@1": 0.5, "eval/pass@k": 0.8, "eval/k": 4.0}
        for r in records[1::2] + records[-1:]:
            assert {k: r.eval_metrics[k] for k in expected} == pytest.approx(expected)
        assert metrics.registry.get_sample_value(EVAL_PASS_AT_K, {"run_id": run.run_id}) == pytest.approx(0.8)
        # An evaluation that fails fails the step it follows, named by its phase.
        fakes.faults.raise_in["evaluate"] = UnavailableError("rollout went away")
        failed = driver.execute(
            store.create(parse_run_spec({**body, "recovery": {"max_attempts": 0}})).run_id
        )
        assert failed.state == RunState.FAILED and failed.reason.startswith("step 2 rollout.Evaluate:")
        assert "rollout went away" in failed.reason
    finally:
        store.close()
