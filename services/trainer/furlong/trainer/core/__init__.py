"""The trainer's pure learning core: RL objectives and the learner that applies them to a model.

No gRPC, no Redis, no files: plain tensors, models and `furlong.core.samples` objects.
"""

from furlong.trainer.core.grpo import clipped_policy_loss, group_advantages, token_logprobs
from furlong.trainer.core.learner import Learner, LearnerConfig, StepStats
from furlong.trainer.core.objectives import ALGORITHMS, ObjectiveConfig

__all__ = [
    "ALGORITHMS",
    "Learner",
    "LearnerConfig",
    "ObjectiveConfig",
    "StepStats",
    "clipped_policy_loss",
    "group_advantages",
    "token_logprobs",
]
