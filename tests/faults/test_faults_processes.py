"""Fault injection on a real local stack (every service a process on 127.0.0.1, tiny model, CPU),
with the stack's supervisor process (`stack_supervisor`) restarting whatever dies.

Each fault is injected into a run in progress at a seeded random point (the seed is printed; set
FURLONG_FAULT_SEED to replay one). Afterwards the run must finish, or end failed with a reason
naming what failed, and the run's sample ledger must show no sample lost in a finished step, none
trained twice, and every sample drawn with a committed policy version (no torn version served).
Faults: kill -9 of the trainer, the rollout service, the weight broker, the controller and Redis;
SIGSTOP/SIGCONT of the broker mid-publish; a dropped weight bucket (the broker's fault hook); a
corrupted sample group written into the run's stream. How often each was injected, and each
audit, is written to `fault-summary.json` in the test's tmp dir and printed (`-s`).
FURLONG_FAULT_MAX_STALENESS=K runs every fault in asynchronous mode (`rollout.max_staleness` K,
truncated importance sampling); the kill -9 faults of the trainer, the rollout service and the
controller also run in asynchronous mode with K = 1 in any case.
(kill -9 of a single rollout engine is covered with the rollout engine pool's tests.)
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from furlong.controller.local_stack import (
    StackConfig,
    StackInfo,
    load_stack,
    start_stack,
    stop_stack,
)
from furlong.controller.stack_supervisor import FAULT_ENV_DIR
from furlong.core.samples import STREAM_FIELD, stream_key
from furlong.ledger.group_ledger import audit
from furlong.trainer.sample_reader import rejected_key
from furlong.weight_broker.fault_hooks import DROP_BUCKET_ENV

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "controller"))
from test_controller_e2e import spec
from tiny_policy import write_tiny_checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FINAL = {"succeeded", "failed", "cancelled"}
STEPS = 60  # a step takes 0.05-0.5 s: the fault lands well before the end
SEED = int(os.environ.get("FURLONG_FAULT_SEED", random.SystemRandom().randrange(1 << 30)))
ACK_TIMEOUT_S = 8.0
MAX_STALENESS = int(os.environ.get("FURLONG_FAULT_MAX_STALENESS", "0"))


def fault_spec(model: str, name: str, steps: int = STEPS, max_staleness: int = MAX_STALENESS) -> dict:
    body = spec(model, name=name, steps=steps)
    body["checkpoint"] = {"every_steps": 1}
    body["recovery"] = {"max_attempts": 3, "timeout_s": 90.0}
    if max_staleness:
        body["rollout"] = {"max_staleness": max_staleness}
        body["algorithm"] = {**body["algorithm"], "off_policy": "tis"}
    return body


class Stack:
    def __init__(self, info: StackInfo, summary_path: Path) -> None:
        self.info = info
        self.rng = random.Random(SEED)
        self.redis = redis.Redis.from_url(info.redis_url)
        self.summary_path = summary_path
        self.summary: dict[str, dict] = {}
        self.http = httpx.Client(
            base_url=info.rest_url, timeout=30, headers={"Authorization": f"Bearer {info.token()}"}
        )

    def process(self, name: str):
        return {p.name: p for p in load_stack(Path(self.info.state_dir)).processes}[name]

    def run(self, body: dict) -> str:
        resp = self.http.post("/v1/runs", json=body)
        assert resp.status_code == 201, resp.text
        return resp.json()["run_id"]

    def get(self, run_id: str) -> dict | None:
        try:
            resp = self.http.get(f"/v1/runs/{run_id}")
        except httpx.TransportError:
            return None  # the controller itself may be restarting
        return resp.json() if resp.status_code == 200 else None  # or Redis may be

    def wait(self, run_id: str, predicate, timeout_s: float = 240.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            run = self.get(run_id)
            if run is not None and predicate(run):
                return run
            time.sleep(0.1)
        raise AssertionError(
            f"run {run_id}: condition not reached in {timeout_s}s (last seen {self.get(run_id)})"
        )

    def at_random_point(self, run_id: str) -> dict:
        """Wait for a seeded random step of the run, then a seeded random delay within it."""
        step = self.rng.randint(1, STEPS // 3)
        delay_s = self.rng.uniform(0.0, 0.05)
        self.wait(run_id, lambda r: r["current_step"] >= step)
        time.sleep(delay_s)
        run = self.get(run_id)
        assert run["state"] == "running", f"the run ended before the fault: {run}"
        return {"after_step": step, "delay_s": round(delay_s, 3), "seen_step": run["current_step"]}

    def wait_healthy(self) -> None:
        """Every service answers again (the supervisor restarts take a few seconds)."""
        deadline = time.monotonic() + 120
        while True:
            try:
                if self.http.get("/readyz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the stack did not become ready again"
            time.sleep(0.2)

    def kill9(self, name: str) -> None:
        sp = self.process(name)
        os.kill(sp.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while self.process(name).restarts == sp.restarts:  # the supervisor records each restart
            assert time.monotonic() < deadline, f"{name} was not restarted"
            time.sleep(0.05)

    def fault_env(self, name: str, env: dict[str, str] | None) -> None:
        """The extra environment of service name's next start (None: none)."""
        path = Path(self.info.state_dir) / FAULT_ENV_DIR / f"{name}.json"
        if env is None:
            path.unlink(missing_ok=True)
            return
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(env))

    def audit(self, run_id: str, finished_step: int | None = None) -> dict:
        return audit(self.redis, run_id, finished_step).to_dict()

    def record(self, fault: str, run: dict, where: dict, ledger: dict) -> None:
        entry = self.summary.setdefault(fault, {"injected": 0, "runs": []})
        entry["injected"] += 1
        entry["runs"].append(
            {
                "run_id": run["run_id"],
                "state": run["state"],
                "reason": run["reason"],
                "where": where,
                "audit": {
                    k: ledger[k]
                    for k in (
                        "finished_step",
                        "submitted",
                        "generated",
                        "trained",
                        "lost",
                        "trained_twice",
                        "retrain_refused",
                        "duplicates_refused",
                        "resubmitted",
                        "recoveries",
                        "rejected",
                        "stale_redrawn",
                        "versions_ok",
                    )
                },
            }
        )
        self.write_summary()

    def write_summary(self) -> None:
        self.summary_path.write_text(json.dumps({"seed": SEED, "faults": self.summary}, indent=2))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    print(f"\nfault suite seed: {SEED} (replay with FURLONG_FAULT_SEED={SEED})")
    state_dir = tmp_path_factory.mktemp("faults")
    info = start_stack(
        StackConfig(
            state_dir=state_dir,
            broker_ack_timeout_s=ACK_TIMEOUT_S,
            broker_fault_hooks=True,  # the dropped-bucket fault needs the broker's hook
            services=("redis", "weight_broker", "trainer", "rollout", "controller"),
            owned=True,  # nothing outlives this test process
        )
    )
    s = Stack(info, state_dir / "fault-summary.json")
    yield s
    s.write_summary()
    print(f"\nfault summary ({s.summary_path}):\n{s.summary_path.read_text()}")
    s.http.close()
    s.redis.close()
    stop_stack(state_dir)


def _sound(ledger: dict) -> None:
    """Nothing lost in a finished step, nothing trained twice, no sample from an uncommitted
    (torn) version."""
    assert ledger["lost"] == 0, ledger
    assert ledger["trained_twice"] == 0, ledger
    assert ledger["versions_ok"], ledger


def _completed(run: dict) -> None:
    assert run["state"] == "succeeded", run["reason"]
    assert run["current_step"] == STEPS, run


@pytest.mark.parametrize("service", ["trainer", "rollout", "weight_broker", "controller", "redis"])
def test_kill9_mid_run_the_run_resumes_and_nothing_is_lost(stack, model, service):
    stack.wait_healthy()
    run_id = stack.run(fault_spec(model, f"kill-{service.replace('_', '-')}"))
    where = stack.at_random_point(run_id)
    stack.kill9(service)
    run = stack.wait(run_id, lambda r: r["state"] in FINAL)
    ledger = stack.audit(run_id, finished_step=STEPS)
    stack.record(f"kill -9 {service}", run, where, ledger)
    _sound(ledger)
    _completed(run)
    assert ledger["trained"] == STEPS * 2  # every prompt of every step, exactly once
    assert ledger["recoveries"] >= 1, ledger
    events = stack.http.get(f"/v1/runs/{run_id}/events").text
    assert "recovery" in events


@pytest.mark.parametrize("service", ["trainer", "rollout", "controller"])
def test_kill9_mid_asynchronous_run_nothing_is_lost_or_trained_twice(stack, model, service):
    stack.wait_healthy()
    body = fault_spec(model, f"async-kill-{service}", max_staleness=1)
    run_id = stack.run(body)
    where = stack.at_random_point(run_id)
    stack.kill9(service)
    run = stack.wait(run_id, lambda r: r["state"] in FINAL)
    ledger = stack.audit(run_id, finished_step=STEPS)
    stack.record(f"kill -9 {service} (max_staleness 1)", run, where, ledger)
    _sound(ledger)
    _completed(run)
    assert ledger["trained"] == STEPS * 2  # every prompt of every step, exactly once
    assert ledger["recoveries"] >= 1, ledger
    records = stack.http.get(f"/v1/runs/{run_id}/metrics").json()["steps"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert max(r["staleness_max"] for r in records) <= 1, records


def test_sigstop_the_broker_mid_publish_then_sigcont_the_run_goes_on(stack, model):
    stack.wait_healthy()
    run_id = stack.run(fault_spec(model, "pause-broker"))
    where = stack.at_random_point(run_id)
    broker = stack.process("weight_broker")
    os.kill(broker.pid, signal.SIGSTOP)
    try:
        at_stop = stack.get(run_id)["current_step"]
        time.sleep(3.0)  # the broker is frozen: publishing and commits must wait, not break
        frozen = stack.get(run_id)
    finally:
        os.kill(broker.pid, signal.SIGCONT)
    assert frozen["state"] == "running", frozen
    # at most the step whose commit the broker had already answered can still be recorded
    assert frozen["current_step"] <= at_stop + 1, (at_stop, frozen["current_step"])
    run = stack.wait(run_id, lambda r: r["state"] in FINAL)
    ledger = stack.audit(run_id, finished_step=STEPS)
    stack.record("SIGSTOP broker mid-publish", run, where, ledger)
    _sound(ledger)
    _completed(run)
    assert ledger["recoveries"] == 0 and ledger["trained"] == STEPS * 2


def test_corrupt_sample_in_redis_is_rejected_by_name_and_nothing_else_dropped(stack, model):
    stack.wait_healthy()
    run_id = stack.run(fault_spec(model, "corrupt-sample"))
    where = stack.at_random_point(run_id)
    ((entry_id, fields),) = stack.redis.xrevrange(stream_key(run_id), count=1)
    group = json.loads(fields[STREAM_FIELD])
    bad = group["samples"][0]
    bad["sample_id"] = "corrupted/0"
    bad["response_token_ids"][0] = 10_000  # outside its sampling support and the vocabulary
    stack.redis.xadd(stream_key(run_id), {STREAM_FIELD: json.dumps(group).encode()})
    run = stack.wait(run_id, lambda r: r["state"] in FINAL)
    ledger = stack.audit(run_id, finished_step=STEPS)
    stack.record("corrupt sample in Redis", run, {**where, "copied_entry": entry_id.decode()}, ledger)
    _sound(ledger)
    _completed(run)
    (rejected,) = stack.redis.xrange(rejected_key(run_id))
    assert "corrupted/0" in rejected[1][b"reason"].decode(), rejected
    assert ledger["rejected"] == 1 and ledger["trained"] == STEPS * 2


def test_dropped_weight_bucket_fails_the_run_clearly_and_no_torn_version(stack, model):
    # the broker restarted with its fault hook (it runs with --enable-fault-hooks): the first round 0
    # of version 2 is dropped
    stack.fault_env("weight_broker", {DROP_BUCKET_ENV: "2:0"})
    try:
        stack.kill9("weight_broker")
    finally:
        stack.fault_env("weight_broker", None)
    stack.wait_healthy()
    run_id = stack.run(fault_spec(model, "drop-bucket"))
    run = stack.wait(run_id, lambda r: r["state"] in FINAL)
    assert run["state"] == "failed", run
    assert run["reason"].startswith("step 2 broker.WaitCommitted: ConflictError"), run["reason"]
    assert "fenced" in run["reason"] and "version 2" in run["reason"], run["reason"]
    assert run["current_step"] == 1 and run["policy_version"] == 1
    ledger = stack.audit(run_id)  # the steps the trainer made durable lost nothing
    stack.record("drop a weight bucket", run, {"version": 2, "round": 0}, ledger)
    _sound(ledger)
    assert ledger["uncommitted_sample_versions"] == [] and 2 not in ledger["sample_versions"]
    log = Path(stack.process("weight_broker").log_path).read_text()
    assert "FAULT INJECTION" in log
