"""The run spec: what a user asks the controller to run, parsed once from a dict (YAML or JSON).

Every section is a frozen dataclass validated in `__post_init__`. `parse_run_spec` rejects unknown
fields, missing required fields, wrong types and out-of-range values with a `SpecError` whose `field`
is the dotted path of the bad value (`sampling.top_p`). Optional fields have the defaults written in
the dataclasses below; the controller stores and returns the fully resolved spec, so nothing is
implied. Knows nothing about files, HTTP or the services the spec is sent to.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ALGORITHMS = ("grpo", "dr_grpo", "dapo", "gspo", "reinforce_pp", "ppo")
LOSS_AGGREGATIONS = ("", "token_mean", "seq_mean_token_mean", "seq_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_MODES = ("loss", "reward")
OFF_POLICY = ("none", "tis", "mis")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


MAX_REFILL_ROUNDS = 16
MAX_OVER_SAMPLING = 4.0


class SpecError(ValueError):
    """A run spec value is missing, unknown, of the wrong type or out of range. `field` is the
    dotted path of the bad value; the message starts with it."""

    def __init__(self, field_path: str, problem: str) -> None:
        super().__init__(f"{field_path}: {problem}")
        self.field = field_path
        self.problem = problem

    def under(self, prefix: str) -> SpecError:
        """The same error with its path nested under prefix."""
        return SpecError(f"{prefix}.{self.field}", self.problem)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(name, f"must be an integer, got {value!r}")
    if value < minimum:
        raise SpecError(name, f"must be >= {minimum}, got {value}")


def _check_float(
    name: str, value: Any, low: float, high: float, low_open: bool = False, high_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        hint = " (a string: YAML reads 3e-4 as text, write 3.0e-4)" if isinstance(value, str) else ""
        raise SpecError(name, f"must be a number, got {value!r}{hint}")
    if not math.isfinite(value):
        raise SpecError(name, f"must be finite, got {value}")
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if too_low or too_high:
        lo, hi = ("(" if low_open else "["), (")" if high_open else "]")
        raise SpecError(name, f"must be in {lo}{low:g}, {high:g}{hi}, got {value}")


def _check_str(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise SpecError(name, f"must be a non-empty string, got {value!r}")


# Mirrors furlong.rollout.core.sampling (the rollout service checks again with the same bounds).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def _check_stop(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise SpecError(name, f"must be a list of strings, got {value!r}")
    if len(value) > MAX_STOP_STRINGS:
        raise SpecError(name, f"must have at most {MAX_STOP_STRINGS} strings, got {len(value)}")
    for i, s in enumerate(value):
        if not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS:
            raise SpecError(
                name,
                f"entry {i} must be a non-empty string of at most {MAX_STOP_CHARS} characters, got {s!r}",
            )
    return tuple(value)


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    max_new_tokens: int = 8
    stop: tuple[str, ...] = ()  # stop strings (a list in YAML/JSON); see docs/rollout.md

    def __post_init__(self) -> None:
        _check_float("temperature", self.temperature, 0.0, math.inf, low_open=True, high_open=True)
        _check_int("top_k", self.top_k, 0)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("max_new_tokens", self.max_new_tokens, 1)
        object.__setattr__(self, "stop", _check_stop("stop", self.stop))


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str = "grpo"
    learning_rate: float = 3e-4
    clip_eps: float = 0.2
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # 0 = no clipping
    epochs_per_batch: int = 1
    micro_batch_size: int = 64
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    clip_eps_high: float = 0.0  # upper clip (DAPO clip-higher); 0 = clip_eps
    loss_aggregation: str = ""  # "" = the algorithm's own (see docs/trainer.md)
    kl_coef: float = 0.0  # KL to the frozen initial policy; 0 = no reference model
    kl_estimator: str = "k3"
    kl_mode: str = "loss"  # or "reward" (a per-token penalty subtracted from the reward)
    entropy_coef: float = 0.0
    off_policy: str = "none"  # "tis" (truncate weights at is_high) or "mis" (mask outside [is_low, is_high])
    is_low: float = 0.0
    is_high: float = 2.0
    gamma: float = 1.0  # ppo
    gae_lambda: float = 1.0  # ppo
    value_coef: float = 0.5  # ppo
    value_clip: float = 0.2  # ppo; 0 = no value clipping

    def __post_init__(self) -> None:
        for name, allowed in (
            ("name", ALGORITHMS),
            ("loss_aggregation", LOSS_AGGREGATIONS),
            ("kl_estimator", KL_ESTIMATORS),
            ("kl_mode", KL_MODES),
            ("off_policy", OFF_POLICY),
        ):
            if getattr(self, name) not in allowed:
                raise SpecError(name, f"must be one of {list(allowed)}, got {getattr(self, name)!r}")
        _check_float("learning_rate", self.learning_rate, 0.0, math.inf, low_open=True, high_open=True)
        _check_float("clip_eps", self.clip_eps, 0.0, math.inf, low_open=True, high_open=True)
        _check_float("weight_decay", self.weight_decay, 0.0, math.inf, high_open=True)
        _check_float("max_grad_norm", self.max_grad_norm, 0.0, math.inf, high_open=True)
        _check_int("epochs_per_batch", self.epochs_per_batch, 1)
        _check_int("micro_batch_size", self.micro_batch_size, 1)
        _check_float("adam_beta1", self.adam_beta1, 0.0, 1.0, high_open=True)
        _check_float("adam_beta2", self.adam_beta2, 0.0, 1.0, high_open=True)
        for name in ("clip_eps_high", "kl_coef", "entropy_coef", "is_low", "value_coef", "value_clip"):
            _check_float(name, getattr(self, name), 0.0, math.inf, high_open=True)
        _check_float("is_high", self.is_high, self.is_low, math.inf, low_open=True, high_open=True)
        _check_float("gamma", self.gamma, 0.0, 1.0)
        _check_float("gae_lambda", self.gae_lambda, 0.0, 1.0)


@dataclass(frozen=True)
class RolloutSpec:
    """`max_refill_rounds` > 0 turns on dynamic sampling: a group whose rewards are all equal is
    dropped and drawn again, up to that many rounds. `over_sampling` > 1 asks rollout for
    ceil(prompts_per_step x over_sampling) prompts and trains on the first prompts_per_step groups
    to complete; the rest are cut and recorded as surplus, never trained."""

    num_engines: int = 1
    max_refill_rounds: int = 0
    over_sampling: float = 1.0

    def __post_init__(self) -> None:
        _check_int("num_engines", self.num_engines, 1)
        _check_int("max_refill_rounds", self.max_refill_rounds, 0)
        if self.max_refill_rounds > MAX_REFILL_ROUNDS:
            raise SpecError(
                "max_refill_rounds", f"must be <= {MAX_REFILL_ROUNDS}, got {self.max_refill_rounds}"
            )
        _check_float("over_sampling", self.over_sampling, 1.0, MAX_OVER_SAMPLING)

    def prompts_to_request(self, prompts_per_step: int) -> int:
        return max(prompts_per_step, math.ceil(prompts_per_step * self.over_sampling - 1e-9))


@dataclass(frozen=True)
class CheckpointSpec:
    every_steps: int = 1  # the trainer writes a training checkpoint after every N-th step

    def __post_init__(self) -> None:
        _check_int("every_steps", self.every_steps, 1)


@dataclass(frozen=True)
class RecoverySpec:
    """After a service, Redis or the controller fails mid-run, the run resumes from its last
    checkpoint, at most `max_attempts` times; each attempt waits up to `timeout_s` for the services
    to come back. 0 attempts: the run fails at the first such error."""

    max_attempts: int = 3
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        _check_int("max_attempts", self.max_attempts, 0)
        _check_float("timeout_s", self.timeout_s, 0.0, 24 * 3600.0, low_open=True)


@dataclass(frozen=True)
class RunSpec:
    name: str
    model: str  # absolute checkpoint directory, as the services will read it
    task: str
    steps: int
    seed: int = 0
    prompts_per_step: int = 16
    samples_per_prompt: int = 8
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    algorithm: AlgorithmSpec = field(default_factory=AlgorithmSpec)
    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    recovery: RecoverySpec = field(default_factory=RecoverySpec)

    def __post_init__(self) -> None:
        _check_str("name", self.name)
        if not _NAME_RE.match(self.name):
            raise SpecError("name", f"must match {_NAME_RE.pattern}, got {self.name!r}")
        _check_str("model", self.model)
        if not self.model.startswith("/"):
            raise SpecError("model", f"must be an absolute path, got {self.model!r}")
        _check_str("task", self.task)
        _check_int("steps", self.steps, 1)
        _check_int("seed", self.seed, 0)
        _check_int("prompts_per_step", self.prompts_per_step, 1)
        _check_int("samples_per_prompt", self.samples_per_prompt, 1)
        for name, kind in (
            ("sampling", SamplingSpec),
            ("algorithm", AlgorithmSpec),
            ("rollout", RolloutSpec),
            ("checkpoint", CheckpointSpec),
            ("recovery", RecoverySpec),
        ):
            if not isinstance(getattr(self, name), kind):
                raise SpecError(name, f"must be a {kind.__name__}")
        if self.rollout.max_refill_rounds and self.samples_per_prompt < 2:
            raise SpecError(
                "rollout.max_refill_rounds",
                f"dynamic sampling needs samples_per_prompt >= 2 (a group of one always "
                f"has equal rewards), got samples_per_prompt {self.samples_per_prompt}",
            )

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: sections as dicts, tuples (sampling.stop) as lists."""
        return dataclasses.asdict(
            self, dict_factory=lambda items: {k: list(v) if isinstance(v, tuple) else v for k, v in items}
        )


_SECTIONS: dict[str, type] = {
    "sampling": SamplingSpec,
    "algorithm": AlgorithmSpec,
    "rollout": RolloutSpec,
    "checkpoint": CheckpointSpec,
    "recovery": RecoverySpec,
}


def _float_fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.type in ("float", float)}


def _build(cls: type, data: Any, prefix: str) -> Any:
    """Construct cls from a mapping, naming unknown or missing fields by their full path."""
    where = prefix or "spec"
    if not isinstance(data, Mapping):
        raise SpecError(where, f"must be a mapping, got {type(data).__name__}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    path = (lambda key: f"{prefix}.{key}") if prefix else (lambda key: str(key))
    for key in data:
        if key not in known:
            raise SpecError(path(key), f"unknown field (known: {', '.join(known)})")
    floats = _float_fields(cls)
    kwargs: dict[str, Any] = {}
    for name, f in known.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SpecError(path(name), "required field is missing")
            continue
        value = data[name]
        if not prefix and name in _SECTIONS:
            value = _build(_SECTIONS[name], value, name)
        elif name in floats and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except SpecError as err:
        raise (err.under(prefix) if prefix else err) from None


def parse_run_spec(data: Any) -> RunSpec:
    """A validated RunSpec from its dict form; raises SpecError naming the bad field."""
    return _build(RunSpec, data, "")
