"""Two rollout replicas in a real local stack (every service a process on 127.0.0.1, tiny model,
CPU): the controller spreads each step over them; one is killed with -9 while it is generating its
share of a step, the other generates that share again, the run goes on without a recovery, the
stack's supervisor restarts the killed replica and the controller configures it again; the run's
ledger shows nothing lost and nothing trained twice. The kill lands at a seeded random step, at the
first moment replica 1 has work in flight (FURLONG_FAULT_SEED replays it)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from furlong.controller.local_stack import StackConfig, start_stack, stop_stack

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_faults_processes import ACK_TIMEOUT_S, FINAL, SEED, STEPS, Stack, _completed, _sound, fault_spec
from tiny_policy import write_tiny_checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    print(f"\nreplica fault seed: {SEED} (replay with FURLONG_FAULT_SEED={SEED})")
    state_dir = tmp_path_factory.mktemp("replicas")
    info = start_stack(
        StackConfig(
            state_dir=state_dir,
            broker_ack_timeout_s=ACK_TIMEOUT_S,
            services=("redis", "weight_broker", "trainer", "rollout", "controller"),
            rollout_replicas=2,
            owned=True,
        )
    )
    s = Stack(info, state_dir / "fault-summary.json")
    yield s
    s.write_summary()
    s.http.close()
    s.redis.close()
    stop_stack(state_dir)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny"))


def busy_engines(stack: Stack, run_id: str, marker: str) -> list[dict]:
    try:
        page = stack.http.get("/v1/engines", params={"run_id": run_id})
    except httpx.TransportError:
        return []
    if page.status_code != 200:
        return []
    return [e for e in page.json()["engines"] if marker in e["engine_id"] and e["in_flight"] > 0]


def test_the_stack_starts_two_replicas_and_the_run_uses_both(stack, model):
    names = [p.name for p in stack.info.processes]
    assert "rollout" in names and "rollout-1" in names
    run_id = stack.run(fault_spec(model, "replicas-both", steps=STEPS))
    listed: set[str] = set()
    deadline = time.monotonic() + 120
    while not {f"{run_id}-r0-engine-0", f"{run_id}-r1-engine-0"} <= listed:
        assert time.monotonic() < deadline, f"both replicas' engines never listed: {listed}"
        page = stack.http.get("/v1/engines", params={"run_id": run_id})
        if page.status_code == 200:
            listed |= {e["engine_id"] for e in page.json()["engines"]}
        time.sleep(0.05)
    run = stack.wait(run_id, lambda r: r["state"] in FINAL)
    ledger = stack.audit(run_id, finished_step=STEPS)
    _sound(ledger)
    _completed(run)
    assert ledger["trained"] == STEPS * 2 and ledger["recoveries"] == 0, ledger


def test_kill9_of_a_replica_mid_share_its_share_is_generated_again(stack, model):
    stack.wait_healthy()
    body = fault_spec(model, "kill-replica")
    # shares long enough (32 samples x 48 tokens each) that the kill lands inside one
    body.update(samples_per_prompt=32, sampling={**body["sampling"], "max_new_tokens": 48})
    run_id = stack.run(body)
    where = stack.at_random_point(run_id)
    marker = f"{run_id}-r1-engine-"
    deadline = time.monotonic() + 60
    while not busy_engines(stack, run_id, marker):  # replica 1 is generating its share now
        assert time.monotonic() < deadline, "replica 1 never had work in flight"
        time.sleep(0.005)
    where["seen_step_at_kill"] = stack.get(run_id)["current_step"]
    replica = stack.process("rollout-1")
    os.kill(replica.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while stack.process("rollout-1").restarts == replica.restarts:
        assert time.monotonic() < deadline, "rollout-1 was not restarted"
        time.sleep(0.05)
    run = stack.wait(run_id, lambda r: r["state"] in FINAL)
    ledger = stack.audit(run_id, finished_step=STEPS)
    stack.record("kill -9 of rollout replica 1 mid-share", run, where, ledger)
    _sound(ledger)
    _completed(run)
    assert ledger["trained"] == STEPS * 2  # every prompt of every step, exactly once
    assert ledger["recoveries"] == 0, ledger  # the other replica took the share over
    controller_log = Path(stack.process("controller").log_path).read_text()
    assert "rollout replica rollout-1 went away during rollout.Generate" in controller_log
    deadline = time.monotonic() + 120  # restarted by the supervisor, configured by the controller
    while "rollout replica rollout-1 is back" not in Path(stack.process("controller").log_path).read_text():
        assert time.monotonic() < deadline, "rollout-1 did not rejoin"
        time.sleep(0.2)
