"""An asynchronous run (`rollout.max_staleness: 1`, truncated importance sampling) of the addition
example through the real services in one process (trainer, rollout engines, weight broker over
NIXL, one Redis): it succeeds, no trained sample is more than one version old (the trainer's own
count, per step), and the ledger shows every prompt group trained exactly once."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from furlong.controller.core.run_state import RunState
from furlong.controller.in_process import InProcessStack
from furlong.controller.run_spec import parse_run_spec

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "addition"
STEPS = 4
PROMPTS_PER_STEP = 8


def test_an_asynchronous_run_trains_samples_at_most_one_version_old(tmp_path, redis_url):
    data = yaml.safe_load((EXAMPLE / "run-async.yaml").read_text())
    data.update(
        steps=STEPS,
        prompts_per_step=PROMPTS_PER_STEP,
        samples_per_prompt=4,
        model=str((EXAMPLE / data["model"]).resolve()),
    )
    spec = parse_run_spec(data)
    assert (spec.rollout.max_staleness, spec.algorithm.off_policy) == (1, "tis")
    with InProcessStack(redis_url, tmp_path / "checkpoints", torch_threads=1) as stack:
        run = stack.run(spec)
        assert run.state == RunState.SUCCEEDED, run.reason
        records = stack.store.metrics(run.run_id)
        audit = stack.store.ledger(run.run_id).audit(finished_step=STEPS)
    assert [r.step for r in records] == list(range(1, STEPS + 1))
    assert [r.policy_version for r in records] == list(range(1, STEPS + 1))
    for r in records:
        # the trainer trains step s with version s - 1: its samples were drawn with s - 2 or later
        assert r.sampled_policy_version >= r.policy_version - 2, r
        assert 0 <= r.staleness_mean <= r.staleness_max <= 1, r
        assert r.trainer_metrics["staleness_max"] == r.staleness_max
        assert r.samples == PROMPTS_PER_STEP * 4
    assert records[0].staleness_max == 0  # step 1 is drawn with the initial policy it trains
    assert audit.lost == 0 and audit.trained_twice == 0 and audit.versions_ok, audit
    assert audit.trained == STEPS * PROMPTS_PER_STEP, audit
