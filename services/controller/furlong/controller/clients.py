"""The controller's view of the services it drives: small Protocols, the domain values they return,
and gRPC implementations.

The run driver only sees the Protocols, so tests drive it with in-process fakes. Every method takes
the deadline of its call; a method whose request carries a server-side wait (`timeout_s` in the
proto) sends `wait_s` and gets a deadline `RPC_MARGIN_S` longer, so the server's own timeout
answers first. Failures arrive as domain errors (`furlong.rpc.call`). Knows nothing about runs'
states or Redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from furlong import rpc
from furlong.controller.run_spec import AlgorithmSpec, SamplingSpec
from furlong.v1 import (
    common_pb2,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
    weight_broker_pb2,
    weight_broker_pb2_grpc,
)

RPC_MARGIN_S = 10.0

TRAINER_SERVICE = "furlong.v1.Trainer"
ROLLOUT_SERVICE = "furlong.v1.Rollout"
BROKER_SERVICE = "furlong.v1.WeightBroker"


@dataclass(frozen=True)
class GenerationPrompt:
    prompt_id: str
    text: str
    answer: str


@dataclass(frozen=True)
class GenerateResult:
    num_groups: int
    num_samples: int
    reward_mean: float
    policy_version: int  # the version the samples were drawn with
    num_tokens: int
    generate_seconds: float


@dataclass(frozen=True)
class TrainResult:
    step: int
    loss: float
    policy_version: int  # produced by this step, not yet published
    num_samples: int
    num_groups: int
    step_seconds: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointResult:
    step: int  # the last completed step the checkpoint holds (0 = none yet)
    path: str  # the directory the trainer wrote, as the trainer sees it
    policy_version: int


@dataclass(frozen=True)
class VersionStatus:
    latest_version: int  # -1 = none begun
    committed_version: int  # -1 = none committed
    engine_ids: tuple[str, ...] = ()
    pending_engine_ids: tuple[str, ...] = ()


class TrainerClient(Protocol):
    """The trainer as the controller uses it. Calls are blocking and thread-compatible (one run
    drives one client at a time); each raises a domain error on failure."""

    def configure_run(
        self,
        run_id: str,
        model_dir: str,
        algorithm: AlgorithmSpec,
        seed: int,
        total_steps: int,
        sampling_temperature: float,
        timeout_s: float,
    ) -> int:
        """Load the policy for run_id; returns the policy version it starts from (0 = checkpoint).
        sampling_temperature is the rollout's: the trainer scores log-probs under it."""

    def train_step(self, run_id: str, step: int, num_groups: int, wait_s: float) -> TrainResult:
        """Train on num_groups groups from the run's stream, waiting up to wait_s for them."""

    def publish_weights(self, run_id: str, version: int, timeout_s: float) -> None:
        """Stage version (the trainer's current one) and announce it to the broker."""

    def end_run(self, run_id: str, timeout_s: float) -> None:
        """Release the run's resources; idempotent."""

    def checkpoint(self, run_id: str, timeout_s: float) -> CheckpointResult:
        """Write the run's training state after its last completed step to the trainer's
        checkpoint location for the run (waits for a step in progress). May be called from
        another thread than the one driving the run. ConflictError when the trainer cannot
        (offloaded run, no checkpoint directory), NotFoundError when it has no such run."""


class RolloutClient(Protocol):
    """The rollout service as the controller uses it; same obligations as TrainerClient."""

    def configure_run(
        self, run_id: str, model_dir: str, reward: str, num_engines: int, seed: int, timeout_s: float
    ) -> int:
        """Start the run's engines; returns the policy version they serve."""

    def generate(
        self,
        run_id: str,
        step: int,
        prompts: Sequence[GenerationPrompt],
        samples_per_prompt: int,
        sampling: SamplingSpec,
        sampling_seed: int,
        min_policy_version: int,
        wait_s: float,
        max_refill_rounds: int = 0,
        keep_groups: int = 0,
    ) -> GenerateResult:
        """Generate and score one group per prompt and write the groups to the run's stream.
        max_refill_rounds > 0: dynamic sampling (equal-reward groups drawn again, then dropped);
        keep_groups > 0: over-sampling (only the first keep_groups groups to complete are written)."""

    def end_run(self, run_id: str, timeout_s: float) -> None:
        """Stop the run's engines; idempotent."""


class BrokerClient(Protocol):
    """The weight broker as the controller uses it; same obligations as TrainerClient."""

    def wait_committed(self, run_id: str, version: int, wait_s: float) -> VersionStatus:
        """Block until version is committed (every engine serves it); TimeoutError after wait_s."""

    def end_run(self, run_id: str, timeout_s: float) -> None:
        """Forget the run's versions; idempotent."""


class GrpcTrainerClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = rpc.channel(address)
        self._stub = trainer_pb2_grpc.TrainerStub(self._channel)

    def configure_run(
        self,
        run_id: str,
        model_dir: str,
        algorithm: AlgorithmSpec,
        seed: int,
        total_steps: int,
        sampling_temperature: float,
        timeout_s: float,
    ) -> int:
        algo = trainer_pb2.AlgorithmConfig(
            name=algorithm.name,
            learning_rate=algorithm.learning_rate,
            clip_eps=algorithm.clip_eps,
            weight_decay=algorithm.weight_decay,
            max_grad_norm=algorithm.max_grad_norm,
            epochs_per_batch=algorithm.epochs_per_batch,
            micro_batch_size=algorithm.micro_batch_size,
            adam_beta1=algorithm.adam_beta1,
            adam_beta2=algorithm.adam_beta2,
            clip_eps_high=algorithm.clip_eps_high,
            loss_aggregation=algorithm.loss_aggregation,
            kl_coef=algorithm.kl_coef,
            kl_estimator=algorithm.kl_estimator,
            kl_mode=algorithm.kl_mode,
            entropy_coef=algorithm.entropy_coef,
            off_policy=algorithm.off_policy,
            is_low=algorithm.is_low,
            is_high=algorithm.is_high,
            gamma=algorithm.gamma,
            gae_lambda=algorithm.gae_lambda,
            value_coef=algorithm.value_coef,
            value_clip=algorithm.value_clip,
        )
        request = trainer_pb2.ConfigureRunRequest(
            run_id=run_id,
            model_dir=model_dir,
            algorithm=algo,
            seed=seed,
            total_steps=total_steps,
            sampling_temperature=sampling_temperature,
        )
        return rpc.call(self._stub.ConfigureRun, request, timeout_s).policy_version

    def train_step(self, run_id: str, step: int, num_groups: int, wait_s: float) -> TrainResult:
        request = trainer_pb2.TrainStepRequest(
            run_id=run_id, step=step, num_groups=num_groups, timeout_s=wait_s
        )
        resp = rpc.call(self._stub.TrainStep, request, wait_s + RPC_MARGIN_S)
        return TrainResult(
            step=resp.step,
            loss=resp.loss,
            policy_version=resp.policy_version,
            num_samples=resp.num_samples,
            num_groups=resp.num_groups,
            step_seconds=resp.step_seconds,
            metrics=dict(resp.metrics),
        )

    def publish_weights(self, run_id: str, version: int, timeout_s: float) -> None:
        rpc.call(
            self._stub.PublishWeights,
            trainer_pb2.PublishWeightsRequest(run_id=run_id, version=version),
            timeout_s,
        )

    def end_run(self, run_id: str, timeout_s: float) -> None:
        rpc.call(self._stub.EndRun, trainer_pb2.EndRunRequest(run_id=run_id), timeout_s)

    def checkpoint(self, run_id: str, timeout_s: float) -> CheckpointResult:
        # directory "" = the trainer's own --checkpoint-dir location, the one a restart resumes from
        resp = rpc.call(self._stub.Checkpoint, trainer_pb2.CheckpointRequest(run_id=run_id), timeout_s)
        return CheckpointResult(step=resp.step, path=resp.path, policy_version=resp.policy_version)

    def close(self) -> None:
        self._channel.close()


class GrpcRolloutClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = rpc.channel(address)
        self._stub = rollout_pb2_grpc.RolloutStub(self._channel)

    def configure_run(
        self, run_id: str, model_dir: str, reward: str, num_engines: int, seed: int, timeout_s: float
    ) -> int:
        request = rollout_pb2.ConfigureRolloutRequest(
            run_id=run_id, model_dir=model_dir, reward=reward, num_engines=num_engines, seed=seed
        )
        return rpc.call(self._stub.ConfigureRun, request, timeout_s).policy_version

    def generate(
        self,
        run_id: str,
        step: int,
        prompts: Sequence[GenerationPrompt],
        samples_per_prompt: int,
        sampling: SamplingSpec,
        sampling_seed: int,
        min_policy_version: int,
        wait_s: float,
        max_refill_rounds: int = 0,
        keep_groups: int = 0,
    ) -> GenerateResult:
        params = common_pb2.SamplingParams(
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            max_new_tokens=sampling.max_new_tokens,
            seed=sampling_seed,
            stop=list(sampling.stop),
        )
        request = rollout_pb2.GenerateRequest(
            run_id=run_id,
            step=step,
            samples_per_prompt=samples_per_prompt,
            sampling=params,
            min_policy_version=min_policy_version,
            timeout_s=wait_s,
            max_refill_rounds=max_refill_rounds,
            keep_groups=keep_groups,
            prompts=[
                rollout_pb2.Prompt(prompt_id=p.prompt_id, text=p.text, answer=p.answer) for p in prompts
            ],
        )
        resp = rpc.call(self._stub.Generate, request, wait_s + RPC_MARGIN_S)
        return GenerateResult(
            num_groups=resp.num_groups,
            num_samples=resp.num_samples,
            reward_mean=resp.reward_mean,
            policy_version=resp.policy_version,
            num_tokens=resp.num_tokens,
            generate_seconds=resp.generate_seconds,
        )

    def end_run(self, run_id: str, timeout_s: float) -> None:
        rpc.call(self._stub.EndRun, rollout_pb2.EndRolloutRequest(run_id=run_id), timeout_s)

    def close(self) -> None:
        self._channel.close()


class GrpcBrokerClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = rpc.channel(address)
        self._stub = weight_broker_pb2_grpc.WeightBrokerStub(self._channel)

    def wait_committed(self, run_id: str, version: int, wait_s: float) -> VersionStatus:
        request = weight_broker_pb2.WaitCommittedRequest(run_id=run_id, version=version, timeout_s=wait_s)
        resp = rpc.call(self._stub.WaitCommitted, request, wait_s + RPC_MARGIN_S)
        return VersionStatus(
            latest_version=resp.latest_version,
            committed_version=resp.committed_version,
            engine_ids=tuple(resp.engine_ids),
            pending_engine_ids=tuple(resp.pending_engine_ids),
        )

    def end_run(self, run_id: str, timeout_s: float) -> None:
        rpc.call(self._stub.EndRun, weight_broker_pb2.EndRunBrokerRequest(run_id=run_id), timeout_s)

    def close(self) -> None:
        self._channel.close()
