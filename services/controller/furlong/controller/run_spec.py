"""The run spec: what a user asks the controller to run, parsed once from a dict (YAML or JSON).

Its sections are the run settings the services apply, declared once in `furlong.core.settings`
(`sampling`, `algorithm`, `rollout`, `checkpoint`, `precision`, `data`, `reward`, `eval`,
`environment`, `agent`, `trainer`), plus
`recovery`, which only the controller applies. The top-level fields are bounded by the limits the
services enforce too (`furlong.core.settings.run_shape`), so a spec this module accepts is accepted by
every service.
`parse_run_spec` rejects unknown fields, missing required fields, wrong types and out-of-range values
with a `SettingError` whose `field` is the dotted path of the bad value (`sampling.top_p`). Optional
fields have the defaults written in the declarations; the controller stores and returns the fully
resolved spec, so nothing is implied. Knows nothing about files, HTTP or the services the spec is
sent to.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from furlong.core import tasks
from furlong.core.settings import (
    AgentSettings,
    AlgorithmSettings,
    CheckpointSettings,
    DataSettings,
    EnvironmentSettings,
    EvalSettings,
    PrecisionSettings,
    RewardSettings,
    RolloutSettings,
    SamplingSettings,
    SettingError,
    TrainerSettings,
    from_mapping,
    to_mapping,
)
from furlong.core.settings.fields import check_fields, setting
from furlong.core.settings.run_shape import (
    MAX_PROMPTS_PER_STEP,
    MAX_RUN_SEED,
    MAX_SAMPLES_PER_PROMPT,
    MAX_SAMPLES_PER_STEP,
    MAX_STEPS,
)

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
MAX_PATH_CHARS = 4096

__all__ = ["RecoverySpec", "RunSpec", "SettingError", "parse_run_spec"]


@dataclass(frozen=True)
class RecoverySpec:
    """After a service, Redis or the controller fails mid-run, the run resumes from its last
    checkpoint, at most `max_attempts` times; each attempt waits up to `timeout_s` for the services
    to come back. 0 attempts: the run fails at the first such error."""

    max_attempts: int = setting(3, ge=0, le=100)
    timeout_s: float = setting(120.0, gt=0.0, le=24 * 3600.0)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class RunSpec:
    name: str = setting(min_chars=1, max_chars=63, doc=f"the run's name; matches {NAME_PATTERN}")
    model: str = setting(
        min_chars=1,
        max_chars=MAX_PATH_CHARS,
        doc="absolute Hugging Face model directory, as the services will read it",
    )
    steps: int = setting(ge=1, le=MAX_STEPS)
    task: str = setting(
        "",
        max_chars=64,
        choices=("", *tasks.known_tasks()),
        doc="a registered task; empty when the run trains on `data`",
    )
    seed: int = setting(0, ge=0, le=MAX_RUN_SEED)
    prompts_per_step: int = setting(16, ge=1, le=MAX_PROMPTS_PER_STEP, doc="groups trained per step")
    samples_per_prompt: int = setting(8, ge=1, le=MAX_SAMPLES_PER_PROMPT, doc="the group size")
    sampling: SamplingSettings = setting(default_factory=SamplingSettings)
    algorithm: AlgorithmSettings = setting(default_factory=AlgorithmSettings)
    rollout: RolloutSettings = setting(default_factory=RolloutSettings)
    checkpoint: CheckpointSettings = setting(default_factory=CheckpointSettings)
    precision: PrecisionSettings = setting(default_factory=PrecisionSettings)
    recovery: RecoverySpec = setting(default_factory=RecoverySpec)
    data: DataSettings = setting(default_factory=DataSettings)
    reward: RewardSettings = setting(default_factory=RewardSettings)
    environment: EnvironmentSettings = setting(default_factory=EnvironmentSettings)
    agent: AgentSettings = setting(default_factory=AgentSettings)
    eval: EvalSettings = setting(default_factory=EvalSettings)
    trainer: TrainerSettings = setting(default_factory=TrainerSettings)

    def __post_init__(self) -> None:
        check_fields(self)
        if bool(self.task) == self.data.enabled:
            raise SettingError(
                "task",
                "a run has either a task or data (data.train), not both"
                if self.task
                else "a run needs a task or data (data.train)",
            )
        if self.environment.enabled and self.reward.enabled:
            raise SettingError(
                "reward",
                f"environment {self.environment.name!r} scores the run's episodes: no reward section "
                "may have a weight > 0 as well",
            )
        if self.agent.enabled:
            if self.environment.enabled:
                raise SettingError(
                    "agent", "a run has either an agent or an environment (both draw every sample), not both"
                )
            if self.reward.enabled:
                raise SettingError(
                    "reward",
                    f"agent {self.agent.function!r} returns each sample's reward: no reward section "
                    "may have a weight > 0 as well",
                )
            if not self.data.enabled:
                raise SettingError("agent", "an agent needs dataset rows: set data.train")
        if (
            self.data.enabled
            and not self.reward.enabled
            and not self.environment.enabled
            and not self.agent.enabled
        ):
            raise SettingError(
                "reward",
                "a run on data needs a reward: give at least one reward section a weight > 0 "
                "(or an environment, or an agent)",
            )
        if not re.match(NAME_PATTERN, self.name):
            raise SettingError("name", f"must match {NAME_PATTERN}, got {self.name!r}")
        if not self.model.startswith("/"):
            raise SettingError("model", f"must be an absolute path, got {self.model!r}")
        drawn = self.rollout.prompts_to_draw(self.prompts_per_step)
        if drawn * self.samples_per_prompt > MAX_SAMPLES_PER_STEP:
            raise SettingError(
                "prompts_per_step",
                f"{self.prompts_per_step} prompts (drawn {drawn} with rollout.over_sampling "
                f"{self.rollout.over_sampling:g}) x samples_per_prompt {self.samples_per_prompt} is "
                f"{drawn * self.samples_per_prompt} samples per step, more than {MAX_SAMPLES_PER_STEP}",
            )
        if self.sampling.greedy:
            raise SettingError(
                "sampling.temperature",
                "0 (greedy decoding) cannot be trained on: the sampling distribution is a point "
                "mass with log-prob 0 and no gradient; a training run needs a temperature > 0 "
                "(temperature 0 is for generation and evaluation, e.g. `furlong generate`)",
            )
        if self.eval.enabled and not self.data.eval:
            raise SettingError(
                "eval.every_steps",
                f"{self.eval.every_steps} evaluates on the evaluation rows, but data.eval is not set",
            )
        if self.rollout.max_staleness and self.algorithm.off_policy == "none":
            raise SettingError(
                "rollout.max_staleness",
                f"{self.rollout.max_staleness} (asynchronous mode) trains on samples drawn by older "
                "policy versions and requires algorithm.off_policy (tis or mis), got "
                f"algorithm.off_policy {self.algorithm.off_policy!r}",
            )
        if self.rollout.max_refill_rounds and self.samples_per_prompt < 2:
            raise SettingError(
                "rollout.max_refill_rounds",
                "dynamic sampling needs samples_per_prompt >= 2 (a group of one always has equal "
                f"rewards), got samples_per_prompt {self.samples_per_prompt}",
            )

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: sections as dicts, tuples (sampling.stop) as lists."""
        return to_mapping(self)


def parse_run_spec(data: Any) -> RunSpec:
    """A validated RunSpec from its dict form; raises SettingError naming the bad field."""
    spec: RunSpec = from_mapping(RunSpec, data)
    return spec
