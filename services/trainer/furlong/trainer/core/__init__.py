"""The trainer's pure learning core: RL objectives and the learner that applies them to a model.

No gRPC, no Redis, no files: plain tensors, models and `furlong.core.samples` objects.
"""

from furlong.trainer.core.learner import Learner, LearnerConfig, StepStats

__all__ = ["Learner", "LearnerConfig", "StepStats"]
