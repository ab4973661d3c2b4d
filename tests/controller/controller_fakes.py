"""Fakes of the services the controller drives, with small deterministic rules. Each fake has the
interface of the service object behind the real transport (TrainerService, RolloutService, the
broker core), so the same fake is used in process (as the controller's client, like the in-process
twins) and behind the services' real gRPC servicers (so the gRPC clients and a controller process
are tested without models).

Rules: both services start at policy version 0; TrainStep must be the next step and produces
version+1; PublishWeights must publish the trainer's current version and commits it on the broker;
Generate writes num_groups groups (or every explicit prompt), scores reward_mean = step / 10 and
draws with min_policy_version; rollout reports `engines_per_run` engines per configured run;
ExportPolicy writes a directory holding `policy.txt` ("<run> step <N>") at
`<policy_root>/<run>/final` after the run's last step, else `<policy_root>/<run>/checkpoints/step-<N>`
(policy_root: a fresh temporary directory), and records each export in `exports`.
"""

from __future__ import annotations

import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from furlong import rpc
from furlong.controller.services import BROKER_SERVICE, ROLLOUT_SERVICE, TRAINER_SERVICE, Services
from furlong.core.errors import ConflictError, NotFoundError
from furlong.core.weight_versions import VersionStatusInfo
from furlong.rollout.core.types import (
    EngineState,
    EngineStatus,
    EvalGroup,
    EvaluateRequest,
    EvaluateResult,
    GenerateRequest,
    GenerateResult,
    RolloutRunConfig,
    RunInfo,
    RunStatus,
)
from furlong.rollout.server import RolloutServicer
from furlong.trainer.api import (
    CheckpointResult,
    Offloaded,
    PolicyExport,
    Published,
    TrainerRun,
    TrainerRunConfig,
    TrainStepRequest,
    TrainStepResult,
)
from furlong.trainer.server import register as register_trainer
from furlong.v1 import weight_broker_pb2_grpc
from furlong.weight_broker.server import WeightBrokerServicer


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

    def wait_committed(self, run_id: str, version: int, timeout_s: float) -> VersionStatusInfo:
        self.faults.hit("wait_committed")
        committed = self.committed.get(run_id, -1)
        return VersionStatusInfo(
            run_id=run_id,
            latest_version=committed,
            committed_version=committed,
            engine_ids=("engine-0",),
            pending_engine_ids=(),
        )

    def end_run(self, run_id: str) -> None:
        self.faults.hit("broker.end_run")
        self.ended.append(run_id)

    def close(self) -> None:
        pass


class FakeTrainer:
    def __init__(self, broker: FakeBroker, faults: Faults | None = None) -> None:
        self.broker = broker
        self.faults = faults or Faults()
        self.runs: dict[str, dict] = {}
        self.configured: dict[str, TrainerRunConfig] = {}
        self.ended: list[str] = []
        self.exports: list[PolicyExport] = []
        self.checkpoints_deleted: list[str] = []
        self.policy_root = Path(tempfile.mkdtemp(prefix="fake-policies-"))

    def configure_run(self, config: TrainerRunConfig) -> TrainerRun:
        self.faults.hit("trainer.configure_run")
        self.runs[config.run_id] = {"step": 0, "version": 0, "total": config.total_steps}
        self.configured[config.run_id] = config
        return TrainerRun(run_id=config.run_id, policy_version=0, num_parameters=1)

    def _run(self, run_id: str) -> dict:
        if run_id not in self.runs:
            raise NotFoundError(f"trainer has no run {run_id}")
        return self.runs[run_id]

    def train_step(self, request: TrainStepRequest) -> TrainStepResult:
        self.faults.hit("train_step")
        run = self._run(request.run_id)
        step = request.step
        if step != run["step"] + 1:
            raise ConflictError(f"step {step} after {run['step']}")
        run["step"], run["version"] = step, run["version"] + 1
        return TrainStepResult(
            run_id=request.run_id,
            step=step,
            loss=1.0 / step,
            policy_version=run["version"],
            num_samples=request.num_groups * 2,
            num_groups=request.num_groups,
            step_seconds=0.001,
            metrics={"grad_norm": 0.5 * step, "clip_fraction": 0.0},
        )

    def publish_weights(self, run_id: str, version: int) -> Published:
        self.faults.hit("publish_weights")
        run = self._run(run_id)
        if version != run["version"]:
            raise ConflictError(f"publish {version} but trainer is at {run['version']}")
        self.broker.commit(run_id, version)
        return Published(run_id=run_id, version=version, num_bytes=0, stage_seconds=0.0)

    def end_run(self, run_id: str) -> None:
        self.faults.hit("trainer.end_run")
        self.runs.pop(run_id, None)
        self.ended.append(run_id)

    def delete_checkpoints(self, run_id: str) -> int:
        self.faults.hit("trainer.delete_checkpoints")
        if run_id in self.runs:
            raise ConflictError(f"run {run_id} is configured on this trainer; end it first")
        self.checkpoints_deleted.append(run_id)
        return 1

    def checkpoint(self, run_id: str, directory: str = "") -> CheckpointResult:
        # the checkpoint is of the state the call found; a gate only delays the answer
        run = dict(self._run(run_id))
        self.faults.hit("trainer.checkpoint")
        return CheckpointResult(
            run_id=run_id, path=f"/checkpoints/{run_id}", step=run["step"], policy_version=run["version"]
        )

    def export_policy(self, run_id: str, directory: str = "", max_shard_bytes: int = 1 << 30) -> PolicyExport:
        self.faults.hit("trainer.export_policy")
        run = self._run(run_id)
        final = run["step"] >= run["total"]
        where = "final" if final else f"checkpoints/step-{run['step']}"
        path = Path(directory) if directory else self.policy_root / run_id / where
        path.mkdir(parents=True, exist_ok=True)
        (path / "policy.txt").write_text(f"{run_id} step {run['step']}")
        exported = PolicyExport(
            run_id=run_id,
            path=str(path),
            step=run["step"],
            policy_version=run["version"],
            num_bytes=max_shard_bytes,
            shards=("model.safetensors",),
            final=final,
        )
        self.exports.append(exported)
        return exported

    def offload(self, run_id: str) -> Offloaded:
        self._run(run_id)
        return Offloaded(run_id=run_id, released_bytes=0, num_tensors=0)

    def restore(self, run_id: str) -> int:
        return int(self._run(run_id)["version"])

    def close(self) -> None:
        pass


class FakeRollout:
    def __init__(self, faults: Faults | None = None, engines_per_run: int = 2) -> None:
        self.faults = faults or Faults()
        self.configured: dict[str, RolloutRunConfig] = {}
        self.generate_calls: list[GenerateRequest] = []
        self.evaluate_calls: list[EvaluateRequest] = []
        self.ended: list[str] = []
        self.engines_per_run = engines_per_run
        self.drained: set[str] = set()

    def configure_run(self, config: RolloutRunConfig) -> RunInfo:
        self.faults.hit("rollout.configure_run")
        self.configured[config.run_id] = config
        # fresh engines, all serving (as the rollout service builds them)
        self.drained = {e for e in self.drained if not e.startswith(f"{config.run_id}-engine-")}
        engine_ids = [e.engine_id for e in self._engines(config.run_id)]
        return RunInfo(run_id=config.run_id, policy_version=0, engine_ids=engine_ids)

    def generate(self, request: GenerateRequest) -> GenerateResult:
        self.faults.hit("generate")
        if request.run_id not in self.configured:
            raise NotFoundError(f"rollout has no run {request.run_id}")
        self.generate_calls.append(request)
        groups = len(request.prompts) if request.prompts and not request.num_groups else request.num_groups
        n = groups * request.samples_per_prompt
        return GenerateResult(
            run_id=request.run_id,
            step=request.step,
            num_groups=groups,
            num_samples=n,
            reward_mean=request.step / 10,
            policy_version=request.min_policy_version,
            num_tokens=3 * n,
            generate_seconds=0.001,
        )

    def evaluate(self, request: EvaluateRequest) -> EvaluateResult:
        """max_prompts prompts (3 for 0) whose rewards are 1 for responses i < prompt index."""
        self.faults.hit("evaluate")
        if request.run_id not in self.configured:
            raise NotFoundError(f"rollout has no run {request.run_id}")
        self.evaluate_calls.append(request)
        n = request.samples_per_prompt
        groups = tuple(
            EvalGroup(f"eval-r{p}", tuple(float(i < p) for i in range(n)))
            for p in range(request.max_prompts or 3)
        )
        return EvaluateResult(
            run_id=request.run_id,
            step=request.step,
            policy_version=request.min_policy_version,
            groups=groups,
            num_tokens=len(groups) * n,
            generate_seconds=0.001,
        )

    def _engines(self, run_id: str) -> list[EngineStatus]:
        return [
            EngineStatus(
                engine_id=f"{run_id}-engine-{i}",
                policy_version=0,
                healthy=True,
                state=EngineState.DRAINED if f"{run_id}-engine-{i}" in self.drained else EngineState.SERVING,
            )
            for i in range(self.engines_per_run)
        ]

    def status(self, run_id: str) -> RunStatus:
        if run_id not in self.configured:
            raise NotFoundError(f"rollout: unknown run {run_id!r}")
        return RunStatus(run_id=run_id, engines=self._engines(run_id))

    def drain_engine(self, run_id: str, engine_id: str) -> EngineStatus:
        found = [e for e in self.status(run_id).engines if e.engine_id == engine_id]
        if not found:
            raise NotFoundError(f"rollout: run {run_id!r} has no engine {engine_id!r}")
        self.drained.add(engine_id)
        return self._engines(run_id)[int(engine_id.rsplit("-", 1)[1])]

    def end_run(self, run_id: str) -> None:
        self.faults.hit("rollout.end_run")
        self.ended.append(run_id)

    def close(self) -> None:
        pass


@dataclass
class FakeStack:
    trainer: FakeTrainer
    rollout: FakeRollout
    broker: FakeBroker
    faults: Faults

    @property
    def services(self) -> Services:
        """The fakes as the controller's clients (as in-process twins would be)."""
        return Services(trainer=self.trainer, rollout=self.rollout, broker=self.broker)


def fake_stack() -> FakeStack:
    faults = Faults()
    broker = FakeBroker(faults)
    return FakeStack(
        trainer=FakeTrainer(broker, faults), rollout=FakeRollout(faults), broker=broker, faults=faults
    )


# ---- the same fakes behind the services' real gRPC servicers ---------------------------------


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
    """Each fake behind its service's own servicer on a gRPC server on 127.0.0.1 with
    grpc.health.v1, like the real services."""

    def broker(server) -> None:
        weight_broker_pb2_grpc.add_WeightBrokerServicer_to_server(WeightBrokerServicer(stack.broker), server)

    servers = {
        "trainer": rpc.start_server([register_trainer(stack.trainer)], [TRAINER_SERVICE]),
        "rollout": rpc.start_server([RolloutServicer(stack.rollout).add_to_server], [ROLLOUT_SERVICE]),
        "broker": rpc.start_server([broker], [BROKER_SERVICE]),
    }
    return FakeGrpcServices(stack=stack, servers=servers)


__all__ = [
    "Faults",
    "FakeBroker",
    "FakeTrainer",
    "FakeRollout",
    "FakeStack",
    "fake_stack",
    "serve_fakes",
    "FakeGrpcServices",
]
