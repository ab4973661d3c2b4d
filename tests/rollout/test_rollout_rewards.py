"""The reward registry (format rewards, user callables resolved and signature-checked), concurrent
scoring with a deadline, and dynamic sampling in the service over a real Redis."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from prometheus_client import CollectorRegistry
from rollout_models import write_checkpoint

from furlong.core.samples import STREAM_FIELD, SampleGroup, stream_key
from furlong.core.settings import RolloutSettings
from furlong.rollout.core.groups import DynamicSampling, zero_variance
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.service import RolloutService
from furlong.rollout.core.types import GenerateRequest, Prompt, RolloutRunConfig
from furlong.rollout.metrics import GROUPS_DROPPED_TOTAL, GROUPS_REFILLED_TOTAL, RolloutMetrics
from furlong.rollout.rewards import (
    RewardError,
    check_signature,
    format_integer_reward,
    format_single_line_reward,
    get_reward,
    resolve_user_reward,
    reward_registry,
    score_all,
)
from furlong.rollout.run_records import redis_records


@pytest.mark.unit
def test_format_rewards():
    assert [format_integer_reward(t, "") for t in ("42", " -7\n", "4.2", "", "1+1", "x")] == [
        1.0,
        1.0,
        0.0,
        0.0,
        0.0,
        0.0,
    ]
    assert [format_single_line_reward(t, "") for t in ("a b", " ok \n", "a\nb", "  ")] == [1.0, 1.0, 0.0, 0.0]
    assert get_reward("format_integer") is format_integer_reward


@pytest.mark.unit
def test_user_rewards_are_resolved_and_signature_checked():
    fn = resolve_user_reward("rollout_user_rewards:length_reward")
    assert fn("abc", "") == 3.0
    registry = reward_registry({"length": fn})
    assert {"length", "addition_exact_match", "format_integer"} <= set(registry)
    cases = [
        ("rollout_user_rewards:needs_three", "must be callable as fn(response_text: str, answer: str)"),
        ("rollout_user_rewards:missing", "has no attribute 'missing'"),
        ("rollout_user_rewards:not_callable", "is a int, not a callable"),
        ("no_such_module_xyz:fn", "cannot import 'no_such_module_xyz'"),
        ("rollout_user_rewards", "must look like 'package.module:function'"),
    ]
    for reference, needle in cases:
        with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            resolve_user_reward(reference)
    with pytest.raises(ValueError, match="reward 'addition_exact_match' is already registered"):
        reward_registry({"addition_exact_match": fn})
    with pytest.raises(ValueError, match="reward 'k' must be callable"):
        check_signature("k", lambda: 1.0)
    assert check_signature("kw", lambda response_text, answer, scale=1.0: scale)


@pytest.mark.unit
def test_score_all_runs_concurrently_and_enforces_the_deadline():
    active, peak, lock = [0], [0], threading.Lock()

    def slow(text, answer):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.05)
        with lock:
            active[0] -= 1
        return float(text == answer)

    items = [(str(i), "3", f"sample {i}") for i in range(8)]
    started = time.monotonic()
    assert score_all("slow", slow, items, timeout_s=10.0, max_workers=4) == [float(i == 3) for i in range(8)]
    assert peak[0] == 4 and time.monotonic() - started < 0.35

    release = threading.Event()

    def stuck(text, answer):
        return float(release.wait(5.0))

    with pytest.raises(RewardError, match="reward 'stuck' did not finish within 0.2 s on sample 0"):
        score_all("stuck", stuck, items[:2], timeout_s=0.2, max_workers=2)
    release.set()

    def fails_on_5(text, answer):
        if text == "5":
            raise KeyError("boom")
        return 1.0 if text != "6" else float("inf")

    with pytest.raises(RewardError, match="failed on sample 5: KeyError"):
        score_all("f", fails_on_5, items, timeout_s=5.0, max_workers=3)


@pytest.mark.unit
def test_group_decisions():
    assert zero_variance([1.0, 1.0]) and zero_variance([0.5]) and not zero_variance([0.0, 1.0])
    with pytest.raises(ValueError, match="max_refill_rounds must be an integer"):
        DynamicSampling(-1)
    with pytest.raises(ValueError, match="needs samples_per_prompt >= 2"):
        DynamicSampling(2).check_group_size(1)


def dynamic_run(run_id: str, checkpoint: str, max_refill_rounds: int) -> RolloutRunConfig:
    return RolloutRunConfig(
        run_id=run_id,
        model_dir=checkpoint,
        reward="coin",
        rollout=RolloutSettings(max_refill_rounds=max_refill_rounds),
    )


def request(run_id, step, prompts, samples_per_prompt, sampling) -> GenerateRequest:
    return GenerateRequest(
        run_id=run_id,
        step=step,
        samples_per_prompt=samples_per_prompt,
        sampling=sampling,
        timeout_s=30.0,
        prompts=tuple(prompts),
    )


@pytest.mark.integration
def test_dynamic_sampling_drops_and_refills_constant_groups(redis_url, tmp_path):
    checkpoint = str(write_checkpoint(tmp_path / "ckpt", seed=8))
    calls = {"n": 0}

    def coin(text, answer):
        # Reward by the response's first character: varies between samples of a group for some
        # prompts and draws, constant for "always" (its answer makes the reward constant).
        calls["n"] += 1
        if answer == "always":
            return 1.0
        return float(len(text) % 2)

    red = redis.Redis.from_url(redis_url)
    registry = CollectorRegistry()
    service = RolloutService(
        redis_records(red), None, rewards={"coin": coin}, observer=RolloutMetrics(registry)
    )
    try:
        service.configure_run(dynamic_run("dyn", checkpoint, max_refill_rounds=3))
        service.configure_run(dynamic_run("dyn-off", checkpoint, max_refill_rounds=0))
        prompts = [Prompt("keep", "1+2=", "3"), Prompt("const", "4+4=", "always"), Prompt("x", "9+1=", "10")]
        sampling = SamplingConfig(temperature=1.5, max_new_tokens=6, seed=2)
        result = service.generate(request("dyn", 0, prompts, 4, sampling))
        groups = [SampleGroup.decode(f[STREAM_FIELD]) for _, f in red.xrange(stream_key("dyn"))]
        assert "const" not in [g.prompt_id for g in groups]
        assert all(not zero_variance(g.rewards) for g in groups)
        assert result.num_groups == len(groups) and result.num_groups_dropped == 3 - len(groups)
        assert result.num_groups_refilled >= 3  # "const" was drawn 3 more times
        assert calls["n"] == 4 * (3 + result.num_groups_refilled)
        assert result.num_samples == 4 * len(groups)
        assert all(s.sample_id == f"{g.prompt_id}/{i}" for g in groups for i, s in enumerate(g.samples))
        assert registry.get_sample_value(GROUPS_DROPPED_TOTAL, {"run_id": "dyn"}) == result.num_groups_dropped
        assert (
            registry.get_sample_value(GROUPS_REFILLED_TOTAL, {"run_id": "dyn"}) == result.num_groups_refilled
        )

        off = service.generate(request("dyn-off", 1, prompts, 4, sampling))
        assert off.num_groups == 3 and off.num_groups_dropped == 0 and off.num_groups_refilled == 0
        with pytest.raises(ValueError, match=r"\(max_refill_rounds 3\) needs samples_per_prompt >= 2"):
            service.generate(request("dyn", 2, prompts, 1, sampling))
    finally:
        service.close()
        red.close()
