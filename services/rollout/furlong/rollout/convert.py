"""Conversions between `furlong.v1` rollout messages and the rollout service's plain values, shared
by the server and the gRPC client. Free of torch so that clients stay light.
"""

from __future__ import annotations

from furlong.core.settings import AgentSettings, DataSettings, EnvironmentSettings, RewardSettings
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
from furlong.rpc.settings import (
    from_proto,
    precision_from_proto,
    precision_to_proto,
    rollout_from_proto,
    rollout_to_proto,
    to_proto,
)
from furlong.rpc.settings import sampling_to_proto as sampling_settings_to_proto
from furlong.v1 import common_pb2
from furlong.v1 import rollout_pb2 as pb


def sampling_to_proto(config: SamplingConfig) -> common_pb2.SamplingParams:
    return sampling_settings_to_proto(config.settings(), config.seed)


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingConfig:
    """The request's sampling settings and seed; SettingError (a ValueError) naming the field."""
    return from_proto(SamplingConfig, msg, "sampling")


def run_config_to_proto(config: RolloutRunConfig) -> pb.ConfigureRolloutRequest:
    return pb.ConfigureRolloutRequest(
        run_id=config.run_id,
        model_dir=config.model_dir,
        task=config.task,
        seed=config.seed,
        rollout=rollout_to_proto(config.rollout),
        reward=config.reward,
        precision=precision_to_proto(config.precision),
        data=to_proto(config.data, pb.DataConfig()),
        reward_config=to_proto(config.reward_config, pb.RewardConfig()),
        environment=to_proto(config.environment, pb.EnvironmentConfig())
        if config.environment.enabled
        else None,
        agent=to_proto(config.agent, pb.AgentConfig()) if config.agent.enabled else None,
    )


def run_config_from_proto(msg: pb.ConfigureRolloutRequest) -> RolloutRunConfig:
    return RolloutRunConfig(
        run_id=msg.run_id,
        model_dir=msg.model_dir,
        seed=msg.seed,
        task=msg.task,
        reward=msg.reward,
        rollout=rollout_from_proto(msg.rollout),
        precision=precision_from_proto(msg.precision),
        # absent: no dataset / no weighted reward; present: every field is sent, none defaulted
        data=from_proto(DataSettings, msg.data, "data") if msg.HasField("data") else DataSettings(),
        reward_config=(
            from_proto(RewardSettings, msg.reward_config, "reward")
            if msg.HasField("reward_config")
            else RewardSettings()
        ),
        environment=(
            from_proto(EnvironmentSettings, msg.environment, "environment")
            if msg.HasField("environment")
            else EnvironmentSettings()
        ),
        agent=from_proto(AgentSettings, msg.agent, "agent") if msg.HasField("agent") else AgentSettings(),
    )


def request_to_proto(request: GenerateRequest) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        run_id=request.run_id,
        step=request.step,
        prompts=[prompt_to_proto(p) for p in request.prompts],
        samples_per_prompt=request.samples_per_prompt,
        sampling=sampling_to_proto(request.sampling),
        min_policy_version=request.min_policy_version,
        timeout_s=request.timeout_s,
        num_groups=request.num_groups,
        share=request.share,
        num_shares=request.num_shares,
    )


def request_from_proto(msg: pb.GenerateRequest) -> GenerateRequest:
    if not msg.HasField("sampling"):
        raise ValueError(f"run {msg.run_id}: sampling is required")
    return GenerateRequest(
        run_id=msg.run_id,
        step=msg.step,
        samples_per_prompt=msg.samples_per_prompt,
        sampling=sampling_from_proto(msg.sampling),
        num_groups=msg.num_groups,
        min_policy_version=msg.min_policy_version,
        timeout_s=msg.timeout_s,
        prompts=tuple(prompt_from_proto(p) for p in msg.prompts),
        share=msg.share,
        num_shares=msg.num_shares or 1,
    )


def prompt_to_proto(prompt: Prompt) -> pb.Prompt:
    return pb.Prompt(prompt_id=prompt.prompt_id, text=prompt.text, answer=prompt.answer)


def prompt_from_proto(msg: pb.Prompt) -> Prompt:
    return Prompt(prompt_id=msg.prompt_id, text=msg.text, answer=msg.answer)


def run_info_to_proto(info: RunInfo) -> pb.ConfigureRolloutResponse:
    return pb.ConfigureRolloutResponse(
        run_id=info.run_id, policy_version=info.policy_version, engine_ids=info.engine_ids
    )


def run_info_from_proto(msg: pb.ConfigureRolloutResponse) -> RunInfo:
    return RunInfo(run_id=msg.run_id, policy_version=msg.policy_version, engine_ids=list(msg.engine_ids))


def result_to_proto(result: GenerateResult) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        run_id=result.run_id,
        step=result.step,
        num_groups=result.num_groups,
        num_samples=result.num_samples,
        reward_mean=result.reward_mean,
        policy_version=result.policy_version,
        num_tokens=result.num_tokens,
        generate_seconds=result.generate_seconds,
        num_groups_dropped=result.num_groups_dropped,
        num_groups_refilled=result.num_groups_refilled,
        num_groups_surplus=result.num_groups_surplus,
        request_id=result.request_id,
        num_groups_resumed=result.num_groups_resumed,
        num_reward_failures=result.num_reward_failures,
    )


def result_from_proto(msg: pb.GenerateResponse) -> GenerateResult:
    return GenerateResult(
        run_id=msg.run_id,
        step=msg.step,
        num_groups=msg.num_groups,
        num_samples=msg.num_samples,
        reward_mean=msg.reward_mean,
        policy_version=msg.policy_version,
        num_tokens=msg.num_tokens,
        generate_seconds=msg.generate_seconds,
        num_groups_dropped=msg.num_groups_dropped,
        num_groups_refilled=msg.num_groups_refilled,
        num_groups_surplus=msg.num_groups_surplus,
        request_id=msg.request_id,
        num_groups_resumed=msg.num_groups_resumed,
        num_reward_failures=msg.num_reward_failures,
    )


_STATE_TO_PROTO = {
    EngineState.SERVING: pb.ENGINE_STATE_SERVING,
    EngineState.DRAINING: pb.ENGINE_STATE_DRAINING,
    EngineState.DRAINED: pb.ENGINE_STATE_DRAINED,
}
_STATE_FROM_PROTO = {v: k for k, v in _STATE_TO_PROTO.items()}


def engine_status_to_proto(e: EngineStatus) -> pb.EngineStatus:
    return pb.EngineStatus(
        engine_id=e.engine_id,
        policy_version=e.policy_version,
        healthy=e.healthy,
        state=_STATE_TO_PROTO[e.state],
        pid=e.pid,
        restarts=e.restarts,
        in_flight=e.in_flight,
    )


def engine_status_from_proto(msg: pb.EngineStatus) -> EngineStatus:
    if msg.state not in _STATE_FROM_PROTO:
        raise ValueError(f"engine {msg.engine_id}: unknown engine state {msg.state}")
    return EngineStatus(
        engine_id=msg.engine_id,
        policy_version=msg.policy_version,
        healthy=msg.healthy,
        state=_STATE_FROM_PROTO[msg.state],
        pid=msg.pid,
        restarts=msg.restarts,
        in_flight=msg.in_flight,
    )


def status_to_proto(status: RunStatus) -> pb.RolloutStatus:
    c = status.ledger
    return pb.RolloutStatus(
        run_id=status.run_id,
        engines=[engine_status_to_proto(e) for e in status.engines],
        ledger=pb.LedgerCounts(
            pending=c.pending,
            in_flight=c.in_flight,
            done=c.done,
            surplus=c.surplus,
            duplicates_refused=c.duplicates_refused,
        ),
    )


def status_from_proto(msg: pb.RolloutStatus) -> RunStatus:
    c = msg.ledger
    return RunStatus(
        run_id=msg.run_id,
        engines=[engine_status_from_proto(e) for e in msg.engines],
        ledger=LedgerCounts(
            pending=c.pending,
            in_flight=c.in_flight,
            done=c.done,
            surplus=c.surplus,
            duplicates_refused=c.duplicates_refused,
        ),
    )


def evaluate_request_to_proto(request: EvaluateRequest) -> pb.EvaluateRequest:
    return pb.EvaluateRequest(
        run_id=request.run_id,
        step=request.step,
        samples_per_prompt=request.samples_per_prompt,
        sampling=sampling_to_proto(request.sampling),
        max_prompts=request.max_prompts,
        min_policy_version=request.min_policy_version,
        timeout_s=request.timeout_s,
    )


def evaluate_request_from_proto(msg: pb.EvaluateRequest) -> EvaluateRequest:
    if not msg.HasField("sampling"):
        raise ValueError("sampling: required field is missing")
    return EvaluateRequest(
        run_id=msg.run_id,
        step=msg.step,
        samples_per_prompt=msg.samples_per_prompt,
        sampling=sampling_from_proto(msg.sampling),
        max_prompts=msg.max_prompts,
        min_policy_version=msg.min_policy_version,
        timeout_s=msg.timeout_s,
    )


def evaluate_result_to_proto(result: EvaluateResult) -> pb.EvaluateResponse:
    return pb.EvaluateResponse(
        run_id=result.run_id,
        step=result.step,
        policy_version=result.policy_version,
        groups=[pb.EvalGroup(prompt_id=g.prompt_id, rewards=list(g.rewards)) for g in result.groups],
        num_tokens=result.num_tokens,
        generate_seconds=result.generate_seconds,
    )


def evaluate_result_from_proto(msg: pb.EvaluateResponse) -> EvaluateResult:
    return EvaluateResult(
        run_id=msg.run_id,
        step=msg.step,
        policy_version=msg.policy_version,
        groups=tuple(EvalGroup(prompt_id=g.prompt_id, rewards=tuple(g.rewards)) for g in msg.groups),
        num_tokens=msg.num_tokens,
        generate_seconds=msg.generate_seconds,
    )
