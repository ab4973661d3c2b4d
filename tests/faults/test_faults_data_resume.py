"""kill -9 of the controller in the middle of a run on a dataset, on a real local stack (every
service a process on 127.0.0.1, tiny model, CPU, the stack's supervisor restarting what dies): the
run resumes and finishes, and no dataset row is read twice in the same epoch. What was read is
taken from the run's group ledger in Redis (every prompt id a step drew, `e<epoch>-r<row>`): each
(epoch, row) belongs to exactly one step, each step read its `prompts_per_step` rows, and every
row of a finished epoch was trained exactly once."""

from __future__ import annotations

import os
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
import redis
from data_files import addition_rows, write_jsonl

from furlong.controller.local_stack import StackConfig, start_stack, stop_stack
from furlong.core.data_order import parse_prompt_id
from furlong.ledger.group_ledger import audit, ledger_keys

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_faults_processes import Stack
from tiny_policy import write_tiny_checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROWS = 7
PER_STEP = 2
STEPS = 24  # 48 reads of 7 rows: 6 whole epochs and part of a seventh
SEED = int(os.environ.get("FURLONG_FAULT_SEED", random.SystemRandom().randrange(1 << 30)))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    print(f"\ndata resume seed: {SEED} (replay with FURLONG_FAULT_SEED={SEED})")
    state_dir = tmp_path_factory.mktemp("data-faults")
    info = start_stack(
        StackConfig(
            state_dir=state_dir,
            services=("redis", "weight_broker", "trainer", "rollout", "controller"),
            owned=True,  # nothing outlives this test process
        )
    )
    s = Stack(info, state_dir / "fault-summary.json")
    yield s
    s.http.close()
    s.redis.close()
    stop_stack(state_dir)


def test_kill9_of_the_controller_mid_run_reads_no_row_twice_in_an_epoch(stack, tmp_path):
    model = str(write_tiny_checkpoint(tmp_path / "tiny"))
    train = write_jsonl(tmp_path / "rows.jsonl", addition_rows(ROWS))
    body = {
        "name": "data-kill-controller",
        "model": model,
        "steps": STEPS,
        "seed": 5,
        "prompts_per_step": PER_STEP,
        "samples_per_prompt": 2,
        "sampling": {"temperature": 1.0, "max_new_tokens": 4},
        "algorithm": {"name": "grpo", "learning_rate": 0.001, "micro_batch_size": 8},
        "checkpoint": {"every_steps": 1},
        "recovery": {"max_attempts": 3, "timeout_s": 90.0},
        "data": {"train": str(train)},
        "reward": {"exact_match": {"weight": 1.0}},
    }
    stack.wait_healthy()
    run_id = stack.run(body)
    rng = random.Random(SEED)
    kill_after = rng.randint(3, STEPS // 2)
    stack.wait(run_id, lambda r: r["current_step"] >= kill_after)
    time.sleep(rng.uniform(0.0, 0.05))
    seen = stack.get(run_id)
    assert seen is not None and seen["state"] == "running", seen
    stack.kill9("controller")
    run = stack.wait(run_id, lambda r: r["state"] in {"succeeded", "failed", "cancelled"}, timeout_s=300)
    assert run["state"] == "succeeded", run["reason"]
    assert run["current_step"] == STEPS
    ledger = audit(stack.redis, run_id, STEPS).to_dict()
    assert ledger["lost"] == 0 and ledger["trained_twice"] == 0, ledger
    assert ledger["trained"] == STEPS * PER_STEP

    red = redis.Redis.from_url(stack.info.redis_url, decode_responses=True)
    submitted_key, trained_key = (
        next(k for k in ledger_keys(run_id) if k.endswith(f":{part}")) for part in ("submitted", "trained")
    )
    steps_of_read: dict[tuple[int, int], set[int]] = defaultdict(set)
    reads_of_step: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for ident in red.hkeys(submitted_key):
        step, prompt_id = ident.split("/", 1)
        ref = parse_prompt_id(prompt_id)
        steps_of_read[(ref.epoch, ref.row)].add(int(step))
        reads_of_step[int(step)].append((ref.epoch, ref.row))
    twice = {read: steps for read, steps in steps_of_read.items() if len(steps) > 1}
    assert not twice, f"rows read twice in the same epoch (epoch, row) -> steps: {twice}"
    assert sorted(reads_of_step) == list(range(1, STEPS + 1))
    assert all(len(reads) == PER_STEP for reads in reads_of_step.values())
    trained_by_epoch: dict[int, list[int]] = defaultdict(list)
    for ident in red.smembers(trained_key):
        ref = parse_prompt_id(ident.split("/", 1)[1])
        trained_by_epoch[ref.epoch].append(ref.row)
    whole_epochs = STEPS * PER_STEP // ROWS
    for epoch in range(whole_epochs):
        assert sorted(trained_by_epoch[epoch]) == list(range(ROWS)), (epoch, trained_by_epoch[epoch])
    assert stack.process("controller").restarts >= 1  # the stack's supervisor restarted it
    print(
        f"\nkilled the controller after step {seen['current_step']} (aimed at {kill_after}); audit {ledger}"
    )
    red.close()
