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
    __slots__ = ("num_engines", "max_refill_rounds", "over_sampling", "max_staleness", "engine", "engine_urls")
    NUM_ENGINES_FIELD_NUMBER: _ClassVar[int]
    MAX_REFILL_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    OVER_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_URLS_FIELD_NUMBER: _ClassVar[int]
    num_engines: int
    max_refill_rounds: int
    over_sampling: float
    max_staleness: int
    engine: str
    engine_urls: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, num_engines: _Optional[int] = ..., max_refill_rounds: _Optional[int] = ..., over_sampling: _Optional[float] = ..., max_staleness: _Optional[int] = ..., engine: _Optional[str] = ..., engine_urls: _Optional[_Iterable[str]] = ...) -> None: ...

class ConfigureRolloutRequest(_message.Message):
    __slots__ = ("run_id", "model_dir", "task", "seed", "rollout", "reward", "precision", "data", "reward_config", "environment", "agent")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    REWARD_CONFIG_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    model_dir: str
    task: str
    seed: int
    rollout: RolloutConfig
    reward: str
    precision: _common_pb2.PrecisionConfig
    data: DataConfig
    reward_config: RewardConfig
    environment: EnvironmentConfig
    agent: AgentConfig
    def __init__(self, run_id: _Optional[str] = ..., model_dir: _Optional[str] = ..., task: _Optional[str] = ..., seed: _Optional[int] = ..., rollout: _Optional[_Union[RolloutConfig, _Mapping]] = ..., reward: _Optional[str] = ..., precision: _Optional[_Union[_common_pb2.PrecisionConfig, _Mapping]] = ..., data: _Optional[_Union[DataConfig, _Mapping]] = ..., reward_config: _Optional[_Union[RewardConfig, _Mapping]] = ..., environment: _Optional[_Union[EnvironmentConfig, _Mapping]] = ..., agent: _Optional[_Union[AgentConfig, _Mapping]] = ...) -> None: ...

class AgentConfig(_message.Message):
    __slots__ = ("function", "max_calls", "timeout_s", "concurrency")
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    MAX_CALLS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    function: str
    max_calls: int
    timeout_s: float
    concurrency: int
    def __init__(self, function: _Optional[str] = ..., max_calls: _Optional[int] = ..., timeout_s: _Optional[float] = ..., concurrency: _Optional[int] = ...) -> None: ...

class EnvironmentConfig(_message.Message):
    __slots__ = ("name", "max_turns", "max_tokens_per_turn", "max_episode_tokens", "timeout_s", "num_workers")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_TURN_FIELD_NUMBER: _ClassVar[int]
    MAX_EPISODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    max_turns: int
    max_tokens_per_turn: int
    max_episode_tokens: int
    timeout_s: float
    num_workers: int
    def __init__(self, name: _Optional[str] = ..., max_turns: _Optional[int] = ..., max_tokens_per_turn: _Optional[int] = ..., max_episode_tokens: _Optional[int] = ..., timeout_s: _Optional[float] = ..., num_workers: _Optional[int] = ...) -> None: ...

class DataConfig(_message.Message):
    __slots__ = ("train", "eval", "prompt_key", "messages_key", "answer_key", "tools_key", "metadata_key", "shuffle")
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    EVAL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_KEY_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_KEY_FIELD_NUMBER: _ClassVar[int]
    ANSWER_KEY_FIELD_NUMBER: _ClassVar[int]
    TOOLS_KEY_FIELD_NUMBER: _ClassVar[int]
    METADATA_KEY_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_FIELD_NUMBER: _ClassVar[int]
    train: str
    eval: str
    prompt_key: str
    messages_key: str
    answer_key: str
    tools_key: str
    metadata_key: str
    shuffle: bool
    def __init__(self, train: _Optional[str] = ..., eval: _Optional[str] = ..., prompt_key: _Optional[str] = ..., messages_key: _Optional[str] = ..., answer_key: _Optional[str] = ..., tools_key: _Optional[str] = ..., metadata_key: _Optional[str] = ..., shuffle: _Optional[bool] = ...) -> None: ...

class RewardConfig(_message.Message):
    __slots__ = ("exact_match", "math", "regex", "format", "code", "python", "http", "timeout_s", "on_failure", "max_resamples")
    class ExactMatch(_message.Message):
        __slots__ = ("weight",)
        WEIGHT_FIELD_NUMBER: _ClassVar[int]
        weight: float
        def __init__(self, weight: _Optional[float] = ...) -> None: ...
    class Math(_message.Message):
        __slots__ = ("weight",)
        WEIGHT_FIELD_NUMBER: _ClassVar[int]
        weight: float
        def __init__(self, weight: _Optional[float] = ...) -> None: ...
    class Regex(_message.Message):
        __slots__ = ("weight", "pattern", "mode")
        WEIGHT_FIELD_NUMBER: _ClassVar[int]
        PATTERN_FIELD_NUMBER: _ClassVar[int]
        MODE_FIELD_NUMBER: _ClassVar[int]
        weight: float
        pattern: str
        mode: str
        def __init__(self, weight: _Optional[float] = ..., pattern: _Optional[str] = ..., mode: _Optional[str] = ...) -> None: ...
    class Format(_message.Message):
        __slots__ = ("weight", "check")
        WEIGHT_FIELD_NUMBER: _ClassVar[int]
        CHECK_FIELD_NUMBER: _ClassVar[int]
        weight: float
        check: str
        def __init__(self, weight: _Optional[float] = ..., check: _Optional[str] = ...) -> None: ...
    class Code(_message.Message):
        __slots__ = ("weight", "timeout_s", "cpu_s", "memory_bytes", "sandbox")
        WEIGHT_FIELD_NUMBER: _ClassVar[int]
        TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
        CPU_S_FIELD_NUMBER: _ClassVar[int]
        MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
        SANDBOX_FIELD_NUMBER: _ClassVar[int]
        weight: float
        timeout_s: float
        cpu_s: int
        memory_bytes: int
        sandbox: str
        def __init__(self, weight: _Optional[float] = ..., timeout_s: _Optional[float] = ..., cpu_s: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., sandbox: _Optional[str] = ...) -> None: ...
    class Python(_message.Message):
        __slots__ = ("weight", "function")
        WEIGHT_FIELD_NUMBER: _ClassVar[int]
        FUNCTION_FIELD_NUMBER: _ClassVar[int]
        weight: float
        function: str
        def __init__(self, weight: _Optional[float] = ..., function: _Optional[str] = ...) -> None: ...
    class Http(_message.Message):
        __slots__ = ("weight", "url", "timeout_s", "retries")
        WEIGHT_FIELD_NUMBER: _ClassVar[int]
        URL_FIELD_NUMBER: _ClassVar[int]
        TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
        RETRIES_FIELD_NUMBER: _ClassVar[int]
        weight: float
        url: str
        timeout_s: float
        retries: int
        def __init__(self, weight: _Optional[float] = ..., url: _Optional[str] = ..., timeout_s: _Optional[float] = ..., retries: _Optional[int] = ...) -> None: ...
    EXACT_MATCH_FIELD_NUMBER: _ClassVar[int]
    MATH_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    PYTHON_FIELD_NUMBER: _ClassVar[int]
    HTTP_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ON_FAILURE_FIELD_NUMBER: _ClassVar[int]
    MAX_RESAMPLES_FIELD_NUMBER: _ClassVar[int]
    exact_match: RewardConfig.ExactMatch
    math: RewardConfig.Math
    regex: RewardConfig.Regex
    format: RewardConfig.Format
    code: RewardConfig.Code
    python: RewardConfig.Python
    http: RewardConfig.Http
    timeout_s: float
    on_failure: str
    max_resamples: int
    def __init__(self, exact_match: _Optional[_Union[RewardConfig.ExactMatch, _Mapping]] = ..., math: _Optional[_Union[RewardConfig.Math, _Mapping]] = ..., regex: _Optional[_Union[RewardConfig.Regex, _Mapping]] = ..., format: _Optional[_Union[RewardConfig.Format, _Mapping]] = ..., code: _Optional[_Union[RewardConfig.Code, _Mapping]] = ..., python: _Optional[_Union[RewardConfig.Python, _Mapping]] = ..., http: _Optional[_Union[RewardConfig.Http, _Mapping]] = ..., timeout_s: _Optional[float] = ..., on_failure: _Optional[str] = ..., max_resamples: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("run_id", "step", "prompts", "samples_per_prompt", "sampling", "min_policy_version", "timeout_s", "num_groups", "share", "num_shares")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    samples_per_prompt: int
    sampling: _common_pb2.SamplingParams
    min_policy_version: int
    timeout_s: float
    num_groups: int
    share: int
    num_shares: int
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., samples_per_prompt: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., min_policy_version: _Optional[int] = ..., timeout_s: _Optional[float] = ..., num_groups: _Optional[int] = ..., share: _Optional[int] = ..., num_shares: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("run_id", "step", "num_groups", "num_samples", "reward_mean", "policy_version", "num_tokens", "generate_seconds", "num_groups_dropped", "num_groups_refilled", "num_groups_surplus", "request_id", "num_groups_resumed", "num_reward_failures")
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
    NUM_REWARD_FAILURES_FIELD_NUMBER: _ClassVar[int]
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
    num_reward_failures: int
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., num_groups: _Optional[int] = ..., num_samples: _Optional[int] = ..., reward_mean: _Optional[float] = ..., policy_version: _Optional[int] = ..., num_tokens: _Optional[int] = ..., generate_seconds: _Optional[float] = ..., num_groups_dropped: _Optional[int] = ..., num_groups_refilled: _Optional[int] = ..., num_groups_surplus: _Optional[int] = ..., request_id: _Optional[str] = ..., num_groups_resumed: _Optional[int] = ..., num_reward_failures: _Optional[int] = ...) -> None: ...

class EvaluateRequest(_message.Message):
    __slots__ = ("run_id", "step", "samples_per_prompt", "sampling", "max_prompts", "min_policy_version", "timeout_s")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    samples_per_prompt: int
    sampling: _common_pb2.SamplingParams
    max_prompts: int
    min_policy_version: int
    timeout_s: float
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., samples_per_prompt: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_prompts: _Optional[int] = ..., min_policy_version: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class EvalGroup(_message.Message):
    __slots__ = ("prompt_id", "rewards")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    rewards: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, prompt_id: _Optional[str] = ..., rewards: _Optional[_Iterable[float]] = ...) -> None: ...

class EvaluateResponse(_message.Message):
    __slots__ = ("run_id", "step", "policy_version", "groups", "num_tokens", "generate_seconds")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    policy_version: int
    groups: _containers.RepeatedCompositeFieldContainer[EvalGroup]
    num_tokens: int
    generate_seconds: float
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[EvalGroup, _Mapping]]] = ..., num_tokens: _Optional[int] = ..., generate_seconds: _Optional[float] = ...) -> None: ...

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
