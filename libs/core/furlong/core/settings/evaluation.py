"""How a run evaluates its policy on its evaluation rows (`data.eval`), as the REST run spec
(`eval`) declares it: after every `every_steps`-th step (and the last), the controller asks rollout
to generate `samples_per_prompt` responses at `temperature` for each of the first `max_prompts`
evaluation rows with the policy of that step, scores them with the run's reward and records
`eval/reward_mean`, `eval/pass@1` and `eval/pass@k` (k = `samples_per_prompt`; a response passes
when its reward is >= `pass_threshold`). Evaluation samples are never written to the sample stream
or the group ledger: nothing trains on them. The request is `furlong.v1.EvaluateRequest`.
"""

from __future__ import annotations

from dataclasses import dataclass

from furlong.core.settings.fields import SettingError, check_fields, setting
from furlong.core.settings.run_shape import MAX_PROMPTS_PER_STEP, MAX_SAMPLES_PER_PROMPT, MAX_STEPS

MAX_PASS_THRESHOLD = 1e6


@dataclass(frozen=True)
class EvalSettings:
    """`every_steps` = 0 turns evaluation off; a value > 0 needs `data.eval` (the run spec checks)."""

    every_steps: int = setting(
        0, ge=0, le=MAX_STEPS, doc="evaluate after every N-th step and the last; 0 = no evaluation"
    )
    samples_per_prompt: int = setting(
        1, ge=1, le=MAX_SAMPLES_PER_PROMPT, doc="responses per evaluation prompt (the k of pass@k)"
    )
    temperature: float = setting(0.0, ge=0.0, le=100.0, doc="sampling temperature; 0 = greedy (argmax)")
    max_prompts: int = setting(
        0, ge=0, le=MAX_PROMPTS_PER_STEP, doc="the first N evaluation rows; 0 = every row"
    )
    pass_threshold: float = setting(
        1.0,
        ge=-MAX_PASS_THRESHOLD,
        le=MAX_PASS_THRESHOLD,
        doc="a response passes (pass@k) when its reward is >= this",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.samples_per_prompt > 1 and self.temperature == 0.0:
            raise SettingError(
                "samples_per_prompt",
                f"{self.samples_per_prompt} greedy responses (temperature 0) are all the same; "
                "use samples_per_prompt 1 or a temperature > 0",
            )

    @property
    def enabled(self) -> bool:
        return self.every_steps > 0

    def evaluates_at(self, step: int, total_steps: int) -> bool:
        """Whether the policy after `step` of a run of `total_steps` is evaluated."""
        return self.enabled and (step == total_steps or step % self.every_steps == 0)
