"""The same run of the example (5 steps, same seed) once in one process through the services'
in-process twins and once through the service processes `furlong run` starts: identical per-step
rewards and losses, bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from furlong.controller.core.run_state import RunState
from furlong.controller.in_process import InProcessStack
from furlong.controller.run_spec import parse_run_spec

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "addition"
FURLONG = str(Path(sys.executable).parent / "furlong")
STEPS = 5


def example_spec() -> dict:
    data = yaml.safe_load((EXAMPLE / "run.yaml").read_text())
    data.update(steps=STEPS, model=str((EXAMPLE / data["model"]).resolve()))
    return data


def test_one_process_and_service_processes_give_the_same_run(tmp_path, redis_url):
    data = example_spec()
    with InProcessStack(redis_url, tmp_path / "checkpoints", torch_threads=1) as stack:
        run = stack.run(parse_run_spec(data))
        assert run.state == RunState.SUCCEEDED, run.reason
        in_process = [(r.step, r.reward_mean, r.loss) for r in stack.store.metrics(run.run_id)]
        audit = stack.store.ledger(run.run_id).audit(finished_step=STEPS)
    assert [step for step, _, _ in in_process] == list(range(1, STEPS + 1))
    assert audit.lost == audit.trained_twice == 0 and audit.versions_ok

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    result = subprocess.run(
        [FURLONG, "run", str(config), "--out", str(out), "--state-dir", str(tmp_path / "state")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    processes = [(x["step"], x["reward_mean"], x["loss"]) for x in lines]
    assert processes == in_process
    rewards = [reward for _, reward, _ in in_process]
    assert len(set(rewards)) > 1  # a run that learns something, not a constant
