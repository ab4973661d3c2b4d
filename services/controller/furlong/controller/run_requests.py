"""What the controller asks each service for a run, built from its spec in one place for the driver
and the recovery: the trainer's and rollout's ConfigureRun, a step's Generate and TrainStep, and an
evaluation's Evaluate. Knows nothing about transports."""

from __future__ import annotations

import dataclasses

from furlong.controller.config import DriverTimeouts
from furlong.controller.core.step_record import sampling_seed
from furlong.controller.run_spec import RunSpec
from furlong.rollout.api import EvaluateRequest, GenerateRequest, RolloutRunConfig, SamplingConfig
from furlong.trainer.api import TrainerRunConfig, TrainStepRequest


def trainer_config(run_id: str, spec: RunSpec) -> TrainerRunConfig:
    return TrainerRunConfig(
        run_id=run_id,
        model_dir=spec.model,
        algorithm=spec.algorithm,
        sampling_temperature=spec.sampling.temperature,
        seed=spec.seed,
        total_steps=spec.steps,
        checkpoint=spec.checkpoint,
        precision=spec.precision,
        parallel=spec.trainer.parallel,
        backend=spec.trainer.backend,
        megatron=spec.trainer.megatron,
    )


def rollout_config(run_id: str, spec: RunSpec) -> RolloutRunConfig:
    return RolloutRunConfig(
        run_id=run_id,
        model_dir=spec.model,
        seed=spec.seed,
        task=spec.task,
        rollout=spec.rollout,
        precision=spec.precision,
        data=spec.data,
        reward_config=spec.reward,
        environment=spec.environment,
        agent=spec.agent,
    )


def generate_request(
    run_id: str, spec: RunSpec, step: int, min_version: int, timeouts: DriverTimeouts
) -> GenerateRequest:
    """The step's groups: rollout draws the prompts from the run's task and decides which groups are
    written (over-sampling, dynamic sampling, groups an earlier attempt already wrote)."""
    return GenerateRequest(
        run_id=run_id,
        step=step,
        samples_per_prompt=spec.samples_per_prompt,
        sampling=SamplingConfig.of(spec.sampling, sampling_seed(spec.seed, step)),
        num_groups=spec.prompts_per_step,
        min_policy_version=min_version,
        timeout_s=timeouts.generate_s,
    )


# Evaluation seeds sit above every step's sampling seed (at most ~2**52), so an evaluation never
# draws with the random stream of a training step.
EVAL_SEED_OFFSET = 1 << 62


def evaluate_request(
    run_id: str, spec: RunSpec, step: int, min_version: int, timeouts: DriverTimeouts
) -> EvaluateRequest:
    """The evaluation after `step`: the run's sampling settings with the evaluation's temperature,
    drawn with the policy committed at the step (`min_version`)."""
    settings = dataclasses.replace(spec.sampling, temperature=spec.eval.temperature)
    return EvaluateRequest(
        run_id=run_id,
        step=step,
        samples_per_prompt=spec.eval.samples_per_prompt,
        sampling=SamplingConfig.of(settings, EVAL_SEED_OFFSET + sampling_seed(spec.seed, step)),
        max_prompts=spec.eval.max_prompts,
        min_policy_version=min_version,
        timeout_s=timeouts.generate_s,
    )


def train_request(
    run_id: str, spec: RunSpec, step: int, num_groups: int, timeouts: DriverTimeouts
) -> TrainStepRequest:
    """In asynchronous mode the stream holds groups of the steps generated ahead: the step reads
    only its own."""
    return TrainStepRequest(
        run_id=run_id,
        step=step,
        num_groups=num_groups,
        timeout_s=timeouts.train_s,
        step_groups_only=spec.rollout.max_staleness > 0,
    )
