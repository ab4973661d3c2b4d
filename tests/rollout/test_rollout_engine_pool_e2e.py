"""The rollout service with `--engines process` as its own process, beside `python -m
furlong.weight_broker`: two engine processes behind the engine pool, weight versions from the
broker, and kill -9 of an engine process in the middle of a Generate call (acceptance 3).

Checked: the call completes; the sample ids in the stream and in the ledger show every sample
exactly once (none lost, none duplicated); the killed engine is back with a new pid, healthy, and
serves the current policy version (version 1 right away, version 2 after the next update, checked
by greedy samples equal to an independent engine's). Then drain: an engine drained while it works
finishes its chunk and reports draining → drained, and takes no new work afterwards (it is frozen
with SIGSTOP, so a chunk routed to it would never finish)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import urllib.request

import pytest
import redis
from polling import wait_until
from rollout_models import tiny_model, tokenizer, write_checkpoint

from furlong.core.checkpoint import unique_state
from furlong.core.samples import STREAM_FIELD, SampleGroup, stream_key
from furlong.core.settings import RolloutSettings
from furlong.core.weights import WeightLayout
from furlong.rollout.client import GrpcRolloutClient, RolloutDeadlines
from furlong.rollout.core.engine import Engine
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.types import EngineState, GenerateRequest, Prompt, RolloutRunConfig
from furlong.rollout.sample_ledger import DONE, RedisSampleLedger, ledger_key
from furlong.rpc import check_health
from furlong.rpc.ports import free_port
from furlong.transfer.broker_client import GrpcBrokerClient
from furlong.transfer.publisher import WeightPublisher

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RUN = "run-pool"
E0, E1 = f"{RUN}-engine-0", f"{RUN}-engine-1"
PROMPTS = [Prompt(f"p{i}", f"{i}+{i + 3}=", str(2 * i + 3)) for i in range(12)]
LONG = SamplingConfig(temperature=1.0, top_k=8, max_new_tokens=40, seed=11)
GREEDY = SamplingConfig(temperature=1.0, top_k=1, max_new_tokens=6, seed=0)


def start(args, log_path):
    return subprocess.Popen(
        [sys.executable, "-m", *args], stdout=open(log_path, "w"), stderr=subprocess.STDOUT
    )


def stop(proc):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stream_samples(red, step: int):
    groups = [SampleGroup.decode(f[STREAM_FIELD]) for _, f in red.xrange(stream_key(RUN))]
    return [s for g in groups if g.step == step for s in g.samples]


def registered(broker) -> tuple[str, ...]:
    try:
        return tuple(sorted(broker.get_version(RUN).engine_ids))
    except Exception:  # noqa: BLE001 - the run does not exist at the broker until a receiver registers
        return ()


def engines_by_id(client):
    return {e.engine_id: e for e in client.status(RUN).engines}


def step_request(step, prompts, samples_per_prompt, sampling, min_policy_version) -> GenerateRequest:
    return GenerateRequest(
        run_id=RUN,
        step=step,
        samples_per_prompt=samples_per_prompt,
        sampling=sampling,
        min_policy_version=min_policy_version,
        timeout_s=60.0,
        prompts=tuple(prompts),
    )


def in_background(fn):
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def test_kill_9_an_engine_process_mid_request_then_drain(redis_url, tmp_path):
    broker_port, rollout_port, metrics_port = free_port(), free_port(), free_port()
    broker_address, rollout_address = f"127.0.0.1:{broker_port}", f"127.0.0.1:{rollout_port}"
    broker_proc = start(
        ["furlong.weight_broker", "--port", str(broker_port), "--metrics-port", str(free_port())],
        tmp_path / "broker.log",
    )
    rollout_proc = start(
        [
            "furlong.rollout",
            "--port",
            str(rollout_port),
            "--metrics-port",
            str(metrics_port),
            "--redis-url",
            redis_url,
            "--broker",
            broker_address,
            "--num-threads",
            "1",
            "--engines",
            "process",
            "--engine-threads",
            "1",
            "--engine-max-batch-size",
            "4",
            "--chunk-rows",
            "2",
            "--engine-work-dir",
            str(tmp_path / "work"),
        ],
        tmp_path / "rollout.log",
    )
    broker = GrpcBrokerClient(broker_address)
    client = GrpcRolloutClient(rollout_address, RolloutDeadlines(call_s=60.0, generate_margin_s=120.0))
    red = redis.Redis.from_url(redis_url)
    publisher = None
    try:
        wait_until(
            lambda: rollout_proc.poll() is not None or check_health(rollout_address, "furlong.v1.Rollout"),
            90.0,
            "the rollout service to serve",
        )
        assert rollout_proc.poll() is None, (tmp_path / "rollout.log").read_text()[-3000:]
        wait_until(lambda: check_health(broker_address, "furlong.v1.WeightBroker"), 60.0, "the broker")
        checkpoint = str(write_checkpoint(tmp_path / "policy", seed=71))
        info = client.configure_run(
            RolloutRunConfig(
                run_id=RUN,
                model_dir=checkpoint,
                reward="addition_exact_match",
                rollout=RolloutSettings(num_engines=2),
            )
        )
        assert info.engine_ids == [E0, E1]
        first = engines_by_id(client)
        assert all(e.pid > 0 and e.pid != os.getpid() for e in first.values())
        wait_until(lambda: registered(broker) == (f"{RUN}-pool",), 30.0, "the pool's receiver to register")

        v1, v2 = tiny_model(72), tiny_model(73)
        publisher = WeightPublisher(
            broker, RUN, WeightLayout.from_state_dict(unique_state(v1)), agent_name="trainer-pool"
        )
        publisher.publish(1, unique_state(v1))
        assert broker.wait_committed(RUN, 1, 60.0).committed_version == 1
        assert {e.policy_version for e in engines_by_id(client).values()} == {1}

        # -- kill -9 an engine while it runs a chunk of a request --------------------------------
        thread, box = in_background(lambda: client.generate(step_request(0, PROMPTS, 4, LONG, 1)))
        request = f"{RUN}/0/1"
        wait_until(
            lambda: f"flight:{E0}".encode() in red.hvals(ledger_key(request)) or not thread.is_alive(),
            120.0,
            "a chunk in flight on engine 0",
        )
        assert thread.is_alive(), "the request finished before the engine could be killed"
        os.kill(first[E0].pid, signal.SIGKILL)
        thread.join(240)
        assert not thread.is_alive() and "error" not in box, box.get("error")
        result = box["result"]
        expected_ids = sorted(f"{p.prompt_id}/{i}" for p in PROMPTS for i in range(4))
        assert result.request_id == request and result.num_samples == 48 and result.num_groups == 12
        samples = stream_samples(red, 0)
        assert sorted(s.sample_id for s in samples) == expected_ids  # none lost or doubled
        assert {s.policy_version for s in samples} == {1}
        states = RedisSampleLedger(red, scope=RUN).states(request)
        assert sorted(states) == expected_ids and set(states.values()) == {DONE}
        counts = client.status(RUN).ledger
        assert (counts.pending, counts.in_flight, counts.done, counts.surplus) == (0, 0, 48, 0)

        wait_until(
            lambda: engines_by_id(client)[E0].healthy and engines_by_id(client)[E0].restarts == 1,
            120.0,
            "the killed engine to be back",
        )
        back = engines_by_id(client)
        assert back[E0].pid not in (0, first[E0].pid) and back[E1].pid == first[E1].pid
        assert {e.engine_id: e.policy_version for e in back.values()} == {E0: 1, E1: 1}

        # -- the next version reaches the restarted engine too -----------------------------------
        publisher.publish(2, unique_state(v2))
        assert broker.wait_committed(RUN, 2, 60.0).committed_version == 2
        greedy = client.generate(step_request(1, PROMPTS[:8], 1, GREEDY, 2))
        assert greedy.policy_version == 2
        tok = tokenizer()
        want = Engine(v2, tok).generate([tok.encode(p.text) for p in PROMPTS[:8]], GREEDY)
        got = {s.sample_id: s for s in stream_samples(red, 1)}
        assert [got[f"{p.prompt_id}/0"].response_token_ids for p in PROMPTS[:8]] == [
            w.token_ids for w in want
        ]
        assert {s.policy_version for s in got.values()} == {2}
        assert {e.engine_id: e.policy_version for e in client.status(RUN).engines} == {E0: 2, E1: 2}

        # -- drain engine 1 while it works; then it takes no new work ----------------------------
        thread, box = in_background(lambda: client.generate(step_request(2, PROMPTS, 2, LONG, 2)))
        wait_until(
            lambda: f"flight:{E1}".encode() in red.hvals(ledger_key(f"{RUN}/2/1")) or not thread.is_alive(),
            120.0,
            "a chunk in flight on engine 1",
        )
        drained = client.drain_engine(RUN, E1)
        assert drained.state in (EngineState.DRAINING, EngineState.DRAINED)
        thread.join(240)
        assert "error" not in box, box.get("error")
        assert box["result"].num_samples == 24
        wait_until(lambda: engines_by_id(client)[E1].state is EngineState.DRAINED, 30.0, "drained")
        os.kill(first[E1].pid, signal.SIGSTOP)  # a chunk sent to it now would hang
        try:
            after = client.generate(step_request(3, PROMPTS[:6], 2, LONG, 2))
        finally:
            os.kill(first[E1].pid, signal.SIGCONT)
        assert after.num_samples == 12
        assert sorted(s.sample_id for s in stream_samples(red, 3)) == sorted(
            f"{p.prompt_id}/{i}" for p in PROMPTS[:6] for i in range(2)
        )

        metrics = (
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        )
        assert f'furlong_rollout_ledger_samples{{run_id="{RUN}",state="in_flight"}} 0.0' in metrics
        assert f'furlong_rollout_ledger_samples{{run_id="{RUN}",state="done"}} 92.0' in metrics
        assert f'furlong_rollout_engine_restarts_total{{engine="{E0}",run_id="{RUN}"}} 1.0' in metrics
        assert f'furlong_rollout_engine_drained{{engine="{E1}",run_id="{RUN}"}} 1.0' in metrics

        client.end_run(RUN)
        for e in back.values():
            wait_until(
                lambda e=e: (
                    not os.path.exists(f"/proc/{e.pid}")
                    or open(f"/proc/{e.pid}/stat").read().split()[2] == "Z"
                ),
                30.0,
                f"engine process {e.pid} to exit",
            )
    finally:
        client.close()
        if publisher is not None:
            publisher.close()
        broker.close()
        red.close()
        stop(rollout_proc)
        stop(broker_proc)
