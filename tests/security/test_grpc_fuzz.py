"""Hostile gRPC requests against the real servicers on 127.0.0.1 (weight broker, rollout, trainer):
bad enums, negative and huge counts, NaN and infinite numbers, empty and oversized ids, control
characters, malformed manifests and shard layouts. Every answer must be a status naming the
caller's mistake (INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION; DEADLINE_EXCEEDED for requests
that ask to wait), never UNKNOWN or INTERNAL, and the server must go on serving valid requests.

Each request is built from a valid one for a run that exists, with some fields replaced, so that a
hostile value gets past the lookups it would otherwise fail first (see `proto_fuzz`)."""

from __future__ import annotations

import grpc
import pytest
import redis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proto_fuzz import CLIENT_ERRORS, WAIT_ERRORS, details_of, messages, status_of
from tiny_policy import write_tiny_checkpoint

from furlong import rpc
from furlong.core.settings import AlgorithmSettings
from furlong.core.weight_versions import WeightSourceInfo
from furlong.core.weights import Manifest, WeightLayout
from furlong.rollout.core.service import RolloutService
from furlong.rollout.run_records import redis_records
from furlong.rollout.server import SERVICE_NAME as ROLLOUT_SERVICE
from furlong.rollout.server import RolloutServicer
from furlong.rpc.settings import algorithm_to_proto
from furlong.trainer.server import SERVICE_NAME as TRAINER_SERVICE
from furlong.trainer.server import register as register_trainer
from furlong.trainer.service import TrainerService
from furlong.trainer.train_checkpoint import MANIFEST
from furlong.transfer.wire import manifest_to_proto, source_to_proto
from furlong.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from furlong.v1 import weight_broker_pb2 as broker_pb2
from furlong.v1 import weight_broker_pb2_grpc as broker_pb2_grpc
from furlong.weight_broker.client import InProcessBrokerClient
from furlong.weight_broker.core import BrokerCore
from furlong.weight_broker.server import SERVICE_NAME as BROKER_SERVICE
from furlong.weight_broker.server import WeightBrokerServicer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FUZZ = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
RUN = "fuzz-run"
ENGINE = "engine-0"


def check(stub, method: str, request, allowed=CLIENT_ERRORS) -> None:
    code = status_of(getattr(stub, method), request)
    assert code == grpc.StatusCode.OK or code in allowed, (
        f"{method} answered {details_of(getattr(stub, method), request)} to\n{request}"
    )


# -- weight broker ---------------------------------------------------------------------------------

LAYOUT = WeightLayout.from_state_dict(
    {"w": torch.zeros(3, 2, dtype=torch.bfloat16), "b": torch.zeros(5, dtype=torch.int32)}
)
SOURCE = WeightSourceInfo("trainer", b"\x00metadata", 0x7F0000001000, 4096, "DRAM", 0)


@pytest.fixture(scope="module")
def broker():
    core = BrokerCore(max_ack_attempts=3)
    server = rpc.start_server(
        [WeightBrokerServicer(core, stream_poll_s=0.1).add_to_server], [BROKER_SERVICE], max_workers=8
    )
    ch = rpc.channel(f"127.0.0.1:{server.port}")
    yield broker_pb2_grpc.WeightBrokerStub(ch), f"127.0.0.1:{server.port}"
    ch.close()
    core.shutdown()
    server.stop(0.5)


def _broker_bases() -> dict[str, tuple[object, frozenset]]:
    manifest = manifest_to_proto(Manifest(1, LAYOUT, f"{1:032x}"))
    source = source_to_proto(SOURCE)
    p = broker_pb2
    return {
        "RegisterEngine": (p.RegisterEngineRequest(run_id=RUN, engine_id=ENGINE), CLIENT_ERRORS),
        "UnregisterEngine": (p.UnregisterEngineRequest(run_id=RUN, engine_id=ENGINE), CLIENT_ERRORS),
        "BeginVersion": (p.BeginVersionRequest(run_id=RUN, manifest=manifest, source=source), CLIENT_ERRORS),
        "StageRound": (p.StageRoundRequest(run_id=RUN, version=1, round=0), CLIENT_ERRORS),
        "WaitRound": (p.WaitRoundRequest(run_id=RUN, version=1, round=0, timeout_s=0.05), WAIT_ERRORS),
        "AckRound": (
            p.AckRoundRequest(run_id=RUN, engine_id=ENGINE, version=1, round=0, ok=True, lane="grpc"),
            CLIENT_ERRORS,
        ),
        "AckVersion": (
            p.AckVersionRequest(run_id=RUN, engine_id=ENGINE, version=1, ok=True, lane="grpc"),
            CLIENT_ERRORS,
        ),
        "WaitCommitted": (p.WaitCommittedRequest(run_id=RUN, version=1, timeout_s=0.05), WAIT_ERRORS),
        "GetVersion": (p.GetVersionRequest(run_id=RUN), CLIENT_ERRORS),
        "GetDestinations": (p.GetDestinationsRequest(run_id=RUN), CLIENT_ERRORS),
        "EndRun": (p.EndRunBrokerRequest(run_id=RUN), CLIENT_ERRORS),
    }


BROKER_BASES = _broker_bases()
STRINGS = {
    "run_id": [RUN],
    "engine_id": [ENGINE],
    "lane": ["cuda_ipc", "nixl", "shm", "grpc"],
    "dtype": ["float32", "bfloat16", "int32", "float8_e4m3fn", "complex128", "torch.float32"],
    "checksum_algorithm": ["xxh3-128/8MiB-blocks"],
    "memory_kind": ["DRAM", "VRAM"],
    "name": ["w", "b"],
    "source": ["w", "b"],
    "names": ["w", "b"],
}


@FUZZ
@given(st.data())
def test_broker_refuses_hostile_requests_with_client_errors(broker, data):
    stub, _ = broker
    method = data.draw(st.sampled_from(sorted(BROKER_BASES)), label="method")
    base, allowed = BROKER_BASES[method]
    request = data.draw(messages(base.DESCRIPTOR, base, STRINGS), label="request")
    check(stub, method, request, allowed)


def test_broker_serves_after_the_fuzz(broker):
    stub, address = broker
    assert rpc.check_health(address, BROKER_SERVICE)
    reply = stub.RegisterEngine(
        broker_pb2.RegisterEngineRequest(run_id="after-fuzz", engine_id=ENGINE), timeout=10
    )
    assert reply.committed_version == -1


# -- rollout and trainer ---------------------------------------------------------------------------


ROLLOUT_CONFIG = rollout_pb2.RolloutConfig(num_engines=1, max_refill_rounds=0, over_sampling=1.0)
PRECISION = common_pb2.PrecisionConfig(dtype="float32", gradient_checkpointing=False)


@pytest.fixture(scope="module")
def services(tmp_path_factory, redis_server_url):
    """Rollout and trainer servicers on loopback gRPC, each with a configured run of a tiny model."""
    tmp = tmp_path_factory.mktemp("fuzz")
    model = str(write_tiny_checkpoint(tmp / "model"))
    client = redis.Redis.from_url(redis_server_url)
    broker = InProcessBrokerClient(BrokerCore())
    rollout = RolloutService(redis_records(client), None)
    trainer = TrainerService(
        client, broker, consumer_name="fuzz-trainer", checkpoint_root=tmp / "checkpoints"
    )
    servers = {
        "rollout": rpc.start_server(
            [RolloutServicer(rollout).add_to_server], [ROLLOUT_SERVICE], max_workers=8
        ),
        "trainer": rpc.start_server([register_trainer(trainer)], [TRAINER_SERVICE], max_workers=8),
    }
    channels = {name: rpc.channel(f"127.0.0.1:{s.port}") for name, s in servers.items()}
    stubs = {
        "rollout": rollout_pb2_grpc.RolloutStub(channels["rollout"]),
        "trainer": trainer_pb2_grpc.TrainerStub(channels["trainer"]),
    }
    configure_rollout = rollout_pb2.ConfigureRolloutRequest(
        run_id=RUN,
        model_dir=model,
        reward="addition_exact_match",
        rollout=ROLLOUT_CONFIG,
        seed=1,
        precision=PRECISION,
    )
    stubs["rollout"].ConfigureRun(configure_rollout, timeout=120)
    configure_trainer = trainer_pb2.ConfigureRunRequest(
        run_id=RUN,
        model_dir=model,
        seed=0,
        total_steps=5,
        sampling_temperature=1.0,
        algorithm=algorithm_to_proto(AlgorithmSettings(learning_rate=1e-3, micro_batch_size=8)),
        checkpoint_every_steps=1,
        precision=PRECISION,
    )
    stubs["trainer"].ConfigureRun(configure_trainer, timeout=120)
    yield {
        "stubs": stubs,
        "servers": servers,
        "model": model,
        "tmp": tmp,
        "configure_rollout": configure_rollout,
        "configure_trainer": configure_trainer,
    }
    for ch in channels.values():
        ch.close()
    for server in servers.values():
        server.stop(0.5)
    trainer.close()
    rollout.close()
    broker.close()
    client.close()


def _generate_base() -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        run_id=RUN,
        step=1,
        samples_per_prompt=2,
        min_policy_version=0,
        timeout_s=0.05,
        prompts=[rollout_pb2.Prompt(prompt_id="a", text="1+1=", answer="2")],
        sampling=common_pb2.SamplingParams(temperature=1.0, top_k=4, top_p=1.0, max_new_tokens=2, seed=3),
    )


ROLLOUT_STRINGS = {
    "run_id": [RUN],
    "task": ["addition", "no_such_task"],
    "reward": ["addition_exact_match", "no_such_reward"],
    "prompt_id": ["a", "b"],
    "engine_id": [f"{RUN}-engine-0"],
}


@FUZZ
@given(st.data())
def test_rollout_refuses_hostile_requests_with_client_errors(services, data):
    stub = services["stubs"]["rollout"]
    configure = rollout_pb2.ConfigureRolloutRequest()
    configure.CopyFrom(services["configure_rollout"])
    bases = {
        "Generate": (_generate_base(), WAIT_ERRORS),
        # run ids other than RUN get a model directory that does not exist, so nothing is loaded
        "ConfigureRun": (
            rollout_pb2.ConfigureRolloutRequest(
                run_id="fuzz-new",
                model_dir=str(services["tmp"] / "missing"),
                reward="addition_exact_match",
                rollout=ROLLOUT_CONFIG,
                seed=1,
                precision=PRECISION,
            ),
            CLIENT_ERRORS,
        ),
        "ConfigureRunAgain": (configure, CLIENT_ERRORS),
        "GetStatus": (rollout_pb2.GetRolloutStatusRequest(run_id=RUN), CLIENT_ERRORS),
        "DrainEngine": (
            rollout_pb2.DrainEngineRequest(run_id="fuzz-other", engine_id="fuzz-other-engine-0"),
            CLIENT_ERRORS,
        ),
    }
    name = data.draw(st.sampled_from(sorted(bases)), label="method")
    base, allowed = bases[name]
    strings = dict(ROLLOUT_STRINGS)
    if name == "ConfigureRun":
        strings = {**strings, "run_id": ["fuzz-new"], "model_dir": [str(services["tmp"] / "x")]}
    request = data.draw(messages(base.DESCRIPTOR, base, strings), label="request")
    if name == "ConfigureRun" and request.model_dir == services["model"]:
        request.model_dir = str(services["tmp"] / "missing")
    check(stub, name.removesuffix("Again"), request, allowed)


@FUZZ
@given(st.data())
def test_trainer_refuses_hostile_requests_with_client_errors(services, data):
    stub = services["stubs"]["trainer"]
    configure = trainer_pb2.ConfigureRunRequest()
    configure.CopyFrom(services["configure_trainer"])
    configure.model_dir = str(services["tmp"] / "missing")  # never loads a model per example
    configure.run_id = "fuzz-new"
    bases = {
        "ConfigureRun": (configure, CLIENT_ERRORS),
        "TrainStep": (
            trainer_pb2.TrainStepRequest(run_id=RUN, step=1, num_groups=1, timeout_s=0.05),
            WAIT_ERRORS,
        ),
        "PublishWeights": (trainer_pb2.PublishWeightsRequest(run_id=RUN, version=5), CLIENT_ERRORS),
        "Checkpoint": (trainer_pb2.CheckpointRequest(run_id=RUN, directory="relative/dir"), CLIENT_ERRORS),
        "Offload": (trainer_pb2.OffloadRequest(run_id="fuzz-other"), CLIENT_ERRORS),
        "Restore": (trainer_pb2.RestoreRequest(run_id=RUN), CLIENT_ERRORS),
    }
    name = data.draw(st.sampled_from(sorted(bases)), label="method")
    base, allowed = bases[name]
    strings = {
        "run_id": [RUN] if name != "ConfigureRun" else ["fuzz-new"],
        "name": ["grpo", "ppo", "dapo", "gspo"],
        "loss_aggregation": ["token_mean"],
        "kl_estimator": ["k1", "k3"],
        "kl_mode": ["loss", "reward"],
        "off_policy": ["none", "tis", "mis"],
        "directory": ["relative/dir", "", "."],
    }
    request = data.draw(messages(base.DESCRIPTOR, base, strings), label="request")
    if name == "ConfigureRun":
        request.model_dir = str(services["tmp"] / "missing")
    if name == "Checkpoint" and request.directory.startswith("/"):
        request.directory = "relative" + request.directory  # never write outside the test
    check(stub, name, request, allowed)


def test_rollout_and_trainer_serve_after_the_fuzz(services):
    for name, service in (("rollout", ROLLOUT_SERVICE), ("trainer", TRAINER_SERVICE)):
        assert rpc.check_health(f"127.0.0.1:{services['servers'][name].port}", service)
    status = services["stubs"]["rollout"].GetStatus(
        rollout_pb2.GetRolloutStatusRequest(run_id=RUN), timeout=10
    )
    assert [e.engine_id for e in status.engines] == [f"{RUN}-engine-0"]
    restore = trainer_pb2.RestoreRequest(run_id=RUN)  # the fuzz may have offloaded the run
    assert status_of(services["stubs"]["trainer"].Restore, restore) in (
        grpc.StatusCode.OK,
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    taken = services["stubs"]["trainer"].Checkpoint(trainer_pb2.CheckpointRequest(run_id=RUN), timeout=60)
    # the fuzz may have trained steps (valid Generate requests each followed by a valid TrainStep),
    # never more than the run's 5
    assert 0 <= taken.step <= 5
    assert taken.path == str(services["tmp"] / "checkpoints" / RUN / f"step-{taken.step}")
    assert (services["tmp"] / "checkpoints" / RUN / f"step-{taken.step}" / MANIFEST).is_file()
