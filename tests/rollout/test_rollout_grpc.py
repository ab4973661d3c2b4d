"""The rollout gRPC server and client on 127.0.0.1: the same results as the service, status codes for
bad requests, health and metrics."""

from __future__ import annotations

import grpc
import pytest
import redis
from prometheus_client import CollectorRegistry
from rollout_models import write_checkpoint

from furlong.core.errors import NotFoundError
from furlong.core.samples import STREAM_FIELD, SampleGroup, stream_key
from furlong.core.settings import RolloutSettings
from furlong.rollout.client import GrpcRolloutClient
from furlong.rollout.core.sampler import SamplingConfig
from furlong.rollout.core.service import RolloutService
from furlong.rollout.core.types import GenerateRequest, Prompt, RolloutRunConfig
from furlong.rollout.metrics import POLICY_VERSION, SAMPLES_TOTAL, TOKENS_TOTAL, RolloutMetrics
from furlong.rollout.run_records import redis_records
from furlong.rollout.server import SERVICE_NAME, RolloutServicer
from furlong.rpc import channel, check_health, start_server
from furlong.v1 import common_pb2
from furlong.v1 import rollout_pb2 as pb
from furlong.v1 import rollout_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

PROMPTS = [Prompt("a", "1+2=", "3"), Prompt("b", "40+2=", "42")]


@pytest.fixture
def stack(redis_url, tmp_path):
    client_redis = redis.Redis.from_url(redis_url)
    registry = CollectorRegistry()
    service = RolloutService(redis_records(client_redis), None, observer=RolloutMetrics(registry))
    server = start_server([RolloutServicer(service).add_to_server], [SERVICE_NAME])
    address = f"127.0.0.1:{server.port}"
    client = GrpcRolloutClient(address)
    yield dict(
        client=client,
        address=address,
        redis=client_redis,
        registry=registry,
        checkpoint=str(write_checkpoint(tmp_path / "ckpt", seed=4)),
    )
    client.close()
    server.stop(0.5)
    service.close()
    client_redis.close()


def request(run_id, step, samples_per_prompt, sampling, prompts=PROMPTS, **fields):
    return GenerateRequest(
        run_id=run_id,
        step=step,
        samples_per_prompt=samples_per_prompt,
        sampling=sampling,
        timeout_s=5.0,
        prompts=tuple(prompts),
        **fields,
    )


def test_round_trip_over_grpc(stack):
    client, registry = stack["client"], stack["registry"]
    assert SERVICE_NAME == "furlong.v1.Rollout" and check_health(stack["address"], SERVICE_NAME)
    info = client.configure_run(
        RolloutRunConfig(run_id="run-g", model_dir=stack["checkpoint"], reward="addition_exact_match", seed=9)
    )
    assert info.engine_ids == ["run-g-engine-0"] and info.policy_version == 0
    sampling = SamplingConfig(temperature=0.9, top_k=6, max_new_tokens=5, seed=1)
    result = client.generate(request("run-g", 2, 3, sampling))
    assert (result.run_id, result.step, result.num_groups, result.num_samples) == ("run-g", 2, 2, 6)
    groups = [SampleGroup.decode(f[STREAM_FIELD]) for _, f in stack["redis"].xrange(stream_key("run-g"))]
    assert [g.prompt_id for g in groups] == ["a", "b"]
    tokens = sum(len(s.response_token_ids) for g in groups for s in g.samples)
    assert result.num_tokens == tokens
    assert all(
        len(s.sampling_support.row(i)) == 6
        for g in groups
        for s in g.samples
        for i in range(len(s.response_token_ids))
    )
    assert registry.get_sample_value(SAMPLES_TOTAL, {"run_id": "run-g"}) == 6
    assert registry.get_sample_value(TOKENS_TOTAL, {"run_id": "run-g"}) == tokens
    assert registry.get_sample_value(POLICY_VERSION, {"engine": "run-g-engine-0"}) == 0
    status = client.status("run-g")
    assert [(e.engine_id, e.policy_version, e.healthy) for e in status.engines] == [
        ("run-g-engine-0", 0, True)
    ]
    client.end_run("run-g")
    assert registry.get_sample_value(SAMPLES_TOTAL, {"run_id": "run-g"}) is None
    with pytest.raises(NotFoundError, match="run-g"):
        client.status("run-g")

    # A task run: the run's rollout settings and the step's group count travel, and so does a
    # repeated step's resumed count.
    client.configure_run(
        RolloutRunConfig(
            run_id="run-t",
            model_dir=stack["checkpoint"],
            task="addition",
            rollout=RolloutSettings(over_sampling=2.0),
        )
    )
    first = client.generate(request("run-t", 0, 2, sampling, prompts=(), num_groups=2))
    assert (first.num_groups, first.num_samples, first.num_groups_surplus) == (2, 4, 2)
    assert first.num_groups_resumed == 0
    again = client.generate(request("run-t", 0, 2, sampling, prompts=(), num_groups=2))
    assert (again.num_groups, again.num_samples, again.num_groups_resumed) == (2, 0, 2)
    assert stack["redis"].xlen(stream_key("run-t")) == 2


def test_invalid_requests_get_invalid_argument(stack):
    client = stack["client"]
    client.configure_run(
        RolloutRunConfig(run_id="run-i", model_dir=stack["checkpoint"], reward="addition_exact_match")
    )
    ch = channel(stack["address"])
    stub = pb_grpc.RolloutStub(ch)
    good = dict(
        run_id="run-i",
        step=0,
        prompts=[pb.Prompt(prompt_id="a", text="1+1=", answer="2")],
        samples_per_prompt=2,
        min_policy_version=0,
        timeout_s=2.0,
        sampling=common_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4),
    )
    cases = [
        (
            dict(sampling=common_pb2.SamplingParams(temperature=-1.0, top_p=1.0, max_new_tokens=4)),
            "sampling.temperature: must be in [0, 100], got -1",
        ),
        (
            dict(sampling=common_pb2.SamplingParams(temperature=1.0, top_p=0.0, max_new_tokens=4)),
            "sampling.top_p: must be in (0, 1], got 0",
        ),
        (dict(sampling=None), "sampling is required"),
        (dict(samples_per_prompt=0), "samples_per_prompt"),
        (dict(timeout_s=0.0), "timeout_s"),
    ]
    try:
        for change, needle in cases:
            with pytest.raises(grpc.RpcError) as info:
                stub.Generate(pb.GenerateRequest(**{**good, **change}), timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, needle
            assert needle in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.ConfigureRun(
                pb.ConfigureRolloutRequest(
                    run_id="run-j",
                    model_dir=stack["checkpoint"],
                    reward="nope",
                    rollout=pb.RolloutConfig(num_engines=1, over_sampling=1.0, engine="builtin"),
                    precision=common_pb2.PrecisionConfig(dtype="float32"),
                ),
                timeout=30,
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown reward 'nope'; known rewards: addition_exact_match" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:  # every rollout setting is sent, none defaulted
            stub.ConfigureRun(
                pb.ConfigureRolloutRequest(
                    run_id="run-j", model_dir=stack["checkpoint"], reward="addition_exact_match"
                ),
                timeout=30,
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "rollout.num_engines: must be an integer in [1, 64], got 0" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:  # nor the precision
            stub.ConfigureRun(
                pb.ConfigureRolloutRequest(
                    run_id="run-j",
                    model_dir=stack["checkpoint"],
                    reward="addition_exact_match",
                    rollout=pb.RolloutConfig(num_engines=1, over_sampling=1.0, engine="builtin"),
                ),
                timeout=30,
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "precision.dtype: must be one of ['float32', 'bfloat16'], got ''" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.EndRun(pb.EndRolloutRequest(run_id="never"), timeout=30)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(
                pb.GenerateRequest(**{**good, "min_policy_version": 3, "timeout_s": 0.1}), timeout=30
            )
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "min_policy_version 3" in info.value.details()
    finally:
        ch.close()
    with pytest.raises(ValueError, match="samples_per_prompt"):
        client.generate(request("run-i", 0, 0, SamplingConfig()))
