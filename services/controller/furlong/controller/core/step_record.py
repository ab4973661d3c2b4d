"""What the controller records for each completed RL step, and how it derives per-step values.

A `StepRecord` is one line of a run's metrics (`GET /v1/runs/{id}/metrics`, `metrics.jsonl`).
Knows nothing about where records are stored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# Sampling seeds of consecutive steps must differ (the same seed, prompt and weights give the same
# tokens); spacing run seeds this far apart keeps two runs' per-step seeds from overlapping.
_SEED_STRIDE = 1_000_003


def sampling_seed(run_seed: int, step: int) -> int:
    """The SamplingParams.seed the rollout uses for step (1-based) of a run with run_seed."""
    if run_seed < 0 or step < 1:
        raise ValueError(f"sampling_seed needs run_seed >= 0 and step >= 1, got {run_seed}, {step}")
    return run_seed * _SEED_STRIDE + step


@dataclass(frozen=True)
class StepRecord:
    step: int
    reward_mean: float  # mean reward of the step's samples, as rollout scored them
    loss: float
    policy_version: int  # the version committed at the end of the step
    samples: int  # samples generated (and trained on) in the step
    step_seconds: float  # wall time of the whole step as the controller saw it
    generate_seconds: float  # rollout.Generate
    train_seconds: float  # trainer.TrainStep
    sync_seconds: float  # trainer.PublishWeights + broker.WaitCommitted
    num_tokens: int = 0  # generated tokens
    sampled_policy_version: int = 0  # the version the step's samples were drawn with
    trainer_metrics: dict[str, float] = field(default_factory=dict)
    reward_failures: int = 0  # groups whose reward failed (infrastructure), left out or resampled
    # The evaluation of the step's policy (`eval/reward_mean`, `eval/pass@1`, ...; see
    # core.eval_metrics); empty on steps without one.
    eval_metrics: dict[str, float] = field(default_factory=dict)
    # Versions the trained policy was ahead of the policy that drew each trained sample: mean and
    # maximum over the step's samples. 0 in the synchronous loop; at most rollout.max_staleness in
    # asynchronous mode.
    staleness_mean: float = 0.0
    staleness_max: int = 0

    def __post_init__(self) -> None:
        if self.step < 1:
            raise ValueError(f"step must be >= 1, got {self.step}")
        for name in (
            "reward_mean",
            "loss",
            "step_seconds",
            "generate_seconds",
            "train_seconds",
            "sync_seconds",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or math.isnan(value):
                raise ValueError(f"step {self.step}: {name} must be a number, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "reward_mean": self.reward_mean,
            "loss": self.loss,
            "policy_version": self.policy_version,
            "samples": self.samples,
            "step_seconds": self.step_seconds,
            "generate_seconds": self.generate_seconds,
            "train_seconds": self.train_seconds,
            "sync_seconds": self.sync_seconds,
            "num_tokens": self.num_tokens,
            "sampled_policy_version": self.sampled_policy_version,
            "trainer_metrics": dict(self.trainer_metrics),
            "reward_failures": self.reward_failures,
            "eval_metrics": dict(self.eval_metrics),
            "staleness_mean": self.staleness_mean,
            "staleness_max": self.staleness_max,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepRecord:
        return cls(
            **{
                **data,
                "trainer_metrics": dict(data.get("trainer_metrics", {})),
                "eval_metrics": dict(data.get("eval_metrics", {})),
            }
        )
