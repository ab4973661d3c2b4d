"""Bad requests over gRPC (negative max tokens, top-p or min-p out of range, unknown reward, prompt
longer than the context, more groups than prompts, no prompts for a run without a task) get
INVALID_ARGUMENT naming the bad value, while a good request running at
the same time completes with exactly the samples it gives alone, and the engine stays healthy."""

from __future__ import annotations

import threading

import grpc
import pytest
import redis
from rollout_models import write_checkpoint

from furlong.core.samples import STREAM_FIELD, SampleGroup, stream_key
from furlong.rollout.client import GrpcRolloutClient
from furlong.rollout.core.sampler import SamplingConfig
from furlong.rollout.core.service import RolloutService
from furlong.rollout.core.types import GenerateRequest, Prompt, RolloutRunConfig
from furlong.rollout.run_records import redis_records
from furlong.rollout.server import SERVICE_NAME, RolloutServicer
from furlong.rpc import channel, start_server
from furlong.v1 import common_pb2
from furlong.v1 import rollout_pb2 as pb
from furlong.v1 import rollout_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

PROMPTS = [Prompt(f"p{i}", f"{i}+{3 * i}=", str(4 * i)) for i in range(8)]
GOOD = SamplingConfig(temperature=1.0, top_k=8, top_p=0.9, min_p=0.01, max_new_tokens=24, seed=5)


def tokens(client: redis.Redis, run_id: str) -> list[list[int]]:
    return [
        s.response_token_ids
        for _, f in client.xrange(stream_key(run_id))
        for s in SampleGroup.decode(f[STREAM_FIELD]).samples
    ]


def run_config(run_id: str, checkpoint: str) -> RolloutRunConfig:
    return RolloutRunConfig(run_id=run_id, model_dir=checkpoint, reward="addition_exact_match", seed=3)


def request(run_id: str, step: int, prompts: list[Prompt], samples_per_prompt: int) -> GenerateRequest:
    return GenerateRequest(
        run_id=run_id,
        step=step,
        samples_per_prompt=samples_per_prompt,
        sampling=GOOD,
        timeout_s=30.0,
        prompts=tuple(prompts),
    )


def test_bad_requests_fail_clearly_and_leave_a_concurrent_request_alone(redis_url, tmp_path):
    red = redis.Redis.from_url(redis_url)
    service = RolloutService(redis_records(red), None)
    server = start_server([RolloutServicer(service).add_to_server], [SERVICE_NAME], max_workers=8)
    address = f"127.0.0.1:{server.port}"
    client = GrpcRolloutClient(address)
    ch = channel(address)
    stub = pb_grpc.RolloutStub(ch)
    checkpoint = str(write_checkpoint(tmp_path / "ckpt", seed=6))
    try:
        client.configure_run(run_config("solo", checkpoint))
        client.generate(request("solo", 0, PROMPTS, 4))
        client.configure_run(run_config("busy", checkpoint))
        outcome: dict = {}
        good = threading.Thread(
            target=lambda: outcome.update(r=client.generate(request("busy", 0, PROMPTS, 4)))
        )
        good.start()

        base = dict(
            run_id="busy",
            step=1,
            prompts=[pb.Prompt(prompt_id="a", text="1+1=", answer="2")],
            samples_per_prompt=2,
            min_policy_version=0,
            timeout_s=5.0,
        )
        params = dict(temperature=1.0, top_p=1.0, max_new_tokens=4)
        cases = [
            (
                dict(sampling=common_pb2.SamplingParams(**{**params, "max_new_tokens": -3})),
                "sampling.max_new_tokens: must be an integer in [1, 131072], got -3",
            ),
            (
                dict(sampling=common_pb2.SamplingParams(**{**params, "top_p": 1.5})),
                "sampling.top_p: must be in (0, 1], got 1.5",
            ),
            (
                dict(sampling=common_pb2.SamplingParams(**{**params, "top_p": -0.2})),
                "sampling.top_p: must be in (0, 1], got -0.2",
            ),
            (
                dict(sampling=common_pb2.SamplingParams(**{**params, "min_p": 1.0})),
                "sampling.min_p: must be in [0, 1), got 1.0",
            ),
            (
                dict(
                    sampling=common_pb2.SamplingParams(**params),
                    prompts=[pb.Prompt(prompt_id="long", text="1" * 130, answer="")],
                ),
                "prompt 'long'",
            ),
            (
                dict(sampling=common_pb2.SamplingParams(**params), num_groups=2),
                "num_groups must be an integer [0, 1], got 2",
            ),
            (
                dict(sampling=common_pb2.SamplingParams(**params), prompts=[]),
                "run busy has no task: a Generate request must carry its prompts",
            ),
        ]
        for change, needle in cases:
            with pytest.raises(grpc.RpcError) as info:
                stub.Generate(pb.GenerateRequest(**{**base, **change}), timeout=60)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, needle
            assert needle in info.value.details(), info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(
                pb.GenerateRequest(
                    **{
                        **base,
                        "sampling": common_pb2.SamplingParams(**params),
                        "prompts": [pb.Prompt(prompt_id="long", text="1" * 130)],
                    }
                ),
                timeout=60,
            )
        assert "max_position_embeddings 128" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.ConfigureRun(
                pb.ConfigureRolloutRequest(
                    run_id="busy2",
                    model_dir=checkpoint,
                    reward="no_such_reward",
                    rollout=pb.RolloutConfig(num_engines=1, over_sampling=1.0, engine="builtin"),
                    precision=common_pb2.PrecisionConfig(dtype="float32"),
                ),
                timeout=60,
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown reward 'no_such_reward'" in info.value.details()

        good.join(60)
        assert not good.is_alive()
        assert outcome["r"].num_samples == 32
        assert tokens(red, "busy") == tokens(red, "solo") and len(tokens(red, "solo")) == 32
        assert [e.healthy for e in client.status("busy").engines] == [True]
        after = client.generate(request("busy", 2, PROMPTS[:1], 2))
        assert after.num_samples == 2
        assert "busy2" not in service.run_ids()
    finally:
        ch.close()
        client.close()
        server.stop(0.5)
        service.close()
        red.close()
