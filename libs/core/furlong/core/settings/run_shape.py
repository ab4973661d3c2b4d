"""Bounds on a run's shape that the controller, the trainer and rollout all enforce: steps, seeds,
prompts per step and group sizes. Each bound is written here once; the REST run spec declares its
fields with them and the services check their requests against them. They keep a run within what
the services can hold: a step's samples live in memory on rollout and the trainer at once.
"""

from __future__ import annotations

MAX_STEPS = 10_000_000
MAX_RUN_SEED = 2**32 - 1
MAX_PROMPTS_PER_STEP = 16_384
MAX_SAMPLES_PER_PROMPT = 4_096
MAX_SAMPLES_PER_STEP = 262_144
