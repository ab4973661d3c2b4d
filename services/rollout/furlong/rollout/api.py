"""The rollout service's interface as its callers see it: the requests and results (plain values,
declared in core.types and core.sampling) and the `RolloutClient` Protocol that the gRPC client and
the in-process twin (`client.py`) implement and `RolloutService` serves. Callers outside the service
import these names from here. Free of torch, so that callers stay light.
"""

from __future__ import annotations

from typing import Protocol

from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.types import (
    EngineState,
    EngineStatus,
    EvalGroup,
    EvaluateRequest,
    EvaluateResult,
    GenerateRequest,
    GenerateResult,
    LedgerCounts,
    Prompt,
    RolloutRunConfig,
    RunInfo,
    RunStatus,
)
from furlong.v1 import rollout_pb2

SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name  # also its health name

__all__ = [
    "SERVICE_NAME",
    "EngineState",
    "EngineStatus",
    "EvalGroup",
    "EvaluateRequest",
    "EvaluateResult",
    "GenerateRequest",
    "GenerateResult",
    "LedgerCounts",
    "Prompt",
    "RolloutClient",
    "RolloutRunConfig",
    "RunInfo",
    "RunStatus",
    "SamplingConfig",
]


class RolloutClient(Protocol):
    """The rollout service. Thread-safe. Errors are furlong.core.errors domain exceptions,
    ValueError (a bad request, naming the field) and TimeoutError (min_policy_version not
    reached). configure_run with the same config is idempotent; end_run is not."""

    def configure_run(self, config: RolloutRunConfig) -> RunInfo: ...
    def generate(self, request: GenerateRequest) -> GenerateResult: ...
    def evaluate(self, request: EvaluateRequest) -> EvaluateResult: ...
    def status(self, run_id: str) -> RunStatus: ...
    def drain_engine(self, run_id: str, engine_id: str) -> EngineStatus: ...
    def end_run(self, run_id: str) -> None: ...
    def close(self) -> None: ...
