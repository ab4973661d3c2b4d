"""`python -m furlong.rollout --sglang-command ...` with a run whose spec says `rollout.engine:
sglang`: the service launches the run's engine with SGLang's command line (a CPU stand-in process
speaking SGLang's HTTP API), a policy version published through the broker reaches it (from disk,
the CPU path, or as the receiver's tensors through `/update_weights_from_tensor`, with no model
directory written), Generate samples with it, and SIGTERM leaves no engine process behind."""

from __future__ import annotations

import shlex
import signal
from pathlib import Path

import pytest
import redis
from polling import wait_until
from rollout_models import tiny_model, tokenizer, write_checkpoint
from test_rollout_pool_sglang import STANDIN, running, standin_pids
from test_rollout_process import GREEDY, PROMPTS, start, stop

from furlong.core.checkpoint import unique_state
from furlong.core.samples import STREAM_FIELD, SampleGroup, stream_key
from furlong.core.settings import RolloutSettings
from furlong.core.weights import WeightLayout
from furlong.rollout.client import GrpcRolloutClient
from furlong.rollout.core.engine import Engine
from furlong.rollout.core.types import GenerateRequest, RolloutRunConfig
from furlong.rpc import check_health
from furlong.rpc.ports import free_port
from furlong.transfer.broker_client import GrpcBrokerClient
from furlong.transfer.publisher import WeightPublisher

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RUN = "run-sglang"


def engines(broker: GrpcBrokerClient) -> tuple[str, ...]:
    try:
        return tuple(sorted(broker.get_version(RUN).engine_ids))
    except Exception:  # noqa: BLE001 - the run does not exist at the broker until an engine registers
        return ()


@pytest.mark.parametrize("route", ["disk", "tensor"])
def test_a_run_with_engine_sglang_is_served_by_launched_sglang_servers(
    redis_url, tmp_path, monkeypatch, route
):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    monkeypatch.setenv("FURLONG_STANDIN_PID_DIR", str(pid_dir))
    broker_port, rollout_port = free_port(), free_port()
    broker_address, rollout_address = f"127.0.0.1:{broker_port}", f"127.0.0.1:{rollout_port}"
    broker_proc = start(
        ["furlong.weight_broker", "--port", str(broker_port), "--metrics-port", str(free_port())],
        tmp_path / "broker.log",
    )
    rollout_proc = start(
        ["furlong.rollout", "--host", "127.0.0.1", "--port", str(rollout_port),
         "--metrics-port", str(free_port()), "--redis-url", redis_url, "--broker", broker_address,
         "--num-threads", "1", "--sglang-command", shlex.join(STANDIN), "--weight-route", route,
         "--engine-work-dir", str(tmp_path / "work")],
        tmp_path / "rollout.log",
    )  # fmt: skip
    log = Path(tmp_path / "rollout.log")
    broker = GrpcBrokerClient(broker_address)
    client = GrpcRolloutClient(rollout_address)
    publisher = None
    try:
        wait_until(
            lambda: rollout_proc.poll() is not None or check_health(rollout_address, "furlong.v1.Rollout"),
            90.0,
            "the rollout service to serve",
        )
        assert rollout_proc.poll() is None, log.read_text()[-3000:]
        wait_until(lambda: check_health(broker_address, "furlong.v1.WeightBroker"), 60.0, "the broker")
        checkpoint = str(write_checkpoint(tmp_path / "policy", seed=31))
        info = client.configure_run(
            RolloutRunConfig(
                run_id=RUN,
                model_dir=checkpoint,
                reward="addition_exact_match",
                rollout=RolloutSettings(num_engines=1, engine="sglang"),
            )
        )
        assert info.engine_ids == [f"{RUN}-engine-0"]
        [(leader, child)] = standin_pids(pid_dir).values()
        assert [e.pid for e in client.status(RUN).engines] == [leader]
        wait_until(lambda: engines(broker) == (f"{RUN}-pool",), 30.0, "the pool's receiver")

        new_model = tiny_model(32)
        state = unique_state(new_model)
        publisher = WeightPublisher(broker, RUN, WeightLayout.from_state_dict(state), agent_name="trainer")
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
        written = sorted(p.name for p in (tmp_path / "work").glob("*/weights/*"))
        assert written == (["v1"] if route == "disk" else []), written
        r = redis.Redis.from_url(redis_url)
        groups = [SampleGroup.decode(f[STREAM_FIELD]) for _, f in r.xrange(stream_key(RUN))]
        r.close()
        tok = tokenizer()
        expected = Engine(new_model, tok).generate([tok.encode(p.text) for p in PROMPTS], GREEDY)
        for group, want in zip(groups, expected):
            assert [s.response_token_ids for s in group.samples] == [want.token_ids] * 2
            assert {s.policy_version for s in group.samples} == {1}

        rollout_proc.send_signal(signal.SIGTERM)
        assert rollout_proc.wait(60) == 0, log.read_text()[-3000:]
        wait_until(lambda: not running(leader) and not running(child), 20, "no engine process left")
    finally:
        client.close()
        if publisher is not None:
            publisher.close()
        broker.close()
        stop(rollout_proc)
        stop(broker_proc)
    assert "--skip-tokenizer-init --enable-deterministic-inference --dtype float32" in log.read_text()
