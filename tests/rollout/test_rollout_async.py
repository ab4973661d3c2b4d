"""Asynchronous mode (acceptance 4): rollout generates step s+1 while the trainer trains step s,
paced by `StalenessPacer(max_staleness=1)` through min_policy_version. No trained sample is more
than one version old (checked from the versions samples record), and the trained prompts are
exactly the submitted ones, so their length distribution is the same (pacing, not discarding)."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import redis
from rollout_models import tiny_model, write_checkpoint

from furlong.core.samples import STREAM_FIELD, SampleGroup, stream_key
from furlong.rollout.core.pacing import StalenessPacer
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.service import RolloutService
from furlong.rollout.core.types import GenerateRequest, Prompt, RolloutRunConfig
from furlong.rollout.run_records import redis_records

STEPS = 6


class Receivers:
    def __init__(self):
        self.apply = {}

    def __call__(self, run_id, engine_id, apply):
        receivers = self

        class Receiver:
            def start(self):
                receivers.apply[engine_id] = apply

            def close(self):
                pass

        return Receiver()


def step_prompts(step: int) -> list[Prompt]:
    # Lengths from 4 to 12 characters, different mixes per step.
    operands = [(step + 1, 2), (10 * step + 7, 35), (123 + step, 4567), (9, 8), (99999, step)]
    return [Prompt(f"s{step}-{i}", f"{a}+{b}=", str(a + b)) for i, (a, b) in enumerate(operands)]


@pytest.mark.unit
def test_pacer_decisions():
    pacer = StalenessPacer(1)
    assert [pacer.min_version(s) for s in range(4)] == [0, 0, 1, 2]
    assert pacer.can_admit(3, 2) and not pacer.can_admit(3, 1)
    pacer.check_trained(5, [4, 5])
    with pytest.raises(ValueError, match="drawn with version 3 is 2 versions older"):
        pacer.check_trained(5, [3, 5])
    with pytest.raises(ValueError, match="max_staleness must be an integer"):
        StalenessPacer(-1)
    assert StalenessPacer(0).min_version(4) == 4


@pytest.mark.integration
@pytest.mark.slow
def test_async_rollout_is_paced_not_filtered(redis_url, tmp_path):
    checkpoint = str(write_checkpoint(tmp_path / "ckpt", seed=71))
    red = redis.Redis.from_url(redis_url)
    receivers = Receivers()
    service = RolloutService(redis_records(red), receivers)
    service.configure_run(
        RolloutRunConfig(run_id="async", model_dir=checkpoint, reward="addition_exact_match")
    )
    pacer = StalenessPacer(max_staleness=1)
    sampling = SamplingConfig(temperature=1.0, top_k=6, max_new_tokens=6, seed=1)
    trained: list[tuple[int, int, SampleGroup]] = []  # (step, trained version, group)
    errors: list[BaseException] = []

    def rollout():
        try:
            for step in range(STEPS):
                service.generate(
                    GenerateRequest(
                        run_id="async",
                        step=step,
                        samples_per_prompt=2,
                        sampling=sampling,
                        min_policy_version=pacer.min_version(step),
                        timeout_s=120.0,
                        prompts=tuple(step_prompts(step)),
                    )
                )
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    def trainer():
        try:
            last_id, by_step = "0-0", {}
            new_weights = [
                {k: v + 0.01 * (i + 1) for k, v in tiny_model(71).state_dict().items()} for i in range(STEPS)
            ]
            for step in range(STEPS):  # the trainer serves version `step` now
                deadline = time.monotonic() + 120
                while len(by_step.get(step, [])) < len(step_prompts(step)):
                    assert time.monotonic() < deadline, f"step {step} never arrived"
                    for _, entries in red.xread({stream_key("async"): last_id}, block=200) or []:
                        for entry_id, fields in entries:
                            last_id = entry_id
                            group = SampleGroup.decode(fields[STREAM_FIELD])
                            by_step.setdefault(group.step, []).append(group)
                for group in by_step[step]:
                    trained.append((step, step, group))
                time.sleep(0.3)  # "training": rollout runs ahead meanwhile
                for apply in receivers.apply.values():
                    apply(step + 1, new_weights[step])
        except BaseException as exc:  # noqa: BLE001 - the main thread re-raises what this thread hit
            errors.append(exc)

    threads = [threading.Thread(target=rollout), threading.Thread(target=trainer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    service.close()
    red.close()
    assert not errors, errors

    for step, version, group in trained:
        versions = [s.policy_version for s in group.samples]
        pacer.check_trained(version, versions)
        assert all(step - 1 <= v <= step for v in versions)
    staleness = Counter(version - s.policy_version for _, version, g in trained for s in g.samples)
    assert set(staleness) <= {0, 1} and staleness[1] > 0  # it really ran ahead, by at most one

    submitted = sorted(len(p.text) for s in range(STEPS) for p in step_prompts(s))
    trained_prompts = sorted(g.prompt_id for _, _, g in trained)
    assert trained_prompts == sorted(p.prompt_id for s in range(STEPS) for p in step_prompts(s))
    texts = {p.prompt_id: p.text for s in range(STEPS) for p in step_prompts(s)}
    assert sorted(len(texts[i]) for i in trained_prompts) == submitted
