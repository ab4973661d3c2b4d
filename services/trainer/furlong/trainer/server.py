"""gRPC transport of the trainer: converts furlong.v1 messages to `TrainerService` calls and back.
Errors are mapped to status codes by `furlong.rpc.rpc_errors`, nowhere else."""

from __future__ import annotations

from furlong.rpc import rpc_errors
from furlong.trainer.core.learner import LearnerConfig
from furlong.trainer.core.objectives import ALGORITHMS
from furlong.trainer.service import TrainerService
from furlong.v1 import trainer_pb2, trainer_pb2_grpc

SERVICE_NAME = "furlong.v1.Trainer"
SUPPORTED_ALGORITHMS = ALGORITHMS
_OPTIONAL = ("is_high", "gamma", "gae_lambda", "value_coef", "value_clip")  # unset = LearnerConfig default


def learner_config(request: trainer_pb2.ConfigureRunRequest) -> LearnerConfig:
    algo = request.algorithm
    if algo.name not in SUPPORTED_ALGORITHMS:
        raise ValueError(
            f"algorithm.name {algo.name!r} is not supported; known: {list(SUPPORTED_ALGORITHMS)}"
        )
    return LearnerConfig(
        learning_rate=algo.learning_rate,
        clip_eps=algo.clip_eps,
        weight_decay=algo.weight_decay,
        max_grad_norm=algo.max_grad_norm,
        epochs_per_batch=algo.epochs_per_batch,
        micro_batch_size=algo.micro_batch_size,
        adam_beta1=algo.adam_beta1,
        adam_beta2=algo.adam_beta2,
        temperature=request.sampling_temperature,
        seed=request.seed,
        algorithm=algo.name,
        clip_eps_high=algo.clip_eps_high,
        loss_aggregation=algo.loss_aggregation,
        kl_coef=algo.kl_coef,
        kl_estimator=algo.kl_estimator or "k3",
        kl_mode=algo.kl_mode or "loss",
        entropy_coef=algo.entropy_coef,
        off_policy=algo.off_policy or "none",
        is_low=algo.is_low,
        **{name: getattr(algo, name) for name in _OPTIONAL if algo.HasField(name)},
    )


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, service: TrainerService):
        self._service = service

    @rpc_errors
    def ConfigureRun(self, request, context):
        version, num_parameters = self._service.configure_run(
            request.run_id, request.model_dir, learner_config(request), request.total_steps
        )
        return trainer_pb2.ConfigureRunResponse(
            run_id=request.run_id, policy_version=version, num_parameters=num_parameters
        )

    @rpc_errors
    def TrainStep(self, request, context):
        stats, version = self._service.train_step(
            request.run_id, request.step, request.num_groups, request.timeout_s
        )
        return trainer_pb2.TrainStepResponse(
            run_id=request.run_id,
            step=request.step,
            loss=stats.loss,
            policy_version=version,
            num_samples=stats.num_samples,
            num_groups=stats.num_groups,
            step_seconds=stats.step_seconds,
            metrics=stats.as_metrics(),
        )

    @rpc_errors
    def PublishWeights(self, request, context):
        result = self._service.publish_weights(request.run_id, request.version)
        return trainer_pb2.PublishWeightsResponse(
            run_id=request.run_id,
            version=result.version,
            num_bytes=result.num_bytes,
            stage_seconds=result.stage_seconds,
        )

    @rpc_errors
    def EndRun(self, request, context):
        self._service.end_run(request.run_id)
        return trainer_pb2.EndRunResponse(run_id=request.run_id)

    @rpc_errors
    def Offload(self, request, context):
        released, num_tensors = self._service.offload(request.run_id)
        return trainer_pb2.OffloadResponse(
            run_id=request.run_id, released_bytes=released, num_tensors=num_tensors
        )

    @rpc_errors
    def Restore(self, request, context):
        version = self._service.restore(request.run_id)
        return trainer_pb2.RestoreResponse(run_id=request.run_id, policy_version=version)

    @rpc_errors
    def Checkpoint(self, request, context):
        info = self._service.checkpoint(request.run_id, request.directory)
        return trainer_pb2.CheckpointResponse(
            run_id=request.run_id, path=str(info.path), step=info.step, policy_version=info.version
        )


def register(service: TrainerService):
    """A `furlong.rpc.start_server` registration callback."""
    return lambda server: trainer_pb2_grpc.add_TrainerServicer_to_server(TrainerServicer(service), server)
