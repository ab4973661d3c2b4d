"""The math-word example as committed: its script writes exactly its data files, and its run.yaml,
checkpoint and data run a few steps with evaluation in one process (real Redis, the services'
in-process twins), each row's response scored by the math reward."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from furlong.controller.core.run_state import RunState
from furlong.controller.in_process import InProcessStack
from furlong.controller.run_spec import parse_run_spec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "math-word"


@pytest.mark.integration
def test_the_data_script_writes_the_committed_files(tmp_path):
    result = subprocess.run(
        [sys.executable, str(EXAMPLE / "make_data.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    for name in ("train.jsonl", "test.jsonl"):
        assert (tmp_path / name).read_bytes() == (EXAMPLE / "data" / name).read_bytes(), name
    again = tmp_path / "seed-1"
    subprocess.run(
        [sys.executable, str(EXAMPLE / "make_data.py"), "--out", str(again), "--seed", "1"], check=True
    )
    assert (again / "train.jsonl").read_bytes() != (tmp_path / "train.jsonl").read_bytes()


@pytest.mark.e2e
@pytest.mark.slow
def test_the_example_runs_and_evaluates(tmp_path, redis_url):
    data = yaml.safe_load((EXAMPLE / "run.yaml").read_text())
    data["model"] = str((EXAMPLE / data["model"]).resolve())
    data["data"].update({k: str((EXAMPLE / data["data"][k]).resolve()) for k in ("train", "eval")})
    data.update(steps=3, prompts_per_step=8)
    data["eval"].update(every_steps=2, max_prompts=16)
    with InProcessStack(redis_url, tmp_path / "checkpoints", torch_threads=1) as stack:
        run = stack.run(parse_run_spec(data))
        assert run.state == RunState.SUCCEEDED, run.reason
        records = stack.store.metrics(run.run_id)
    assert [r.step for r in records] == [1, 2, 3] and all(r.samples == 64 for r in records)
    # the warm start answers a good share of the problems at temperature 1, not all of them
    assert all(0.1 < r.reward_mean < 0.9 for r in records)
    assert [bool(r.eval_metrics) for r in records] == [False, True, True]
    for r in records[1:]:
        assert r.eval_metrics["eval/num_prompts"] == 16.0 and r.eval_metrics["eval/k"] == 4.0
        assert 0.1 < r.eval_metrics["eval/pass@1"] <= r.eval_metrics["eval/pass@k"] <= 1.0
