"""Conversions between `furlong.v1` rollout messages and the rollout service's plain values, shared
by the server and the gRPC client. Free of torch so that clients stay light.
"""

from __future__ import annotations

from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.types import (
    EngineState,
    EngineStatus,
    GenerateResult,
    LedgerCounts,
    Prompt,
    RunInfo,
    RunStatus,
)
from furlong.v1 import common_pb2
from furlong.v1 import rollout_pb2 as pb


def sampling_to_proto(config: SamplingConfig) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=config.temperature,
        top_k=config.top_k,
        top_p=config.top_p,
        max_new_tokens=config.max_new_tokens,
        seed=config.seed,
        stop=list(config.stop),
    )


def sampling_from_proto(msg: common_pb2.SamplingParams, min_p: float = 0.0) -> SamplingConfig:
    """The sampling config of `msg`; min_p travels beside it (GenerateRequest.min_p)."""
    try:
        return SamplingConfig(
            temperature=msg.temperature,
            top_k=msg.top_k,
            top_p=msg.top_p,
            max_new_tokens=msg.max_new_tokens,
            seed=msg.seed,
            min_p=min_p,
            stop=list(msg.stop),
        )
    except ValueError as exc:
        raise ValueError(f"sampling: {exc}") from None


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
