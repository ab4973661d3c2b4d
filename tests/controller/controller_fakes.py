"""In-process fakes of the services the controller drives, implementing the controller's Protocols
with small deterministic rules, plus gRPC servicers that serve the same fakes over the real wire
contract (so the gRPC clients and a controller process can be tested without models).

Rules: both services start at policy version 0; TrainStep must be the next step and produces
version+1; PublishWeights must publish the trainer's current version and commits it on the broker;
Generate scores reward_mean = step / 10 and draws with min_policy_version.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from furlong import rpc
from furlong.controller.clients import (
    BROKER_SERVICE,
    ROLLOUT_SERVICE,
    TRAINER_SERVICE,
    CheckpointResult,
    GenerateResult,
    GenerationPrompt,
    TrainResult,
    VersionStatus,
)
from furlong.controller.engines import EngineInfo
from furlong.controller.run_spec import AlgorithmSpec, SamplingSpec
from furlong.core.errors import ConflictError, NotFoundError
from furlong.v1 import (
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
    weight_broker_pb2,
    weight_broker_pb2_grpc,
)


@dataclass
class Faults:
    """Exceptions to raise from named methods, and gates that block a method until set."""

    raise_in: dict[str, BaseException] = field(default_factory=dict)
    gates: dict[str, threading.Event] = field(default_factory=dict)
    entered: dict[str, threading.Event] = field(default_factory=dict)

    def hit(self, method: str) -> None:
        self.entered.setdefault(method, threading.Event()).set()
        gate = self.gates.get(method)
        if gate is not None and not gate.wait(30):
            raise TimeoutError(f"gate of {method} never opened")
        if method in self.raise_in:
            raise self.raise_in[method]


class FakeBroker:
    def __init__(self, faults: Faults | None = None) -> None:
        self.faults = faults or Faults()
        self.committed: dict[str, int] = {}
        self.ended: list[str] = []

    def commit(self, run_id: str, version: int) -> None:
        self.committed[run_id] = version

    def wait_committed(self, run_id: str, version: int, wait_s: float) -> VersionStatus:
        self.faults.hit("wait_committed")
        committed = self.committed.get(run_id, -1)
        return VersionStatus(latest_version=committed, committed_version=committed, engine_ids=("engine-0",))

    def end_run(self, run_id: str, timeout_s: float) -> None:
        self.faults.hit("broker.end_run")
        self.ended.append(run_id)


class FakeTrainer:
    def __init__(self, broker: FakeBroker, faults: Faults | None = None) -> None:
        self.broker = broker
        self.faults = faults or Faults()
        self.runs: dict[str, dict] = {}
        self.configured: dict[str, dict] = {}
        self.ended: list[str] = []

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
        self.faults.hit("trainer.configure_run")
        self.runs[run_id] = {
            "model_dir": model_dir,
            "algorithm": algorithm,
            "seed": seed,
            "total_steps": total_steps,
            "temperature": sampling_temperature,
            "step": 0,
            "version": 0,
        }
        self.configured[run_id] = dict(self.runs[run_id])
        return 0

    def _run(self, run_id: str) -> dict:
        if run_id not in self.runs:
            raise NotFoundError(f"trainer has no run {run_id}")
        return self.runs[run_id]

    def train_step(self, run_id: str, step: int, num_groups: int, wait_s: float) -> TrainResult:
        self.faults.hit("train_step")
        run = self._run(run_id)
        if step != run["step"] + 1:
            raise ConflictError(f"step {step} after {run['step']}")
        run["step"], run["version"] = step, run["version"] + 1
        return TrainResult(
            step=step,
            loss=1.0 / step,
            policy_version=run["version"],
            num_samples=num_groups * 2,
            num_groups=num_groups,
            step_seconds=0.001,
            metrics={"grad_norm": 0.5 * step, "clip_fraction": 0.0},
        )

    def publish_weights(self, run_id: str, version: int, timeout_s: float) -> None:
        self.faults.hit("publish_weights")
        run = self._run(run_id)
        if version != run["version"]:
            raise ConflictError(f"publish {version} but trainer is at {run['version']}")
        self.broker.commit(run_id, version)

    def end_run(self, run_id: str, timeout_s: float) -> None:
        self.faults.hit("trainer.end_run")
        self.runs.pop(run_id, None)
        self.ended.append(run_id)

    def checkpoint(self, run_id: str, timeout_s: float) -> CheckpointResult:
        self.faults.hit("trainer.checkpoint")
        run = self._run(run_id)
        return CheckpointResult(
            step=run["step"], path=f"/checkpoints/{run_id}", policy_version=run["version"]
        )


class FakeRollout:
    def __init__(self, faults: Faults | None = None) -> None:
        self.faults = faults or Faults()
        self.configured: dict[str, dict] = {}
        self.generate_calls: list[dict] = []
        self.ended: list[str] = []

    def configure_run(
        self, run_id: str, model_dir: str, reward: str, num_engines: int, seed: int, timeout_s: float
    ) -> int:
        self.faults.hit("rollout.configure_run")
        self.configured[run_id] = {
            "model_dir": model_dir,
            "reward": reward,
            "num_engines": num_engines,
            "seed": seed,
        }
        return 0

    def generate(
        self,
        run_id,
        step,
        prompts,
        samples_per_prompt,
        sampling: SamplingSpec,
        sampling_seed,
        min_policy_version,
        wait_s,
        max_refill_rounds=0,
        keep_groups=0,
    ) -> GenerateResult:
        self.faults.hit("generate")
        if run_id not in self.configured:
            raise NotFoundError(f"rollout has no run {run_id}")
        self.generate_calls.append(
            {
                "step": step,
                "prompt_ids": [p.prompt_id for p in prompts],
                "samples_per_prompt": samples_per_prompt,
                "sampling": sampling,
                "seed": sampling_seed,
                "min_policy_version": min_policy_version,
                "max_refill_rounds": max_refill_rounds,
                "keep_groups": keep_groups,
            }
        )
        groups = min(keep_groups, len(prompts)) if keep_groups else len(prompts)
        n = groups * samples_per_prompt
        return GenerateResult(
            num_groups=groups,
            num_samples=n,
            reward_mean=step / 10,
            policy_version=min_policy_version,
            num_tokens=3 * n,
            generate_seconds=0.001,
        )

    def end_run(self, run_id: str, timeout_s: float) -> None:
        self.faults.hit("rollout.end_run")
        self.ended.append(run_id)


class FakePrompts:
    """Task "addition" (reward "addition_exact_match"); any other task is unknown."""

    def reward_name(self, task: str) -> str:
        if task != "addition":
            raise ValueError(f"unknown task {task!r}")
        return "addition_exact_match"

    def prompts(self, task: str, seed: int, step: int, count: int) -> list[GenerationPrompt]:
        self.reward_name(task)
        return [
            GenerationPrompt(prompt_id=f"s{seed}-t{step}-{i}", text=f"{i}+{step}=", answer=str(i + step))
            for i in range(count)
        ]


class FakeEngines:
    """Engine status as rollout would report it: the engines of every configured run."""

    def __init__(self, rollout: FakeRollout, per_run: int = 2) -> None:
        self._rollout = rollout
        self._per_run = per_run
        self.drained: set[str] = set()

    def engines(self, run_id: str, timeout_s: float) -> list[EngineInfo]:
        if run_id not in self._rollout.configured:
            raise NotFoundError(f"rollout: unknown run {run_id!r}")
        return [
            EngineInfo(
                engine_id=f"{run_id}-engine-{i}",
                policy_version=0,
                healthy=True,
                state="drained" if f"{run_id}-engine-{i}" in self.drained else "serving",
            )
            for i in range(self._per_run)
        ]

    def drain(self, run_id: str, engine_id: str, timeout_s: float) -> EngineInfo:
        found = [e for e in self.engines(run_id, timeout_s) if e.engine_id == engine_id]
        if not found:
            raise NotFoundError(f"rollout: run {run_id!r} has no engine {engine_id!r}")
        self.drained.add(engine_id)
        return self.engines(run_id, timeout_s)[int(engine_id.rsplit("-", 1)[1])]


@dataclass
class FakeStack:
    trainer: FakeTrainer
    rollout: FakeRollout
    broker: FakeBroker
    prompts: FakePrompts
    faults: Faults


def fake_stack() -> FakeStack:
    faults = Faults()
    broker = FakeBroker(faults)
    return FakeStack(
        trainer=FakeTrainer(broker, faults),
        rollout=FakeRollout(faults),
        broker=broker,
        prompts=FakePrompts(),
        faults=faults,
    )


# ---- the same fakes behind the real gRPC contract -------------------------------------------


class _TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, fake: FakeTrainer) -> None:
        self.fake = fake

    @rpc.rpc_errors
    def ConfigureRun(self, request, context):
        a = request.algorithm
        algo = AlgorithmSpec(
            name=a.name,
            learning_rate=a.learning_rate,
            clip_eps=a.clip_eps,
            weight_decay=a.weight_decay,
            max_grad_norm=a.max_grad_norm,
            epochs_per_batch=a.epochs_per_batch,
            micro_batch_size=a.micro_batch_size,
            adam_beta1=a.adam_beta1,
            adam_beta2=a.adam_beta2,
        )
        version = self.fake.configure_run(
            request.run_id,
            request.model_dir,
            algo,
            request.seed,
            request.total_steps,
            request.sampling_temperature,
            1.0,
        )
        return trainer_pb2.ConfigureRunResponse(run_id=request.run_id, policy_version=version)

    @rpc.rpc_errors
    def TrainStep(self, request, context):
        r = self.fake.train_step(request.run_id, request.step, request.num_groups, request.timeout_s)
        return trainer_pb2.TrainStepResponse(
            run_id=request.run_id,
            step=r.step,
            loss=r.loss,
            policy_version=r.policy_version,
            num_samples=r.num_samples,
            num_groups=r.num_groups,
            step_seconds=r.step_seconds,
            metrics=r.metrics,
        )

    @rpc.rpc_errors
    def PublishWeights(self, request, context):
        self.fake.publish_weights(request.run_id, request.version, 1.0)
        return trainer_pb2.PublishWeightsResponse(run_id=request.run_id, version=request.version)

    @rpc.rpc_errors
    def EndRun(self, request, context):
        self.fake.end_run(request.run_id, 1.0)
        return trainer_pb2.EndRunResponse(run_id=request.run_id)

    @rpc.rpc_errors
    def Checkpoint(self, request, context):
        r = self.fake.checkpoint(request.run_id, 1.0)
        return trainer_pb2.CheckpointResponse(
            run_id=request.run_id, path=r.path, step=r.step, policy_version=r.policy_version
        )


class _RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, fake: FakeRollout) -> None:
        self.fake = fake

    @rpc.rpc_errors
    def ConfigureRun(self, request, context):
        version = self.fake.configure_run(
            request.run_id, request.model_dir, request.reward, request.num_engines, request.seed, 1.0
        )
        return rollout_pb2.ConfigureRolloutResponse(
            run_id=request.run_id, policy_version=version, engine_ids=["engine-0"]
        )

    @rpc.rpc_errors
    def Generate(self, request, context):
        s = request.sampling
        sampling = SamplingSpec(
            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, max_new_tokens=s.max_new_tokens
        )
        prompts = [GenerationPrompt(p.prompt_id, p.text, p.answer) for p in request.prompts]
        r = self.fake.generate(
            request.run_id,
            request.step,
            prompts,
            request.samples_per_prompt,
            sampling,
            s.seed,
            request.min_policy_version,
            request.timeout_s,
        )
        return rollout_pb2.GenerateResponse(
            run_id=request.run_id,
            step=request.step,
            num_groups=r.num_groups,
            num_samples=r.num_samples,
            reward_mean=r.reward_mean,
            policy_version=r.policy_version,
            num_tokens=r.num_tokens,
            generate_seconds=r.generate_seconds,
        )

    @rpc.rpc_errors
    def EndRun(self, request, context):
        self.fake.end_run(request.run_id, 1.0)
        return rollout_pb2.EndRolloutResponse(run_id=request.run_id)


class _BrokerServicer(weight_broker_pb2_grpc.WeightBrokerServicer):
    def __init__(self, fake: FakeBroker) -> None:
        self.fake = fake

    @rpc.rpc_errors
    def WaitCommitted(self, request, context):
        s = self.fake.wait_committed(request.run_id, request.version, request.timeout_s)
        return weight_broker_pb2.VersionStatus(
            run_id=request.run_id,
            latest_version=s.latest_version,
            committed_version=s.committed_version,
            engine_ids=list(s.engine_ids),
        )

    @rpc.rpc_errors
    def EndRun(self, request, context):
        self.fake.end_run(request.run_id, 1.0)
        return weight_broker_pb2.EndRunBrokerResponse(run_id=request.run_id)


@dataclass
class FakeGrpcServices:
    stack: FakeStack
    servers: dict[str, rpc.RunningServer]

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.servers[name].port}"

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop(0.5)


def serve_fakes(stack: FakeStack) -> FakeGrpcServices:
    """Each fake on its own gRPC server on 127.0.0.1 with grpc.health.v1, like the real services."""

    def one(add, service_name):
        return rpc.start_server([add], [service_name])

    servers = {
        "trainer": one(
            lambda s: trainer_pb2_grpc.add_TrainerServicer_to_server(_TrainerServicer(stack.trainer), s),
            TRAINER_SERVICE,
        ),
        "rollout": one(
            lambda s: rollout_pb2_grpc.add_RolloutServicer_to_server(_RolloutServicer(stack.rollout), s),
            ROLLOUT_SERVICE,
        ),
        "broker": one(
            lambda s: weight_broker_pb2_grpc.add_WeightBrokerServicer_to_server(
                _BrokerServicer(stack.broker), s
            ),
            BROKER_SERVICE,
        ),
    }
    return FakeGrpcServices(stack=stack, servers=servers)


__all__ = [
    "Faults",
    "FakeBroker",
    "FakeTrainer",
    "FakeRollout",
    "FakePrompts",
    "FakeStack",
    "fake_stack",
    "serve_fakes",
    "FakeGrpcServices",
]
