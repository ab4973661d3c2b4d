from furlong.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AlgorithmConfig(_message.Message):
    __slots__ = ("name", "learning_rate", "clip_eps", "weight_decay", "max_grad_norm", "epochs_per_batch", "micro_batch_size", "adam_beta1", "adam_beta2", "clip_eps_high", "loss_aggregation", "kl_coef", "kl_estimator", "kl_mode", "entropy_coef", "off_policy", "is_low", "is_high", "gamma", "gae_lambda", "value_coef", "value_clip")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    CLIP_EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_PER_BATCH_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ADAM_BETA1_FIELD_NUMBER: _ClassVar[int]
    ADAM_BETA2_FIELD_NUMBER: _ClassVar[int]
    CLIP_EPS_HIGH_FIELD_NUMBER: _ClassVar[int]
    LOSS_AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    KL_COEF_FIELD_NUMBER: _ClassVar[int]
    KL_ESTIMATOR_FIELD_NUMBER: _ClassVar[int]
    KL_MODE_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_COEF_FIELD_NUMBER: _ClassVar[int]
    OFF_POLICY_FIELD_NUMBER: _ClassVar[int]
    IS_LOW_FIELD_NUMBER: _ClassVar[int]
    IS_HIGH_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    GAE_LAMBDA_FIELD_NUMBER: _ClassVar[int]
    VALUE_COEF_FIELD_NUMBER: _ClassVar[int]
    VALUE_CLIP_FIELD_NUMBER: _ClassVar[int]
    name: str
    learning_rate: float
    clip_eps: float
    weight_decay: float
    max_grad_norm: float
    epochs_per_batch: int
    micro_batch_size: int
    adam_beta1: float
    adam_beta2: float
    clip_eps_high: float
    loss_aggregation: str
    kl_coef: float
    kl_estimator: str
    kl_mode: str
    entropy_coef: float
    off_policy: str
    is_low: float
    is_high: float
    gamma: float
    gae_lambda: float
    value_coef: float
    value_clip: float
    def __init__(self, name: _Optional[str] = ..., learning_rate: _Optional[float] = ..., clip_eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., max_grad_norm: _Optional[float] = ..., epochs_per_batch: _Optional[int] = ..., micro_batch_size: _Optional[int] = ..., adam_beta1: _Optional[float] = ..., adam_beta2: _Optional[float] = ..., clip_eps_high: _Optional[float] = ..., loss_aggregation: _Optional[str] = ..., kl_coef: _Optional[float] = ..., kl_estimator: _Optional[str] = ..., kl_mode: _Optional[str] = ..., entropy_coef: _Optional[float] = ..., off_policy: _Optional[str] = ..., is_low: _Optional[float] = ..., is_high: _Optional[float] = ..., gamma: _Optional[float] = ..., gae_lambda: _Optional[float] = ..., value_coef: _Optional[float] = ..., value_clip: _Optional[float] = ...) -> None: ...

class ConfigureRunRequest(_message.Message):
    __slots__ = ("run_id", "model_dir", "algorithm", "seed", "total_steps", "sampling_temperature", "checkpoint_every_steps", "precision", "checkpoint_keep_last", "parallel", "backend", "megatron")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_STEPS_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_KEEP_LAST_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MEGATRON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    model_dir: str
    algorithm: AlgorithmConfig
    seed: int
    total_steps: int
    sampling_temperature: float
    checkpoint_every_steps: int
    precision: _common_pb2.PrecisionConfig
    checkpoint_keep_last: int
    parallel: ParallelConfig
    backend: str
    megatron: MegatronConfig
    def __init__(self, run_id: _Optional[str] = ..., model_dir: _Optional[str] = ..., algorithm: _Optional[_Union[AlgorithmConfig, _Mapping]] = ..., seed: _Optional[int] = ..., total_steps: _Optional[int] = ..., sampling_temperature: _Optional[float] = ..., checkpoint_every_steps: _Optional[int] = ..., precision: _Optional[_Union[_common_pb2.PrecisionConfig, _Mapping]] = ..., checkpoint_keep_last: _Optional[int] = ..., parallel: _Optional[_Union[ParallelConfig, _Mapping]] = ..., backend: _Optional[str] = ..., megatron: _Optional[_Union[MegatronConfig, _Mapping]] = ...) -> None: ...

class MegatronConfig(_message.Message):
    __slots__ = ("tensor_parallel", "pipeline_parallel", "context_parallel")
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    tensor_parallel: int
    pipeline_parallel: int
    context_parallel: int
    def __init__(self, tensor_parallel: _Optional[int] = ..., pipeline_parallel: _Optional[int] = ..., context_parallel: _Optional[int] = ...) -> None: ...

class ParallelConfig(_message.Message):
    __slots__ = ("strategy", "world_size")
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    strategy: str
    world_size: int
    def __init__(self, strategy: _Optional[str] = ..., world_size: _Optional[int] = ...) -> None: ...

class ConfigureRunResponse(_message.Message):
    __slots__ = ("run_id", "policy_version", "num_parameters")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    policy_version: int
    num_parameters: int
    def __init__(self, run_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., num_parameters: _Optional[int] = ...) -> None: ...

class TrainStepRequest(_message.Message):
    __slots__ = ("run_id", "step", "num_groups", "timeout_s", "step_groups_only")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    STEP_GROUPS_ONLY_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    num_groups: int
    timeout_s: float
    step_groups_only: bool
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., num_groups: _Optional[int] = ..., timeout_s: _Optional[float] = ..., step_groups_only: _Optional[bool] = ...) -> None: ...

class TrainStepResponse(_message.Message):
    __slots__ = ("run_id", "step", "loss", "policy_version", "num_samples", "num_groups", "step_seconds", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    loss: float
    policy_version: int
    num_samples: int
    num_groups: int
    step_seconds: float
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., policy_version: _Optional[int] = ..., num_samples: _Optional[int] = ..., num_groups: _Optional[int] = ..., step_seconds: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class PublishWeightsRequest(_message.Message):
    __slots__ = ("run_id", "version")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: int
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class PublishWeightsResponse(_message.Message):
    __slots__ = ("run_id", "version", "num_bytes", "stage_seconds")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: int
    num_bytes: int
    stage_seconds: float
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[int] = ..., num_bytes: _Optional[int] = ..., stage_seconds: _Optional[float] = ...) -> None: ...

class EndRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class EndRunResponse(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class OffloadRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class OffloadResponse(_message.Message):
    __slots__ = ("run_id", "released_bytes", "num_tensors")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RELEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    released_bytes: int
    num_tensors: int
    def __init__(self, run_id: _Optional[str] = ..., released_bytes: _Optional[int] = ..., num_tensors: _Optional[int] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("run_id", "policy_version")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    policy_version: int
    def __init__(self, run_id: _Optional[str] = ..., policy_version: _Optional[int] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("run_id", "directory")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    directory: str
    def __init__(self, run_id: _Optional[str] = ..., directory: _Optional[str] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("run_id", "path", "step", "policy_version")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    path: str
    step: int
    policy_version: int
    def __init__(self, run_id: _Optional[str] = ..., path: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...

class ExportPolicyRequest(_message.Message):
    __slots__ = ("run_id", "directory", "max_shard_bytes")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    MAX_SHARD_BYTES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    directory: str
    max_shard_bytes: int
    def __init__(self, run_id: _Optional[str] = ..., directory: _Optional[str] = ..., max_shard_bytes: _Optional[int] = ...) -> None: ...

class ExportPolicyResponse(_message.Message):
    __slots__ = ("run_id", "path", "step", "policy_version", "num_bytes", "shards", "final")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    path: str
    step: int
    policy_version: int
    num_bytes: int
    shards: _containers.RepeatedScalarFieldContainer[str]
    final: bool
    def __init__(self, run_id: _Optional[str] = ..., path: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., num_bytes: _Optional[int] = ..., shards: _Optional[_Iterable[str]] = ..., final: _Optional[bool] = ...) -> None: ...

class DeleteCheckpointsRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class DeleteCheckpointsResponse(_message.Message):
    __slots__ = ("run_id", "num_removed")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_REMOVED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    num_removed: int
    def __init__(self, run_id: _Optional[str] = ..., num_removed: _Optional[int] = ...) -> None: ...
