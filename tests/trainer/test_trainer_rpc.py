"""Offload, Restore, Checkpoint and ExportPolicy over real gRPC: the trainer service behind a
loopback gRPC server, samples from the rollout service in a real Redis stream, weights published
through the broker."""

import hashlib
from pathlib import Path

import grpc
import pytest
import redis
import torch
from tiny_policy import addition_prompts, rollout_run, trainer_run, write_tiny_checkpoint

from furlong import rpc
from furlong.core.checkpoint import load_policy
from furlong.core.samples import STREAM_FIELD, SampleGroup, stream_key
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.service import RolloutService
from furlong.rollout.core.types import GenerateRequest
from furlong.rollout.receivers import broker_receiver_factory
from furlong.rollout.rewards import FORMAT_INTEGER
from furlong.rollout.run_records import redis_records
from furlong.trainer.api import TrainerRunConfig
from furlong.trainer.convert import config_to_proto
from furlong.trainer.core.learner import Learner, LearnerConfig
from furlong.trainer.run_learner import DEFAULT_MICRO_BATCH_TOKENS
from furlong.trainer.server import SERVICE_NAME, register
from furlong.trainer.service import TrainerService
from furlong.trainer.train_checkpoint import load_training_checkpoint
from furlong.v1 import trainer_pb2, trainer_pb2_grpc
from furlong.weight_broker.client import InProcessBrokerClient
from furlong.weight_broker.core import BrokerCore

pytestmark = [pytest.mark.integration]


class Stack:
    """Trainer service behind a gRPC server on 127.0.0.1, rollout and broker in process."""

    def __init__(
        self, tmp: Path, redis_url: str, checkpoint_root: Path | None, policy_root: Path | None = None
    ):
        self.model_dir = write_tiny_checkpoint(tmp / "model")
        self.redis = redis.Redis.from_url(redis_url)
        self.broker = InProcessBrokerClient(BrokerCore())
        self.rollout = RolloutService(redis_records(self.redis), broker_receiver_factory(self.broker))
        self.service = TrainerService(
            self.redis,
            self.broker,
            consumer_name="trainer-0",
            checkpoint_root=checkpoint_root,
            policy_root=policy_root,
        )
        self.server = rpc.start_server([register(self.service)], [SERVICE_NAME])
        self.channel = rpc.channel(f"127.0.0.1:{self.server.port}")
        self.stub = trainer_pb2_grpc.TrainerStub(self.channel)

    def configure(self, run_id: str, kl_coef: float = 0.0) -> TrainerRunConfig:
        self.rollout.configure_run(rollout_run(run_id, self.model_dir, reward=FORMAT_INTEGER))
        config = trainer_run(
            run_id, self.model_dir, 5, learning_rate=1e-2, micro_batch_size=8, kl_coef=kl_coef
        )
        assert self.stub.ConfigureRun(config_to_proto(config), timeout=60).policy_version == 0
        return config

    def generate(self, run_id: str, step: int) -> None:
        self.rollout.generate(
            GenerateRequest(
                run_id=run_id,
                step=step,
                samples_per_prompt=4,
                sampling=SamplingConfig(temperature=1.0, max_new_tokens=6, seed=step),
                min_policy_version=step - 1,
                timeout_s=60,
                prompts=addition_prompts(step, 4),
            )
        )

    def train(self, run_id: str, step: int) -> trainer_pb2.TrainStepResponse:
        self.generate(run_id, step)
        return self.stub.TrainStep(
            trainer_pb2.TrainStepRequest(run_id=run_id, step=step, num_groups=4, timeout_s=30), timeout=60
        )

    def close(self) -> None:
        self.channel.close()
        self.server.stop()
        self.service.close()
        self.rollout.close()
        self.broker.close()


@pytest.fixture
def stack(tmp_path, redis_url):
    s = Stack(tmp_path, redis_url, checkpoint_root=None)
    yield s
    s.close()


def _code(call, request) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=30)
    return info.value.code()


def _digests(learner: Learner) -> dict[str, str]:
    """SHA-256 of every parameter and buffer (policy and frozen reference) and optimizer tensor."""
    out = {}
    models = {"policy": learner.model, "reference": learner.reference}
    for prefix, model in models.items():
        if model is None:
            continue
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            out[f"{prefix}.{name}"] = hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()
    for index, state in enumerate(learner.optimizer.state.values()):
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"optim.{index}.{name}"] = hashlib.sha256(
                    value.contiguous().numpy().tobytes()
                ).hexdigest()
    return out


def test_offload_restore_keeps_every_tensor_and_training_resumes(stack, tmp_path):
    run = "run-off"
    request = stack.configure(run, kl_coef=0.05)  # a frozen reference model is offloaded too
    first = stack.train(run, 1)
    assert first.policy_version == 1 and first.metrics["num_trained_samples"] > 0
    stack.stub.PublishWeights(trainer_pb2.PublishWeightsRequest(run_id=run, version=1), timeout=60)
    assert stack.broker.wait_committed(run, 1, 60).committed_version == 1
    learner = stack.service._run(run).learner
    assert learner.optimizer.state, "step 1 must have created Adam state"
    before = _digests(learner)
    assert any(k.startswith("reference.") for k in before) and any(k.startswith("optim.") for k in before)
    snapshot = stack.stub.Checkpoint(
        trainer_pb2.CheckpointRequest(run_id=run, directory=str(tmp_path / "snap")), timeout=60
    )
    assert (snapshot.step, snapshot.policy_version) == (1, 1)

    for _ in range(2):
        off = stack.stub.Offload(trainer_pb2.OffloadRequest(run_id=run), timeout=30)
        assert (
            off.released_bytes > 0
            and off.num_tensors
            == len(list(learner.model.parameters())) * 2 + len(list(learner.model.buffers())) * 2
        )
        assert all(p.numel() == 0 for p in learner.model.parameters())
        assert all(
            v.numel() == 0
            for s in learner.optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )
        # Offloaded: these are refused, not run on empty tensors.
        assert (
            _code(stack.stub.Offload, trainer_pb2.OffloadRequest(run_id=run))
            == grpc.StatusCode.FAILED_PRECONDITION
        )
        assert (
            _code(
                stack.stub.TrainStep,
                trainer_pb2.TrainStepRequest(run_id=run, step=2, num_groups=4, timeout_s=1),
            )
            == grpc.StatusCode.FAILED_PRECONDITION
        )
        assert (
            _code(stack.stub.PublishWeights, trainer_pb2.PublishWeightsRequest(run_id=run, version=2))
            == grpc.StatusCode.FAILED_PRECONDITION
        )
        assert (
            _code(
                stack.stub.Checkpoint,
                trainer_pb2.CheckpointRequest(run_id=run, directory=str(tmp_path / "x")),
            )
            == grpc.StatusCode.FAILED_PRECONDITION
        )
        restored = stack.stub.Restore(trainer_pb2.RestoreRequest(run_id=run), timeout=30)
        assert restored.policy_version == 1
        assert _digests(learner) == before
    assert (
        _code(stack.stub.Restore, trainer_pb2.RestoreRequest(run_id=run))
        == grpc.StatusCode.FAILED_PRECONDITION
    )

    # Training after restore is the training the run would have done without offloading: a twin
    # learner resumed from the pre-offload checkpoint, trained on the same groups, matches bit for bit.
    second = stack.train(run, 2)
    assert second.policy_version == 2
    stack.stub.PublishWeights(trainer_pb2.PublishWeightsRequest(run_id=run, version=2), timeout=60)
    assert stack.broker.wait_committed(run, 2, 60).committed_version == 2
    model, _ = load_policy(stack.model_dir)
    twin = Learner(  # with the service's memory settings: the same micro-batches, bit for bit
        model,
        LearnerConfig(
            request.algorithm,
            request.sampling_temperature,
            request.seed,
            micro_batch_tokens=DEFAULT_MICRO_BATCH_TOKENS,
        ),
    )
    load_training_checkpoint(twin, snapshot.path)
    entry_ids = stack.service._run(run).data_cursor["entry_ids"]
    groups = [
        SampleGroup.decode(stack.redis.xrange(stream_key(run), e, e)[0][1][STREAM_FIELD]) for e in entry_ids
    ]
    twin_stats = twin.train_step(groups)
    assert twin_stats.loss == second.loss
    for (name, a), b in zip(learner.model.state_dict().items(), twin.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_checkpoint_errors_name_the_problem(stack):
    stack.configure("run-ck")
    not_found = _code(stack.stub.Checkpoint, trainer_pb2.CheckpointRequest(run_id="nope", directory="/tmp/x"))
    assert not_found == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as info:
        stack.stub.Checkpoint(trainer_pb2.CheckpointRequest(run_id="run-ck"), timeout=30)
    assert (
        info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        and "--checkpoint-dir" in info.value.details()
    )
    with pytest.raises(grpc.RpcError) as info:
        stack.stub.Checkpoint(trainer_pb2.CheckpointRequest(run_id="run-ck", directory="rel/dir"), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'rel/dir'" in info.value.details()
    for call, request in (
        (stack.stub.Offload, trainer_pb2.OffloadRequest(run_id="nope")),
        (stack.stub.Restore, trainer_pb2.RestoreRequest(run_id="nope")),
    ):
        assert _code(call, request) == grpc.StatusCode.NOT_FOUND


def test_checkpoint_rpc_writes_the_resumable_checkpoint(tmp_path, redis_url):
    root = tmp_path / "ckpt-root"
    s = Stack(tmp_path, redis_url, checkpoint_root=root)
    try:
        request = s.configure("run-rs")
        # Before any step: a checkpoint of the initial state at step 0.
        initial = s.stub.Checkpoint(trainer_pb2.CheckpointRequest(run_id="run-rs"), timeout=60)
        assert (Path(initial.path), initial.step, initial.policy_version) == (
            root / "run-rs" / "step-0",
            0,
            0,
        )
        s.train("run-rs", 1)
        info = s.stub.Checkpoint(trainer_pb2.CheckpointRequest(run_id="run-rs"), timeout=60)
        assert (Path(info.path), info.step, info.policy_version) == (root / "run-rs" / "step-1", 1, 1)
        trained = {k: v.clone() for k, v in s.service._run("run-rs").learner.model.state_dict().items()}
        s.stub.EndRun(trainer_pb2.EndRunRequest(run_id="run-rs"), timeout=30)
        # ConfigureRun resumes from what Checkpoint wrote; the next step is 2.
        assert s.stub.ConfigureRun(config_to_proto(request), timeout=60).policy_version == 1
        for name, tensor in s.service._run("run-rs").learner.model.state_dict().items():
            assert torch.equal(tensor, trained[name]), name
        assert (
            _code(
                s.stub.TrainStep,
                trainer_pb2.TrainStepRequest(run_id="run-rs", step=1, num_groups=4, timeout_s=1),
            )
            == grpc.StatusCode.FAILED_PRECONDITION
        )
    finally:
        s.close()


def test_export_policy_writes_the_trained_policy_as_a_hugging_face_directory(tmp_path, redis_url):
    from transformers import AutoModelForCausalLM

    stack = Stack(tmp_path, redis_url, checkpoint_root=None, policy_root=tmp_path / "policies")
    try:
        run = "run-export"
        stack.configure(run)
        before = stack.stub.ExportPolicy(
            trainer_pb2.ExportPolicyRequest(run_id=run, max_shard_bytes=4096), timeout=60
        )
        assert (before.step, before.policy_version, before.final) == (0, 0, False)
        assert before.path == str(tmp_path / "policies" / run / "checkpoints" / "step-0")
        assert stack.train(run, 1).policy_version == 1
        exported = stack.stub.ExportPolicy(
            trainer_pb2.ExportPolicyRequest(run_id=run, max_shard_bytes=4096), timeout=60
        )
        assert exported.path == str(tmp_path / "policies" / run / "checkpoints" / "step-1")
        assert (exported.step, exported.policy_version) == (1, 1) and len(exported.shards) >= 3
        out = Path(exported.path)
        assert {p.name for p in out.iterdir()} >= {
            "config.json",
            "generation_config.json",
            "model.safetensors.index.json",
            "tokenizer.json",
            "tokenizer_config.json",
            *exported.shards,
        }
        learner = stack.service._run(run).learner
        ids = torch.tensor([[1, 4, 5, 13, 6, 7, 14]])
        hf = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
        initial, _ = load_policy(stack.model_dir)
        with torch.no_grad():
            trained = learner.model(input_ids=ids).logits
            assert torch.equal(hf(input_ids=ids).logits, trained)  # the trainer's weights, bit for bit
            assert not torch.equal(initial(input_ids=ids).logits, trained)  # and they did change
        named = tmp_path / "named" / "policy"
        reply = stack.stub.ExportPolicy(
            trainer_pb2.ExportPolicyRequest(run_id=run, directory=str(named), max_shard_bytes=1 << 30),
            timeout=60,
        )
        assert reply.path == str(named) and list(reply.shards) == ["model.safetensors"]
        for request, code in [
            (trainer_pb2.ExportPolicyRequest(run_id="nope", max_shard_bytes=4096), grpc.StatusCode.NOT_FOUND),
            (
                trainer_pb2.ExportPolicyRequest(run_id=run, directory="rel/dir", max_shard_bytes=4096),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            (trainer_pb2.ExportPolicyRequest(run_id=run), grpc.StatusCode.INVALID_ARGUMENT),  # no shard size
        ]:
            assert _code(stack.stub.ExportPolicy, request) == code
        stack.stub.Offload(trainer_pb2.OffloadRequest(run_id=run), timeout=30)
        offloaded = trainer_pb2.ExportPolicyRequest(run_id=run, max_shard_bytes=4096)
        assert _code(stack.stub.ExportPolicy, offloaded) == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        stack.close()


def test_export_without_a_policy_dir_needs_a_directory(stack):
    stack.configure("run-nodir")
    request = trainer_pb2.ExportPolicyRequest(run_id="run-nodir", max_shard_bytes=4096)
    with pytest.raises(grpc.RpcError) as info:
        stack.stub.ExportPolicy(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no --policy-dir" in info.value.details()
