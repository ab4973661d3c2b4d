from furlong.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_STATE_UNSPECIFIED: _ClassVar[EngineState]
    ENGINE_STATE_SERVING: _ClassVar[EngineState]
    ENGINE_STATE_DRAINING: _ClassVar[EngineState]
    ENGINE_STATE_DRAINED: _ClassVar[EngineState]
ENGINE_STATE_UNSPECIFIED: EngineState
ENGINE_STATE_SERVING: EngineState
ENGINE_STATE_DRAINING: EngineState
ENGINE_STATE_DRAINED: EngineState

class RolloutConfig(_message.Message):
    __slots__ = ("num_engines", "max_refill_rounds", "over_sampling")
    NUM_ENGINES_FIELD_NUMBER: _ClassVar[int]
    MAX_REFILL_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    OVER_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    num_engines: int
    max_refill_rounds: int
    over_sampling: float
    def __init__(self, num_engines: _Optional[int] = ..., max_refill_rounds: _Optional[int] = ..., over_sampling: _Optional[float] = ...) -> None: ...

class ConfigureRolloutRequest(_message.Message):
    __slots__ = ("run_id", "model_dir", "task", "seed", "rollout", "reward", "precision")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    model_dir: str
    task: str
    seed: int
    rollout: RolloutConfig
    reward: str
    precision: _common_pb2.PrecisionConfig
    def __init__(self, run_id: _Optional[str] = ..., model_dir: _Optional[str] = ..., task: _Optional[str] = ..., seed: _Optional[int] = ..., rollout: _Optional[_Union[RolloutConfig, _Mapping]] = ..., reward: _Optional[str] = ..., precision: _Optional[_Union[_common_pb2.PrecisionConfig, _Mapping]] = ...) -> None: ...

class ConfigureRolloutResponse(_message.Message):
    __slots__ = ("run_id", "policy_version", "engine_ids")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    policy_version: int
    engine_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., engine_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("prompt_id", "text", "answer")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    text: str
    answer: str
    def __init__(self, prompt_id: _Optional[str] = ..., text: _Optional[str] = ..., answer: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("run_id", "step", "prompts", "samples_per_prompt", "sampling", "min_policy_version", "timeout_s", "num_groups")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    samples_per_prompt: int
    sampling: _common_pb2.SamplingParams
    min_policy_version: int
    timeout_s: float
    num_groups: int
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., samples_per_prompt: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., min_policy_version: _Optional[int] = ..., timeout_s: _Optional[float] = ..., num_groups: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("run_id", "step", "num_groups", "num_samples", "reward_mean", "policy_version", "num_tokens", "generate_seconds", "num_groups_dropped", "num_groups_refilled", "num_groups_surplus", "request_id", "num_groups_resumed")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_REFILLED_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_SURPLUS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_RESUMED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    num_groups: int
    num_samples: int
    reward_mean: float
    policy_version: int
    num_tokens: int
    generate_seconds: float
    num_groups_dropped: int
    num_groups_refilled: int
    num_groups_surplus: int
    request_id: str
    num_groups_resumed: int
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., num_groups: _Optional[int] = ..., num_samples: _Optional[int] = ..., reward_mean: _Optional[float] = ..., policy_version: _Optional[int] = ..., num_tokens: _Optional[int] = ..., generate_seconds: _Optional[float] = ..., num_groups_dropped: _Optional[int] = ..., num_groups_refilled: _Optional[int] = ..., num_groups_surplus: _Optional[int] = ..., request_id: _Optional[str] = ..., num_groups_resumed: _Optional[int] = ...) -> None: ...

class EndRolloutRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class EndRolloutResponse(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class GetRolloutStatusRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class EngineStatus(_message.Message):
    __slots__ = ("engine_id", "policy_version", "healthy", "state", "pid", "restarts", "in_flight")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    policy_version: int
    healthy: bool
    state: EngineState
    pid: int
    restarts: int
    in_flight: int
    def __init__(self, engine_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., healthy: _Optional[bool] = ..., state: _Optional[_Union[EngineState, str]] = ..., pid: _Optional[int] = ..., restarts: _Optional[int] = ..., in_flight: _Optional[int] = ...) -> None: ...

class LedgerCounts(_message.Message):
    __slots__ = ("pending", "in_flight", "done", "surplus", "duplicates_refused")
    PENDING_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    SURPLUS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_REFUSED_FIELD_NUMBER: _ClassVar[int]
    pending: int
    in_flight: int
    done: int
    surplus: int
    duplicates_refused: int
    def __init__(self, pending: _Optional[int] = ..., in_flight: _Optional[int] = ..., done: _Optional[int] = ..., surplus: _Optional[int] = ..., duplicates_refused: _Optional[int] = ...) -> None: ...

class RolloutStatus(_message.Message):
    __slots__ = ("run_id", "engines", "ledger")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    LEDGER_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    engines: _containers.RepeatedCompositeFieldContainer[EngineStatus]
    ledger: LedgerCounts
    def __init__(self, run_id: _Optional[str] = ..., engines: _Optional[_Iterable[_Union[EngineStatus, _Mapping]]] = ..., ledger: _Optional[_Union[LedgerCounts, _Mapping]] = ...) -> None: ...

class DrainEngineRequest(_message.Message):
    __slots__ = ("run_id", "engine_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    engine_id: str
    def __init__(self, run_id: _Optional[str] = ..., engine_id: _Optional[str] = ...) -> None: ...
