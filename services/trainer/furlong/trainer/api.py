"""The trainer's interface as its callers see it: requests and results as plain values, and the
`TrainerClient` Protocol that the gRPC client and the in-process twin (`client.py`) implement and
`TrainerService` serves. Free of torch and Redis, so that callers stay light.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from furlong.core.settings import (
    AlgorithmSettings,
    CheckpointSettings,
    MegatronSettings,
    ParallelSettings,
    PrecisionSettings,
    SettingError,
    TrainerSettings,
)
from furlong.core.settings.checkpoint import DEFAULT_EXPORT_SHARD_BYTES
from furlong.v1 import trainer_pb2

SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name  # also its health name

# Keys of TrainStepResult.metrics: versions the trained policy is ahead of the policy that drew each
# trained sample, as the mean and the maximum over the step's samples (0 in the synchronous loop).
STALENESS_MEAN = "staleness_mean"
STALENESS_MAX = "staleness_max"


@dataclass(frozen=True)
class TrainerRunConfig:
    """ConfigureRun: load the policy of a run and get ready to train it."""

    run_id: str
    model_dir: str  # Hugging Face model directory, as the trainer sees it
    algorithm: AlgorithmSettings
    sampling_temperature: float  # the rollout's: log-probs are scored under it
    seed: int
    total_steps: int
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    precision: PrecisionSettings = field(default_factory=PrecisionSettings)
    # Data parallelism over the trainer's ranks; world_size must be the trainer's own.
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
    # What the policy is trained as (`trainer.backend`) and the megatron backend's model parallelism.
    backend: str = "torch"
    megatron: MegatronSettings = field(default_factory=MegatronSettings)

    @property
    def gathers_state(self) -> bool:
        """Whether the policy's whole state dict is a collective every rank joins: fsdp2 shards,
        or megatron's tensor-parallel shards and pipeline stages."""
        return self.parallel.strategy == "fsdp2" or (
            self.backend == "megatron" and self.megatron.model_parallel_size > 1
        )

    @property
    def data_parallel_size(self) -> int:
        """Replicas of the policy over the trainer's ranks (`TrainerSettings.data_parallel_size`)."""
        return TrainerSettings(
            parallel=self.parallel, backend=self.backend, megatron=self.megatron
        ).data_parallel_size

    def check_trainer(self) -> None:
        """SettingError naming the field unless the run's `trainer` settings (parallel, backend,
        megatron) hold together."""
        try:
            TrainerSettings(parallel=self.parallel, backend=self.backend, megatron=self.megatron)
        except SettingError as err:  # named under the run spec's section
            raise err.under("trainer") from None


@dataclass(frozen=True)
class TrainerRun:
    run_id: str
    policy_version: int  # the version the trainer starts from (0 = the checkpoint)
    num_parameters: int


@dataclass(frozen=True)
class TrainStepRequest:
    run_id: str
    step: int  # 1-based; must be the trainer's next step
    num_groups: int  # groups to read from the run's stream
    timeout_s: float  # how long to wait for them to arrive
    # Asynchronous mode: only groups of `step`; later steps' groups stay pending for their own step.
    step_groups_only: bool = False


@dataclass(frozen=True)
class TrainStepResult:
    run_id: str
    step: int
    loss: float
    policy_version: int  # produced by this step, not yet published
    num_samples: int
    num_groups: int
    step_seconds: float
    metrics: dict[str, float] = field(default_factory=dict)  # reward_mean, clip_fraction, grad_norm, ...


@dataclass(frozen=True)
class Published:
    run_id: str
    version: int
    num_bytes: int
    stage_seconds: float


@dataclass(frozen=True)
class Offloaded:
    run_id: str
    released_bytes: int
    num_tensors: int


@dataclass(frozen=True)
class CheckpointResult:
    run_id: str
    path: str  # the directory written, as the trainer sees it
    step: int  # the last completed step it holds (0 = before the first step)
    policy_version: int


@dataclass(frozen=True)
class PolicyExport:
    """A Hugging Face model directory of a run's policy that the trainer wrote."""

    run_id: str
    path: str  # the directory written, as the trainer sees it
    step: int  # the last completed step it holds (0 = before the first step)
    policy_version: int
    num_bytes: int  # tensor bytes written
    shards: tuple[str, ...]  # the safetensors file names
    final: bool  # the step is the run's last


class TrainerClient(Protocol):
    """The trainer service. Calls block; implementations are thread-safe (calls for one run are
    serialised by the trainer). Errors are furlong.core.errors domain exceptions (NotFoundError for
    an unknown run, ConflictError for a call out of order or an offloaded run), ValueError (a bad
    request, naming the field), TimeoutError, and UnavailableError when the trainer cannot be
    reached. configure_run and end_run are not idempotent: a repeated call is a ConflictError or
    NotFoundError worth seeing."""

    def configure_run(self, config: TrainerRunConfig) -> TrainerRun: ...
    def train_step(self, request: TrainStepRequest) -> TrainStepResult: ...
    def publish_weights(self, run_id: str, version: int) -> Published: ...
    def checkpoint(self, run_id: str, directory: str = "") -> CheckpointResult: ...
    def export_policy(
        self, run_id: str, directory: str = "", max_shard_bytes: int = DEFAULT_EXPORT_SHARD_BYTES
    ) -> PolicyExport: ...
    def offload(self, run_id: str) -> Offloaded: ...
    def restore(self, run_id: str) -> int: ...
    def end_run(self, run_id: str) -> None: ...
    def delete_checkpoints(self, run_id: str) -> int: ...
    def close(self) -> None: ...
