"""Clients of the rollout service: the `RolloutApi` seam, its gRPC implementation `RolloutClient` and
its in-process twin over a RolloutService (same behaviour, same exceptions), so a whole RL loop can
run in one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from furlong.rollout.convert import (
    engine_status_from_proto,
    prompt_to_proto,
    result_from_proto,
    run_info_from_proto,
    sampling_to_proto,
    status_from_proto,
)
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.types import EngineStatus, GenerateResult, Prompt, RunInfo, RunStatus
from furlong.rpc import call, channel
from furlong.v1 import rollout_pb2 as pb
from furlong.v1 import rollout_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from furlong.rollout.core.service import RolloutService


class RolloutApi(Protocol):
    """What the controller needs from rollout. Thread-safe. Errors are furlong.core.errors domain
    exceptions, ValueError (bad request) and TimeoutError (min_policy_version not reached)."""

    def configure_run(
        self, run_id: str, model_dir: str, reward: str, num_engines: int, seed: int
    ) -> RunInfo: ...
    def generate(
        self,
        run_id: str,
        step: int,
        prompts: Sequence[Prompt],
        samples_per_prompt: int,
        sampling: SamplingConfig,
        min_policy_version: int,
        timeout_s: float,
        max_refill_rounds: int = 0,
        keep_groups: int = 0,
    ) -> GenerateResult: ...
    def status(self, run_id: str) -> RunStatus: ...
    def drain_engine(self, run_id: str, engine_id: str) -> EngineStatus: ...
    def end_run(self, run_id: str) -> None: ...
    def close(self) -> None: ...


class RolloutClient:
    """RolloutApi over gRPC. Deadlines: `timeout_s` for status and end_run, `configure_timeout_s`
    for configure_run (it loads a checkpoint), and a request's own timeout_s plus
    `generate_margin_s` for generate (the wait for the policy version, then the generation)."""

    def __init__(
        self,
        address: str,
        timeout_s: float = 10.0,
        configure_timeout_s: float = 300.0,
        generate_margin_s: float = 600.0,
    ) -> None:
        for name, value in (
            ("timeout_s", timeout_s),
            ("configure_timeout_s", configure_timeout_s),
            ("generate_margin_s", generate_margin_s),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        self.address = address
        self._timeout_s = timeout_s
        self._configure_timeout_s = configure_timeout_s
        self._generate_margin_s = generate_margin_s
        self._channel = channel(address)
        self._stub = pb_grpc.RolloutStub(self._channel)

    def configure_run(self, run_id: str, model_dir: str, reward: str, num_engines: int, seed: int) -> RunInfo:
        req = pb.ConfigureRolloutRequest(
            run_id=run_id, model_dir=model_dir, reward=reward, num_engines=num_engines, seed=seed
        )
        return run_info_from_proto(call(self._stub.ConfigureRun, req, self._configure_timeout_s))

    def generate(
        self,
        run_id: str,
        step: int,
        prompts: Sequence[Prompt],
        samples_per_prompt: int,
        sampling: SamplingConfig,
        min_policy_version: int,
        timeout_s: float,
        max_refill_rounds: int = 0,
        keep_groups: int = 0,
    ) -> GenerateResult:
        req = pb.GenerateRequest(
            run_id=run_id,
            step=step,
            prompts=[prompt_to_proto(p) for p in prompts],
            samples_per_prompt=samples_per_prompt,
            sampling=sampling_to_proto(sampling),
            min_policy_version=min_policy_version,
            timeout_s=timeout_s,
            min_p=sampling.min_p,
            max_refill_rounds=max_refill_rounds,
            keep_groups=keep_groups,
        )
        deadline_s = max(float(timeout_s), 0.0) + self._generate_margin_s
        return result_from_proto(call(self._stub.Generate, req, deadline_s))

    def status(self, run_id: str) -> RunStatus:
        return status_from_proto(
            call(self._stub.GetStatus, pb.GetRolloutStatusRequest(run_id=run_id), self._timeout_s)
        )

    def drain_engine(self, run_id: str, engine_id: str) -> EngineStatus:
        return engine_status_from_proto(
            call(
                self._stub.DrainEngine,
                pb.DrainEngineRequest(run_id=run_id, engine_id=engine_id),
                self._timeout_s,
            )
        )

    def end_run(self, run_id: str) -> None:
        call(self._stub.EndRun, pb.EndRolloutRequest(run_id=run_id), self._timeout_s)

    def close(self) -> None:
        self._channel.close()


class InProcessRolloutClient:
    """RolloutApi calling a RolloutService in this process. close() leaves the service running."""

    def __init__(self, service: RolloutService) -> None:
        self._service = service

    def configure_run(self, run_id: str, model_dir: str, reward: str, num_engines: int, seed: int) -> RunInfo:
        return self._service.configure_run(run_id, model_dir, reward, num_engines, seed)

    def generate(
        self,
        run_id: str,
        step: int,
        prompts: Sequence[Prompt],
        samples_per_prompt: int,
        sampling: SamplingConfig,
        min_policy_version: int,
        timeout_s: float,
        max_refill_rounds: int = 0,
        keep_groups: int = 0,
    ) -> GenerateResult:
        return self._service.generate(
            run_id,
            step,
            prompts,
            samples_per_prompt,
            sampling,
            min_policy_version,
            timeout_s,
            max_refill_rounds,
            keep_groups,
        )

    def status(self, run_id: str) -> RunStatus:
        return self._service.status(run_id)

    def drain_engine(self, run_id: str, engine_id: str) -> EngineStatus:
        return self._service.drain_engine(run_id, engine_id)

    def end_run(self, run_id: str) -> None:
        self._service.end_run(run_id)

    def close(self) -> None:
        pass
