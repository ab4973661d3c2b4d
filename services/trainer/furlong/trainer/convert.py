"""Conversions between `furlong.v1` trainer messages and the trainer's plain values (`api`), shared by
the server and the gRPC client, each written once. Free of torch."""

from __future__ import annotations

from furlong.core.settings import CheckpointSettings, MegatronSettings, ParallelSettings
from furlong.rpc.settings import (
    algorithm_from_proto,
    algorithm_to_proto,
    from_proto,
    precision_from_proto,
    precision_to_proto,
    to_proto,
)
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
from furlong.v1 import trainer_pb2 as pb


def config_to_proto(config: TrainerRunConfig) -> pb.ConfigureRunRequest:
    return pb.ConfigureRunRequest(
        run_id=config.run_id,
        model_dir=config.model_dir,
        algorithm=algorithm_to_proto(config.algorithm),
        seed=config.seed,
        total_steps=config.total_steps,
        sampling_temperature=config.sampling_temperature,
        checkpoint_every_steps=config.checkpoint.every_steps,
        checkpoint_keep_last=config.checkpoint.keep_last,
        precision=precision_to_proto(config.precision),
        parallel=to_proto(config.parallel, pb.ParallelConfig()),
        backend=config.backend,
        megatron=to_proto(config.megatron, pb.MegatronConfig()),
    )


def config_from_proto(msg: pb.ConfigureRunRequest) -> TrainerRunConfig:
    """ValueError (a SettingError) naming the bad field."""
    config = TrainerRunConfig(
        run_id=msg.run_id,
        model_dir=msg.model_dir,
        algorithm=algorithm_from_proto(msg.algorithm),
        sampling_temperature=msg.sampling_temperature,
        seed=msg.seed,
        total_steps=msg.total_steps,
        checkpoint=CheckpointSettings(
            every_steps=msg.checkpoint_every_steps,
            # 0: a client that does not send it (an older one) gets the default
            keep_last=msg.checkpoint_keep_last or CheckpointSettings().keep_last,
        ),
        precision=precision_from_proto(msg.precision),
        # absent (an older client): one rank
        parallel=(
            from_proto(ParallelSettings, msg.parallel, "trainer.parallel")
            if msg.HasField("parallel")
            else ParallelSettings()
        ),
        backend=msg.backend or "torch",  # "": an older client
        megatron=(
            from_proto(
                MegatronSettings,
                msg.megatron,
                "trainer.megatron",
                context_parallel=msg.megatron.context_parallel or 1,  # 0: an older client's
            )
            if msg.HasField("megatron")
            else MegatronSettings()
        ),
    )
    config.check_trainer()
    return config


def run_to_proto(run: TrainerRun) -> pb.ConfigureRunResponse:
    return pb.ConfigureRunResponse(
        run_id=run.run_id, policy_version=run.policy_version, num_parameters=run.num_parameters
    )


def run_from_proto(msg: pb.ConfigureRunResponse) -> TrainerRun:
    return TrainerRun(run_id=msg.run_id, policy_version=msg.policy_version, num_parameters=msg.num_parameters)


def step_request_to_proto(request: TrainStepRequest) -> pb.TrainStepRequest:
    return pb.TrainStepRequest(
        run_id=request.run_id,
        step=request.step,
        num_groups=request.num_groups,
        timeout_s=request.timeout_s,
        step_groups_only=request.step_groups_only,
    )


def step_request_from_proto(msg: pb.TrainStepRequest) -> TrainStepRequest:
    return TrainStepRequest(
        run_id=msg.run_id,
        step=msg.step,
        num_groups=msg.num_groups,
        timeout_s=msg.timeout_s,
        step_groups_only=msg.step_groups_only,
    )


def step_result_to_proto(result: TrainStepResult) -> pb.TrainStepResponse:
    return pb.TrainStepResponse(
        run_id=result.run_id,
        step=result.step,
        loss=result.loss,
        policy_version=result.policy_version,
        num_samples=result.num_samples,
        num_groups=result.num_groups,
        step_seconds=result.step_seconds,
        metrics=result.metrics,
    )


def step_result_from_proto(msg: pb.TrainStepResponse) -> TrainStepResult:
    return TrainStepResult(
        run_id=msg.run_id,
        step=msg.step,
        loss=msg.loss,
        policy_version=msg.policy_version,
        num_samples=msg.num_samples,
        num_groups=msg.num_groups,
        step_seconds=msg.step_seconds,
        metrics=dict(msg.metrics),
    )


def published_to_proto(p: Published) -> pb.PublishWeightsResponse:
    return pb.PublishWeightsResponse(
        run_id=p.run_id, version=p.version, num_bytes=p.num_bytes, stage_seconds=p.stage_seconds
    )


def published_from_proto(msg: pb.PublishWeightsResponse) -> Published:
    return Published(
        run_id=msg.run_id, version=msg.version, num_bytes=msg.num_bytes, stage_seconds=msg.stage_seconds
    )


def offloaded_to_proto(o: Offloaded) -> pb.OffloadResponse:
    return pb.OffloadResponse(run_id=o.run_id, released_bytes=o.released_bytes, num_tensors=o.num_tensors)


def offloaded_from_proto(msg: pb.OffloadResponse) -> Offloaded:
    return Offloaded(run_id=msg.run_id, released_bytes=msg.released_bytes, num_tensors=msg.num_tensors)


def checkpoint_to_proto(c: CheckpointResult) -> pb.CheckpointResponse:
    return pb.CheckpointResponse(run_id=c.run_id, path=c.path, step=c.step, policy_version=c.policy_version)


def checkpoint_from_proto(msg: pb.CheckpointResponse) -> CheckpointResult:
    return CheckpointResult(
        run_id=msg.run_id, path=msg.path, step=msg.step, policy_version=msg.policy_version
    )


def export_to_proto(e: PolicyExport) -> pb.ExportPolicyResponse:
    return pb.ExportPolicyResponse(
        run_id=e.run_id,
        path=e.path,
        step=e.step,
        policy_version=e.policy_version,
        num_bytes=e.num_bytes,
        shards=list(e.shards),
        final=e.final,
    )


def export_from_proto(msg: pb.ExportPolicyResponse) -> PolicyExport:
    return PolicyExport(
        run_id=msg.run_id,
        path=msg.path,
        step=msg.step,
        policy_version=msg.policy_version,
        num_bytes=msg.num_bytes,
        shards=tuple(msg.shards),
        final=msg.final,
    )
