"""`python -m furlong.rollout` as its own process with `python -m furlong.weight_broker`: a new policy
version published from this process reaches both engines over NIXL, Generate waits for it and samples
with it, metrics show it, and SIGTERM unregisters the engines and exits cleanly."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request

import pytest
import redis
from polling import wait_until
from rollout_models import tiny_model, tokenizer, write_checkpoint

from furlong.core.checkpoint import unique_state
from furlong.core.samples import STREAM_FIELD, SampleGroup, stream_key
from furlong.core.settings import RolloutSettings
from furlong.core.weights import WeightLayout
from furlong.rollout.client import GrpcRolloutClient
from furlong.rollout.core.engine import Engine
from furlong.rollout.core.sampler import SamplingConfig
from furlong.rollout.core.types import GenerateRequest, Prompt, RolloutRunConfig
from furlong.rpc import check_health
from furlong.rpc.ports import free_port
from furlong.transfer.broker_client import GrpcBrokerClient
from furlong.transfer.publisher import WeightPublisher

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RUN = "run-e2e"
PROMPTS = [Prompt("x", "12+30=", "42"), Prompt("y", "7+7=", "14")]
GREEDY = SamplingConfig(temperature=1.0, top_k=1, max_new_tokens=6, seed=0)


def start(args, log_path):
    return subprocess.Popen(
        [sys.executable, "-m", *args], stdout=open(log_path, "w"), stderr=subprocess.STDOUT
    )


def stop(proc):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def engines(broker: GrpcBrokerClient) -> tuple[str, ...]:
    try:
        return tuple(sorted(broker.get_version(RUN).engine_ids))
    except Exception:  # noqa: BLE001 - the run does not exist at the broker until an engine registers
        return ()


def test_rollout_process_takes_new_versions_from_the_broker(redis_url, tmp_path):
    broker_port, rollout_port = free_port(), free_port()
    broker_address, rollout_address = f"127.0.0.1:{broker_port}", f"127.0.0.1:{rollout_port}"
    metrics_port = free_port()
    broker_proc = start(
        ["furlong.weight_broker", "--port", str(broker_port), "--metrics-port", str(free_port())],
        tmp_path / "broker.log",
    )
    rollout_proc = start(
        [
            "furlong.rollout",
            "--host",
            "127.0.0.1",
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
            "--log-level",
            "INFO",
        ],
        tmp_path / "rollout.log",
    )
    broker = GrpcBrokerClient(broker_address)
    client = GrpcRolloutClient(rollout_address)
    publisher = None
    try:
        wait_until(
            lambda: rollout_proc.poll() is not None or check_health(rollout_address, "furlong.v1.Rollout"),
            90.0,
            "the rollout service to serve",
        )
        assert rollout_proc.poll() is None, (tmp_path / "rollout.log").read_text()[-3000:]
        wait_until(lambda: check_health(broker_address, "furlong.v1.WeightBroker"), 60.0, "the broker")

        checkpoint = str(write_checkpoint(tmp_path / "policy", seed=31))
        info = client.configure_run(
            RolloutRunConfig(
                run_id=RUN,
                model_dir=checkpoint,
                reward="addition_exact_match",
                rollout=RolloutSettings(num_engines=2),
            )
        )
        assert info.engine_ids == [f"{RUN}-engine-0", f"{RUN}-engine-1"]
        wait_until(lambda: engines(broker) == tuple(info.engine_ids), 30.0, "both engines to register")

        new_model = tiny_model(32)
        state = unique_state(new_model)
        publisher = WeightPublisher(
            broker, RUN, WeightLayout.from_state_dict(state), agent_name="trainer-e2e"
        )
        publisher.publish(1, state)
        result = client.generate(
            GenerateRequest(
                run_id=RUN,
                step=0,
                samples_per_prompt=2,
                sampling=GREEDY,
                min_policy_version=1,
                timeout_s=60.0,
                prompts=tuple(PROMPTS),
            )
        )
        assert result.policy_version == 1 and result.num_samples == 4
        assert broker.wait_committed(RUN, 1, 30.0).committed_version == 1

        r = redis.Redis.from_url(redis_url)
        groups = [SampleGroup.decode(f[STREAM_FIELD]) for _, f in r.xrange(stream_key(RUN))]
        r.close()
        tok = tokenizer()
        expected = Engine(new_model, tok).generate([tok.encode(p.text) for p in PROMPTS], GREEDY)
        for group, want in zip(groups, expected):
            assert [s.response_token_ids for s in group.samples] == [want.token_ids] * 2
            assert {s.policy_version for s in group.samples} == {1}
        assert [e.policy_version for e in client.status(RUN).engines] == [1, 1]

        metrics = (
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        )
        assert f'furlong_rollout_policy_version{{engine="{RUN}-engine-1"}} 1.0' in metrics
        assert f'furlong_rollout_samples_total{{run_id="{RUN}"}} 4.0' in metrics

        rollout_proc.send_signal(signal.SIGTERM)
        assert rollout_proc.wait(30) == 0, (tmp_path / "rollout.log").read_text()[-3000:]
        wait_until(lambda: engines(broker) == (), 10.0, "the engines to unregister")
    finally:
        client.close()
        if publisher is not None:
            publisher.close()
        broker.close()
        stop(rollout_proc)
        stop(broker_proc)
    assert "rollout stopped" in (tmp_path / "rollout.log").read_text()
