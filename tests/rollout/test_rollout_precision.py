"""Where and in which precision the rollout service runs a run's engines: the service's --device, the
run's precision.dtype. A bfloat16 engine holds exactly the published float32 weights rounded to
bfloat16 (what torch's own cast gives), so the trainer's weight-equality check of the float32 bytes
still says what the engine serves. Real Redis; weight receivers are test doubles."""

from __future__ import annotations

import math

import pytest
import redis
import torch
from rollout_models import tiny_model, write_checkpoint

from furlong.core.checkpoint import load_policy, unique_state
from furlong.core.samples import STREAM_FIELD, SampleGroup, stream_key
from furlong.core.settings import PrecisionSettings, RolloutSettings
from furlong.rollout.config import RolloutServerConfig
from furlong.rollout.core.sampler import SamplingConfig
from furlong.rollout.core.service import RolloutService
from furlong.rollout.core.types import GenerateRequest, Prompt, RolloutRunConfig
from furlong.rollout.run_records import redis_records

pytestmark = pytest.mark.integration


class Receivers:
    def __init__(self) -> None:
        self.apply: dict[str, object] = {}

    def __call__(self, run_id, engine_id, apply):
        self.apply[engine_id] = apply
        return self

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_bfloat16_run_serves_the_published_weights_rounded_to_bfloat16(tmp_path, redis_url):
    checkpoint = str(write_checkpoint(tmp_path / "policy", seed=3))
    loaded: list[torch.nn.Module] = []

    def loader(model_dir: str):
        model, tokenizer = load_policy(model_dir)
        loaded.append(model)
        return model, tokenizer

    client = redis.Redis.from_url(redis_url)
    receivers = Receivers()
    service = RolloutService(redis_records(client), receivers, policy_loader=loader, device="cpu")
    config = RolloutRunConfig(
        run_id="run-bf16",
        model_dir=checkpoint,
        reward="addition_exact_match",
        rollout=RolloutSettings(num_engines=1),
        precision=PrecisionSettings(dtype="bfloat16"),
    )
    try:
        service.configure_run(config)
        (engine_model,) = loaded
        assert {p.dtype for p in engine_model.parameters()} == {torch.bfloat16}

        published = unique_state(tiny_model(42))  # float32, as the trainer publishes
        assert {t.dtype for t in published.values()} == {torch.float32}
        receivers.apply["run-bf16-engine-0"](1, published)
        served = engine_model.state_dict()
        for name, tensor in published.items():
            assert served[name].dtype == torch.bfloat16
            assert torch.equal(served[name], tensor.to(torch.bfloat16)), name

        result = service.generate(
            GenerateRequest(
                run_id="run-bf16",
                step=1,
                samples_per_prompt=2,
                sampling=SamplingConfig(temperature=1.0, max_new_tokens=5, seed=1),
                prompts=(Prompt("p0", "12+7=", "19"),),
                min_policy_version=1,
                timeout_s=10.0,
            )
        )
        assert result.policy_version == 1
        (entry,) = client.xrange(stream_key("run-bf16"))
        group = SampleGroup.decode(entry[1][STREAM_FIELD])
        for sample in group.samples:
            assert sample.policy_version == 1
            assert all(math.isfinite(x) and x <= 0.0 for x in sample.response_logprobs)
    finally:
        service.close()
        client.close()


def test_a_float32_run_keeps_float32_engines(tmp_path, redis_url):
    checkpoint = str(write_checkpoint(tmp_path / "policy", seed=3))
    loaded: list[torch.nn.Module] = []

    def loader(model_dir: str):
        model, tokenizer = load_policy(model_dir)
        loaded.append(model)
        return model, tokenizer

    client = redis.Redis.from_url(redis_url)
    service = RolloutService(redis_records(client), None, policy_loader=loader)
    try:
        service.configure_run(
            RolloutRunConfig(run_id="run-fp32", model_dir=checkpoint, reward="addition_exact_match")
        )
        assert {p.dtype for p in loaded[0].parameters()} == {torch.float32}
    finally:
        service.close()
        client.close()


ARGS = [
    "--redis-url",
    "redis://127.0.0.1:6379/0",
    "--broker",
    "127.0.0.1:5",
    "--port",
    "0",
    "--metrics-port",
    "0",
]


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cpu:0", ""])
def test_a_bad_device_flag_exits_2_naming_it(device, capsys):
    with pytest.raises(SystemExit) as exc:
        RolloutServerConfig.from_args([*ARGS, "--device", device])
    assert exc.value.code == 2
    assert "--device" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exc:
        RolloutServerConfig.from_args([*ARGS, "--device", "cuda"])
    assert exc.value.code == 2
    assert "--device 'cuda'" in (err := capsys.readouterr().err) and "CUDA is not available" in err
    with pytest.raises(ValueError, match="CUDA is not available"):
        RolloutService(redis_records(None), None, device="cuda")  # type: ignore[arg-type]
